"""`--fix=reset`: reset a GPU that owes a reset, with what holds it stopped and started again.

The most common hand-run repair in a GPU fleet, as a remediation of its own:

- check: the GPUs that owe a reset, from this run's facts: the GPU's own signals (`reset_status.
  reset_required`, a `[GPU requires reset]` cell, `remapped_rows.pending`, a recovery action of
  Reset) and the Xids whose action is a GPU reset (modules/health/xid.py); then who holds each
  one: every process with its `/dev/nvidiaN` open (the GPU's minor number from nvidia-smi), by
  the systemd unit it runs in, and legacy persistence mode;
- plan: stop the units that hold it (the inventory's `service` units and nvidia-persistenced:
  the only units this run may stop), persistence mode off, `nvidia-smi -r -i BUS`, persistence
  back on, the units started again. A GPU held by a process outside those units, or bound to
  another driver (vfio-pci: nvidia-smi does not list it), is never reset: the check says who
  holds it and stops there;
- act: each unit stopped with the bounded ladder of modules/service.py (stop, SIGTERM, SIGKILL,
  each checked); the holders read again, and nothing is reset while one is left; the reset
  bounded; every unit this run stopped is started again, whatever failed;
- re-check: the GPU's own signals read again, not the command's exit code: no signal says a
  reset is owed any more;
- reboot (only with `--fix=reset,reboot`): a GPU whose signals still ask for a reset after a
  reset that returned 0 gets the node rebooted (suites/health/reboot.py), its holders read again
  first; then every fact is read again and the GPUs judged from them. Without `reboot` the
  verdict says so in one line ("reset did not clear GPU ...; reboot not allowed") and a node this
  run drained stays drained;
- a debt only a reboot pays (an Xid whose resolution is RESTART_BM, such as Xid 79, or a
  recovery action of Node Reboot Required: reboot.owed_reboots) is planned as a reboot of the
  node, never as a GPU reset: the inventory's units that hold any GPU stopped first, every other
  holder of a GPU refusing it. Under `--fix=reset` alone the check says the node owes a reboot
  and that `--fix=reset,reboot` allows it.

nvidia-smi(1), `-r`: "Trigger a reset of one or more GPUs ... There can't be any applications
using these devices"; the reset "can be used to clear GPU HW and SW state in situations that
would otherwise require a machine reboot". Runs after the drain step (file order), so a Slurm
node with a failed GPU is drained first; the next run resumes it once healthy (drain.py).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Mapping
from typing import Any

from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health.xid import reset_signals
from pytest_gpuhost.modules.journal import Journal, LockBusy
from pytest_gpuhost.modules.service import Service
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError
from pytest_gpuhost.run.remediation import Action, Check, Remediation

from . import compute, cutrun, drain, reboot
from .holders import GpuReset, NodeHolders, gpu_rows, key, plan_node, plan_resets, units
from .reset_gpus import RESET_TIMEOUT, reset_one

__all__ = ["RESET_TIMEOUT", "GpuReset", "ResetRemediation", "owed_resets"]

VERIFY_TIMEOUT = 30.0  # the default of ini health_reset_verify_timeout (options.py)
JOURNAL = "health-reset"  # journal/health-reset.json and lock/health-reset under the agent's state dir
LOCK_WAIT = 30.0  # seconds to wait for another reset run's lock on the host
_SIGNAL_TEXT = {
    "reset_required": "reset_status.reset_required is Yes",
    "nvml_reset_required": "NVML says [GPU requires reset]",
    "remap_pending": "a row remap is pending (applied by a reset)",
    "recovery_action": "the driver's recovery action asks for a reset",
}


def owed_resets(facts: Mapping[str, Any], thresholds: Any) -> dict[str, list[str]]:
    """Return {bus "dddd:bb:dd": why} for every GPU that owes a GPU reset now."""
    out: dict[str, list[str]] = {}
    st = hm.evaluate("xid", facts, thresholds).state or {}
    # a recovery action of Node Reboot Required is a reboot's to pay (reboot.owed_reboots)
    by_reboot = {key(a.get("bdf")) for a in st.get("recovery_actions") or [] if a.get("action") == "reboot"}
    for bus, sig in reset_signals(facts).items():
        for name, value in sig.items():
            if value == 1 and not (name == "recovery_action" and key(bus) in by_reboot):
                out.setdefault(key(bus), []).append(_SIGNAL_TEXT.get(name, name))
    for e in st.get("events") or []:
        if e.get("action") == "reset_gpu" and int(e.get("code", -1)) not in set(thresholds["xid_ignore"]):
            out.setdefault(key(e.get("bdf")), []).append(f"Xid {e.get('code')}: {e.get('msg')}")
    for p in st.get("owed") or []:
        if p.get("action") == "reset_gpu":
            out.setdefault(key(p.get("bdf")), []).append(f"Xid {p.get('code')} still owes a reset")
    for a in st.get("recovery_actions") or []:
        if a.get("action") == "reset_gpu":
            why = f"recovery action {a.get('value')!r}"
            if why not in out.get(key(a.get("bdf")), []):
                out.setdefault(key(a.get("bdf")), []).append(why)
    return {k: list(dict.fromkeys(v)) for k, v in out.items()}


class ResetRemediation(Remediation):
    """The reset remediation of one host: GPUs that owe a reset reset, or the node rebooted.

    The GPUs' signals have `verify_timeout` seconds to clear after the reset. With `reboot` in
    the host's fixes (`--fix=reset,reboot`), a reset they do not confirm is followed by a reboot
    of the node, waited for up to `reboot_timeout` seconds. What `check` finds (the plans, the
    debts, what a cut run left) is kept on the object for `plan`, `fix` and `verify`.
    """

    name = "reset"

    def __init__(
        self,
        hh: Any,
        on_check: Callable[[Check], None] | None = None,
        reboot_timeout: float = reboot.REBOOT_TIMEOUT,
        verify_timeout: float = VERIFY_TIMEOUT,
    ) -> None:
        self.hh = hh
        self.conn = hh.target.conn
        self.on_check = on_check
        self.reboot_timeout = reboot_timeout
        self.verify_timeout = verify_timeout
        self.allow_reboot = "reboot" in hh.fixes
        self.journal = Journal(self.conn, JOURNAL)
        self.leftover: tuple[list[str], list[str]] = ([], [])  # what a cut run left: units, persistence
        self.leftover_by_gpu: Any = ({}, {})
        self.plans: list[GpuReset] = []
        self.owed: set[str] = set()  # the buses that owe a reset
        self.rows: Any = {}
        self.reboots: dict[str, list[str]] = {}
        self.node = NodeHolders()
        self.rebooted: reboot.Rebooted | None = None
        self.left: dict[str, list[str]] | None = None  # what the reset did not clear, once settled

    def check(self) -> Check:
        facts = self.hh.gather()
        old = self.journal.read()
        theirs = self.journal.cut_run(old)
        units_left, gpus_left = cutrun.leftover(theirs)
        self.leftover = (units_left, gpus_left)
        self.leftover_by_gpu = cutrun.by_gpu(theirs)
        owed = owed_resets(facts, self.hh.thresholds)
        gpus = gpu_rows(facts)
        missing = [
            f"{bus}: owes a reset ({'; '.join(why)}) but nvidia-smi does not list it"
            for bus, why in sorted(owed.items())
            if bus not in gpus
        ]
        plans = plan_resets(self.conn, owed, gpus, units(self.hh.thresholds), facts)
        self.plans = plans
        self.owed = {m.bus for p in plans for m in p.members if m.bus in owed}
        self.rows = gpus
        reboots = reboot.owed_reboots(facts, self.hh.thresholds)
        node = plan_node(self.conn, units(self.hh.thresholds)) if reboots else NodeHolders()
        self.reboots, self.node = reboots, node
        state = {
            "gpus": [
                {
                    "bus": p.bus,
                    "why": p.why,
                    "holders_units": p.units,
                    "refused": p.refused,
                    "persistence": p.persistence,
                    "with_peers": [m.bus for m in p.peers],
                    "together": p.together or None,
                }
                for p in plans
            ],
            "not_listed": missing,
            "reboot_owed": {"gpus": reboots, "holders_units": node.units, "refused": node.refused}
            if reboots
            else None,
            "cut_run": {"units_stopped": units_left, "persistence_off": gpus_left, "journal": old}
            if (units_left or gpus_left)
            else None,
        }
        cut: list[str] = []
        if units_left or gpus_left:
            cut.append(
                f"a cut reset run (run {old.get('run_id') if old else '?'}, last step {old.get('phase') if old else '?'}) "
                f"left {', '.join(units_left) or 'no unit'} stopped"
                + (f" and persistence mode off on {', '.join(gpus_left)}" if gpus_left else "")
            )
        if not owed and not cut and not reboots:
            first = Check(ok=True, summary="no GPU owes a reset or a reboot", state=state)
        else:
            parts = cut + [p.owes() for p in plans] + missing
            parts += [f"{b} owes a reboot ({'; '.join(w)})" for b, w in reboots.items()]
            refused = [r for p in plans for r in p.refused]
            if refused:
                parts.append("not reset: " + "; ".join(refused))
            if reboots and not self.allow_reboot:
                parts.append(reboot_not_allowed(self.hh))
            elif node.refused:
                parts.append("not rebooted: " + "; ".join(node.refused))
            first = Check(ok=False, summary="; ".join(parts), state=state)
        if self.on_check is not None:
            self.on_check(first)
        return first

    def _refusals(self, before: Check) -> list[str]:
        if self.reboots and self.allow_reboot:  # the reboot pays every debt: only its holders count
            return list(self.node.refused)
        return [r for p in self.plans for r in p.refused] + list(before.state.get("not_listed") or [])

    def plan(self, before: Check) -> list[Action]:
        plans: list[GpuReset] = self.plans
        units_left, gpus_left = self.leftover
        first: list[Action] = []
        if (units_left or gpus_left) and self.reboots and self.allow_reboot and not self._refusals(before):
            first.append(
                Action(
                    "complete the cut reset run: what it stopped "
                    f"({', '.join(units_left) or 'no unit'}) stays stopped through the reboot this run "
                    "takes, and is started after the boot (from its journal on the host)",
                    "",
                    destructive=False,
                )
            )
        elif units_left or gpus_left:
            cmds = [["nvidia-smi", "-i", g, "-pm", "1"] for g in gpus_left]
            cmds += [["systemctl", "start", "--", u] for u in reversed(units_left)]
            first.append(
                Action(
                    "complete the cut reset run: put back what it stopped (from its journal on the host)",
                    " && ".join(shlex.join(c) for c in cmds),
                )
            )
        if self._refusals(before):
            return first  # no reset: the check's summary says who holds the GPU
        if self.reboots and self.allow_reboot:
            node: NodeHolders = self.node
            why = "; ".join(f"{b} owes a reboot ({', '.join(w)})" for b, w in self.reboots.items())
            cmds = [["systemctl", "stop", "--", u] for u in node.units] + [["systemctl", "reboot"]]
            return first + [
                Action(
                    f"reboot the node: {why}; no GPU reset (it does not pay this debt); "
                    f"stop {', '.join(node.units) or 'no unit'} first (bounded), wait up to "
                    f"{self.reboot_timeout:g} s for SSH with a new boot id, then start any stopped unit "
                    "that systemd did not",
                    " && ".join(shlex.join(c) for c in cmds),
                )
            ]
        actions = first + [
            Action(
                f"reset GPU {p.smi_id} ({'; '.join(p.why)})"
                + (
                    f" with its NVLink peers {', '.join(p.ids[1:])} in one command (nvidia-smi(1) -r: {p.together})"
                    if p.peers
                    else ""
                ),
                " && ".join(shlex.join(c) for c in p.commands()),
            )
            for p in plans
        ]
        if self.allow_reboot and plans:
            actions.append(
                Action(
                    "reboot the node, only if a GPU still owes a reset after its reset (its holders "
                    f"read again first); wait up to {self.reboot_timeout:g} s for SSH with a new boot id, "
                    "then start any stopped unit that systemd did not",
                    shlex.join(["systemctl", "reboot"]),
                )
            )
        return actions

    def fix(self, actions: list[Action], before: Check) -> None:
        try:
            self.journal.acquire(wait=LOCK_WAIT, owner={"procedure": "health reset"})
        except LockBusy as exc:
            raise ProcedureError(str(exc)) from None
        try:
            units_left, gpus_left = self.leftover
            refused = self._refusals(before)
            if self.reboots and self.allow_reboot and not refused:
                # The node owes a reboot: what a cut run stopped (for a reset, or for the reboot it
                # did not get to) stays stopped through this one and is started after the boot,
                # journaled again before anything else is done, so a second cut loses nothing.
                self.rebooted = reboot.reboot_owed(
                    self.hh,
                    self.reboots,
                    self.reboot_timeout,
                    self.journal,
                    kept=units_left,
                    kept_persistence=gpus_left,
                )
                return
            if units_left or gpus_left:
                # A GPU the cut run was resetting, that still owes its reset, is reset with what
                # the cut run stopped still stopped (each unit journaled again by reset_one, so
                # a second cut loses nothing); whatever else it left is put back now.
                by_gpu, pers = self.leftover_by_gpu
                plans = [] if refused else self.plans
                planned = {i for p in plans for i in p.ids}
                for p in plans:
                    p.units = list(dict.fromkeys([*(u for i in p.ids for u in by_gpu.get(i, [])), *p.units]))
                    for m in p.members:
                        m.persistence = m.persistence or bool(pers.get(m.smi_id))
                covered = {u for g in planned for u in by_gpu.get(g, [])}
                rest = [u for u in units_left if u not in covered]
                for note in cutrun.complete(self.conn, rest, [g for g in gpus_left if g not in planned]):
                    evidence.current().note(f"reset: cut run completed: {note}")
                if not self.plans or refused:
                    self.journal.retire()
            if refused:
                raise ProcedureError(
                    ("no reboot: " if self.reboots and self.allow_reboot else "no GPU reset: ")
                    + "; ".join(refused)
                    + " (stop it, or name its unit in the inventory's `service`)"
                )
            for p in self.plans:
                reset_one(self.conn, p, self.journal)
            self.left = left = self._settle()
            if left and self.allow_reboot:
                self.rebooted = reboot.reboot_node(
                    self.hh, self.plans, self.rows, left, self.reboot_timeout, self.journal
                )
        finally:
            try:
                if self.journal.data and cutrun.leftover(self.journal.data) == ([], []):
                    self.journal.retire()  # nothing of this run is left to put back
            finally:
                self.journal.release()

    def _settle(self) -> dict[str, list[str]]:
        """Re-read the GPUs' signals (bounded) until none of the reset ones asks for a reset."""
        deadline = time.monotonic() + self.verify_timeout
        want = self.owed
        while True:
            fresh = self.hh._facts(parts=["gpus", "remap"])
            left = {bus: why for bus, why in owed_resets_signals(fresh).items() if bus in want}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(1)
        if self.hh.facts is not None:
            self.hh.facts.update({k: fresh[k] for k in ("gpus", "remap") if k in fresh})
            self.hh.verdicts.clear()
        return left

    def verify(self) -> Check:
        want = self.owed
        units_left, _ = self.leftover
        down = [u for u in units_left if not Service(self.conn, u).state().running]
        if down:
            return Check(ok=False, summary=f"the cut run's units are not active again: {', '.join(down)}")
        if self.reboots:
            return self._verify_reboot()
        if not want:
            return Check(
                ok=True, summary=f"the cut reset run completed: {', '.join(units_left)} active again"
            )
        done: reboot.Rebooted | None = self.rebooted
        if done is not None:
            # every fact again, after the reboot: the GPUs' signals and the Xids still owed
            left = owed_resets(self.hh.gather(), self.hh.thresholds)
            if left:
                return Check(
                    ok=False,
                    summary=f"still owed after the reset and a reboot (boot id {done.new}): "
                    + "; ".join(f"{b}: {', '.join(w)}" for b, w in left.items()),
                )
            fine, line = self._recovered([i for p in self.plans for i in p.ids], fresh=True)
            return Check(
                ok=fine,
                summary=f"{len(want)} GPU(s) reset, then the node rebooted ({done.seconds:.0f} s to "
                f"a new boot id); no GPU owes a reset; {line}",
                state={
                    "boot_id": {"before": done.old, "after": done.new},
                    "reboot_s": round(done.seconds, 1),
                },
            )
        left = self.left if self.left is not None else self._settle()
        if left and not self.allow_reboot:
            shown = {m.bus: m.smi_id for p in self.plans for m in p.members}
            gpus = ", ".join(f"{shown.get(b, b)} ({', '.join(w)})" for b, w in left.items())
            return Check(
                ok=False,
                summary=f"reset did not clear GPU {gpus}; reboot not allowed (--fix=reset,reboot "
                f"allows it); {drain.reset_note(self.hh)}",
            )
        if left:
            return Check(
                ok=False,
                summary="still owed after the reset: "
                + "; ".join(f"{b}: {', '.join(w)}" for b, w in left.items()),
            )
        fine, line = self._recovered([i for p in self.plans for i in p.ids])
        peers = sum(len(p.peers) for p in self.plans)
        also = f" (with {peers} NVLink peer(s) in the same command)" if peers else ""
        return Check(
            ok=fine, summary=f"{len(want)} GPU(s) reset{also}; their signals no longer ask for one; {line}"
        )

    def _recovered(self, gpus: list[str], fresh: bool = False) -> tuple[bool, str]:
        """The compute check on the recovered GPUs, then the node returned (drain.return_node).

        `fresh`: every fact was read after a reboot; the return judges the node on them.
        """
        fine, line = compute.compute_check(self.conn, gpus)
        if not fine:
            return False, f"{line}; {drain.reset_note(self.hh)}"
        back_ok, back = drain.return_node(self.hh, fresh=fresh)
        return back_ok, f"{line}; {back}" if back else line

    def _verify_reboot(self) -> Check:
        """The re-check of a node that owed a reboot: every fact again, every debt paid."""
        done: reboot.Rebooted | None = self.rebooted
        if not self.allow_reboot:  # the GPUs that owed a reset were reset all the same
            still = self.left or {}
            also = ""
            if self.left is not None:
                also = f"; {len(self.plans) - len(still)} of {len(self.plans)} GPU(s) owing a reset cleared by it"
            return Check(ok=False, summary=f"{reboot_not_allowed(self.hh)}{also}")
        if done is None:
            return Check(ok=False, summary="the node owes a reboot and was not rebooted")
        facts = self.hh.gather()
        left = {**owed_resets(facts, self.hh.thresholds)}
        for b, w in reboot.owed_reboots(facts, self.hh.thresholds).items():
            left.setdefault(b, []).extend(w)
        down = [u for u in done.units if not Service(self.conn, u).state().running]
        if left or down:
            return Check(
                ok=False,
                summary=f"after the reboot (boot id {done.new}): "
                + "; ".join(
                    [f"{b}: {', '.join(w)}" for b, w in left.items()]
                    + ([f"not active again: {', '.join(down)}"] if down else [])
                ),
            )
        paid = ", ".join(sorted(self.reboots))
        fine, line = self._recovered(sorted(self.reboots), fresh=True)
        return Check(
            ok=fine,
            summary=f"the node rebooted ({done.seconds:.0f} s to a new boot id) for {paid}; no GPU "
            f"owes a reset or a reboot; {', '.join(done.units) or 'no unit'} active again; {line}",
            state={
                "boot_id": {"before": done.old, "after": done.new},
                "reboot_s": round(done.seconds, 1),
                "units": done.units,
            },
        )


def reboot_not_allowed(hh: Any) -> str:
    """The line for a node that owes a reboot under `--fix=reset` alone."""
    return f"the node owes a reboot, which --fix=reset does not do (--fix=reset,reboot allows it); {drain.reset_note(hh)}"


def owed_resets_signals(facts: Mapping[str, Any]) -> dict[str, list[str]]:
    """The GPUs whose own signals still ask for a reset (the re-check: no kernel log involved)."""
    out: dict[str, list[str]] = {}
    for bus, sig in reset_signals(facts).items():
        for name, value in sig.items():
            if value == 1:
                out.setdefault(key(bus), []).append(_SIGNAL_TEXT.get(name, name))
    return out

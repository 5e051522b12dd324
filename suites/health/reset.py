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
  reset is owed any more.

nvidia-smi(1), `-r`: "Trigger a reset of one or more GPUs ... There can't be any applications
using these devices"; the reset "can be used to clear GPU HW and SW state in situations that
would otherwise require a machine reboot". Runs after the drain step (file order), so a Slurm
node with a failed GPU is drained first; the next run resumes it once healthy (drain.py).
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health.xid import bus_key, reset_signals
from pytest_gpuhost.modules.process import ProcessTable, driver_daemon
from pytest_gpuhost.modules.service import Service
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError
from pytest_gpuhost.run.remediation import Action, Check

__all__ = ["RESET_TIMEOUT", "GpuReset", "owed_resets", "remediation"]

RESET_TIMEOUT = 60.0  # nvidia-smi -r on one GPU; a reset that hangs is a failure, not a stuck run
STOP_TIMEOUT = 30.0
VERIFY_TIMEOUT = 30.0
PERSISTENCED = "nvidia-persistenced.service"
_SIGNAL_TEXT = {
    "reset_required": "reset_status.reset_required is Yes",
    "nvml_reset_required": "NVML says [GPU requires reset]",
    "remap_pending": "a row remap is pending (applied by a reset)",
    "recovery_action": "the driver's recovery action asks for a reset",
}
_UNIT = re.compile(r"/([^/]+\.service)$")


def _key(bdf: Any) -> str:
    """xid.bus_key, with nvidia-smi's 8-digit domain (00000000:14:00.0) folded to the kernel's 4."""
    domain, _, rest = bus_key(bdf).partition(":")
    return f"{domain[-4:]}:{rest}" if rest else domain


def owed_resets(facts: Mapping[str, Any], thresholds: Any) -> dict[str, list[str]]:
    """Return {bus "dddd:bb:dd": why} for every GPU that owes a GPU reset now."""
    out: dict[str, list[str]] = {}
    for bus, sig in reset_signals(facts).items():
        for name, value in sig.items():
            if value == 1:
                out.setdefault(_key(bus), []).append(_SIGNAL_TEXT.get(name, name))
    v = hm.evaluate("xid", facts, thresholds)
    st = v.state or {}
    for e in st.get("events") or []:
        if e.get("action") == "reset_gpu" and int(e.get("code", -1)) not in set(thresholds["xid_ignore"]):
            out.setdefault(_key(e.get("bdf")), []).append(f"Xid {e.get('code')}: {e.get('msg')}")
    for p in st.get("owed") or []:
        if p.get("action") == "reset_gpu":
            out.setdefault(_key(p.get("bdf")), []).append(f"Xid {p.get('code')} still owes a reset")
    for a in st.get("recovery_actions") or []:
        if a.get("action") == "reset_gpu":
            why = f"recovery action {a.get('value')!r}"
            if why not in out.get(_key(a.get("bdf")), []):
                out.setdefault(_key(a.get("bdf")), []).append(why)
    return {k: list(dict.fromkeys(v)) for k, v in out.items()}


@dataclass
class GpuReset:
    """The plan for one GPU: who holds it, what is stopped, what would run."""

    bus: str
    smi_id: str  # the bus id as nvidia-smi prints it (its -i argument)
    why: list[str]
    minor: int | None = None
    persistence: bool = False
    units: list[str] = field(default_factory=list)  # to stop, then start again
    refused: list[str] = field(default_factory=list)  # holders no unit of ours owns

    def commands(self) -> list[list[str]]:
        out = [["systemctl", "stop", "--", u] for u in self.units]
        if self.persistence:
            out.append(["nvidia-smi", "-i", self.smi_id, "-pm", "0"])
        out.append(["nvidia-smi", "-r", "-i", self.smi_id])
        if self.persistence:
            out.append(["nvidia-smi", "-i", self.smi_id, "-pm", "1"])
        out += [["systemctl", "start", "--", u] for u in reversed(self.units)]
        return out


def _gpus(facts: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    part = facts.get("gpus")
    if not (isinstance(part, Mapping) and part.get("ok")):
        return {}
    return {_key(g.get("bdf")): g for g in part.get("gpus") or [] if isinstance(g, Mapping)}


def _minor(conn: Any, smi_id: str) -> int | None:
    r = conn.run(
        ["nvidia-smi", "-i", smi_id, "--query-gpu=minor_number", "--format=csv,noheader"], timeout=20
    )
    text = (r.stdout or "").strip()
    return int(text) if r.rc == 0 and text.isdigit() else None


def _unit_of(cgroup: str) -> str | None:
    m = _UNIT.search((cgroup or "").rstrip("/"))
    return m.group(1) if m else None


def plan_gpu(conn: Any, bus: str, why: list[str], g: Mapping[str, Any], allowed: list[str]) -> GpuReset:
    """Read who holds the GPU; say what would be stopped, or who stops it from being reset."""
    smi_id = str(g.get("bdf"))
    p = GpuReset(bus, smi_id, why)
    p.persistence = str(g.get("persistence_mode", "")).lower() in ("enabled", "1", "on")
    p.minor = _minor(conn, smi_id)
    if p.minor is None:
        p.refused.append(f"nvidia-smi gave no minor number for {smi_id}: cannot tell who holds it")
        return p
    dev = f"/dev/nvidia{p.minor}"
    table = ProcessTable.read(conn, gpu_holders=True)
    for proc in table.gpu_holders():
        if dev not in proc.gpus:
            continue
        unit = _unit_of(proc.cgroup)
        ok_unit = unit is not None and (unit in allowed or (unit == PERSISTENCED and driver_daemon(proc)))
        if ok_unit and unit not in p.units:
            p.units.append(unit)  # type: ignore[arg-type]
        elif not ok_unit:
            p.refused.append(
                f"PID {proc.pid} ({' '.join(proc.argv)[:120]}) holds {dev}"
                + (f" in {unit}, not an inventory service" if unit else ", outside any systemd service")
            )
    return p


def _units(thresholds: Any) -> list[str]:
    return [u if u.endswith(".service") else f"{u}.service" for u in thresholds.services]


def remediation(hh: Any, on_check: Any = None) -> dict[str, Any]:
    """Return the reset remediation of one host, as `remediate(**...)` takes it."""
    conn = hh.target.conn
    box: dict[str, Any] = {}

    def check() -> Check:
        facts = hh.gather()
        owed = owed_resets(facts, hh.thresholds)
        gpus = _gpus(facts)
        plans = []
        missing = []
        for bus, why in sorted(owed.items()):
            g = gpus.get(bus)
            if g is None:
                missing.append(f"{bus}: owes a reset ({'; '.join(why)}) but nvidia-smi does not list it")
                continue
            plans.append(plan_gpu(conn, bus, why, g, _units(hh.thresholds)))
        box["plans"] = plans
        state = {
            "gpus": [
                {
                    "bus": p.bus,
                    "why": p.why,
                    "holders_units": p.units,
                    "refused": p.refused,
                    "persistence": p.persistence,
                }
                for p in plans
            ],
            "not_listed": missing,
        }
        if not owed:
            first = Check(ok=True, summary="no GPU owes a reset", state=state)
        else:
            parts = [f"{p.smi_id} owes a reset ({'; '.join(p.why)})" for p in plans] + missing
            refused = [r for p in plans for r in p.refused]
            if refused:
                parts.append("not reset: " + "; ".join(refused))
            first = Check(ok=False, summary="; ".join(parts), state=state)
        if on_check is not None:
            on_check(first)
        return first

    def refusals(before: Check) -> list[str]:
        return [r for p in box["plans"] for r in p.refused] + list(before.state.get("not_listed") or [])

    def plan(before: Check) -> list[Action]:
        plans: list[GpuReset] = box["plans"]
        if refusals(before):
            return []  # nothing runs: the check's summary says who holds the GPU
        return [
            Action(
                f"reset GPU {p.smi_id} ({'; '.join(p.why)})", " && ".join(shlex.join(c) for c in p.commands())
            )
            for p in plans
        ]

    def fix(actions: list[Action], before: Check) -> None:
        refused = refusals(before)
        if refused:
            raise ProcedureError(
                "no GPU reset: "
                + "; ".join(refused)
                + " (stop it, or name its unit in the inventory's `service`)"
            )
        for p in box["plans"]:
            reset_one(conn, p)

    def verify() -> Check:
        deadline = time.monotonic() + VERIFY_TIMEOUT
        want = {p.bus for p in box["plans"]}
        while True:
            fresh = hh._facts(parts=["gpus", "remap"])
            left = {bus: why for bus, why in owed_resets_signals(fresh).items() if bus in want}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(1)
        if hh.facts is not None:
            hh.facts.update({k: fresh[k] for k in ("gpus", "remap") if k in fresh})
            hh.verdicts.clear()
        if left:
            return Check(
                ok=False,
                summary="still owed after the reset: "
                + "; ".join(f"{b}: {', '.join(w)}" for b, w in left.items()),
            )
        return Check(ok=True, summary=f"{len(want)} GPU(s) reset; their signals no longer ask for one")

    return {"name": "reset", "check": check, "plan": plan, "fix": fix, "verify": verify}


def owed_resets_signals(facts: Mapping[str, Any]) -> dict[str, list[str]]:
    """The GPUs whose own signals still ask for a reset (the re-check: no kernel log involved)."""
    out: dict[str, list[str]] = {}
    for bus, sig in reset_signals(facts).items():
        for name, value in sig.items():
            if value == 1:
                out.setdefault(_key(bus), []).append(_SIGNAL_TEXT.get(name, name))
    return out


def reset_one(conn: Any, p: GpuReset) -> None:
    """Stop what holds the GPU, reset it, and start again every unit stopped, whatever failed."""
    ev = evidence.current()
    stopped: list[str] = []
    try:
        for u in p.units:
            report = Service(conn, u).stop(STOP_TIMEOUT)
            stopped.append(u)
            ev.note(f"reset {p.smi_id}: stopped {u} ({report.duration:g} s)")
        if p.minor is not None:
            left = [
                f"PID {x.pid}"
                for x in ProcessTable.read(conn, gpu_holders=True).gpu_holders()
                if f"/dev/nvidia{p.minor}" in x.gpus
            ]
            if left:
                raise ProcedureError(f"{p.smi_id} still held after the stop ({', '.join(left)}): not reset")
        if p.persistence:
            _run(conn, ["nvidia-smi", "-i", p.smi_id, "-pm", "0"], 30)
        r = conn.run(["nvidia-smi", "-r", "-i", p.smi_id], timeout=RESET_TIMEOUT)
        if r.timed_out:
            raise ProcedureError(
                f"nvidia-smi -r -i {p.smi_id} did not return in {RESET_TIMEOUT:g} s (driver hung?)"
            )
        ev.note(f"reset {p.smi_id}: nvidia-smi -r exited {r.rc}: {(r.stdout or r.stderr).strip()[-300:]}")
        if r.rc != 0:
            raise ProcedureError(
                f"nvidia-smi -r -i {p.smi_id} exited {r.rc}: {(r.stdout + r.stderr).strip()[-300:]}"
            )
    finally:
        if p.persistence:
            try:
                _run(conn, ["nvidia-smi", "-i", p.smi_id, "-pm", "1"], 30)
            except ProcedureError as exc:
                ev.note(f"reset {p.smi_id}: {exc}")
        for u in reversed(stopped):
            Service(conn, u).start(timeout=STOP_TIMEOUT * 2)
            ev.note(f"reset {p.smi_id}: started {u} again")


def _run(conn: Any, argv: list[str], timeout: float) -> None:
    r = conn.run(argv, timeout=timeout)
    if r.rc != 0 or r.timed_out:
        raise ProcedureError(f"{shlex.join(argv)} failed (rc {r.rc}): {(r.stdout + r.stderr).strip()[-200:]}")

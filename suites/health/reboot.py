"""The reboot of a node under `--fix=reset,reboot`, for one of two reasons.

1. **A reset that did not clear.** A reset that `nvidia-smi -r` reports done can leave the GPU in
   error (its reset-required bit still set, NVML still answering [GPU requires reset]):
   nvidia-smi(1) offers the reset for "situations that would otherwise require a machine
   reboot", and when it does not clear them the reboot is what is left (`reboot_node`, called by
   reset.py after its own re-check with the GPUs still owed). What holds each of those GPUs is
   read again first (holders.plan_gpu).
2. **A debt that only a reboot pays.** An Xid whose resolution in NVIDIA's catalogue is
   RESTART_BM (Xid 79, "GPU has fallen off the bus", among others), or a driver recovery action
   of Node Reboot Required (`owed_reboots`). No GPU reset is tried for these: NVIDIA's catalogue
   says a reset does not recover them. `reboot_owed` reads who holds any GPU of the node
   (holders.plan_node, every `/dev/nvidia*`: the reboot ends them all), stops the inventory's
   units with the bounded ladder, each stop journaled first, and reboots.

Either way:

- before: a holder that no unit of ours owns refuses the reboot (a reboot kills what the run did
  not start); so does anything else than a reset having returned 0 in case 1: a failed or hung
  reset is reported, not rebooted away;
- act: the kernel-log cursor this run committed is waited for (the next run must see the Xids
  recorded under the old boot id), then `systemctl reboot`, bounded; the connection dropping
  under it is the reboot under way, not an error;
- wait: SSH polled until it answers with a new boot id (/proc/sys/kernel/random/boot_id, drawn
  anew at each boot: Linux drivers/char/random.c, proc_do_uuid), within `health_reboot_timeout`
  (600 s by default); the connection logs in again by itself (exec/agent_session.py starts a new
  agent, exec/ssh/openssh.py a new master, on the next request);
- after: the units stopped are enabled, so systemd starts them at boot; each one that is not
  active once the boot is done is started (bounded), and legacy persistence mode, which does not
  survive a reboot, is turned on again where it was on. reset.py then re-reads every fact and
  judges the GPUs again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.journal import Journal
from pytest_gpuhost.modules.service import Service, ServiceError
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError

from . import cutrun
from .holders import GpuReset, gpu_rows, key, plan_gpu, plan_node, units

__all__ = [
    "BOOT_ID",
    "NODE",
    "REBOOT_TIMEOUT",
    "Rebooted",
    "boot_id",
    "owed_reboots",
    "reboot_and_wait",
    "reboot_node",
    "reboot_owed",
    "restart_units",
]

BOOT_ID = "/proc/sys/kernel/random/boot_id"
REBOOT_TIMEOUT = 600.0  # the default of ini health_reboot_timeout (suites/health/options.py)
COMMAND_TIMEOUT = 30.0  # `systemctl reboot` only queues the job; it returns, or the link drops
POLL = 1.0
READ_TIMEOUT = 15.0
BOOT_DONE_TIMEOUT = 120.0  # `systemctl is-system-running --wait`: the boot's jobs, then the units
UNIT_TIMEOUT = 60.0
#: `systemctl reboot` exits 0, or the link drops under it: ssh's 255, the agent's connection lost.
_DROPPED = (0, 255)
NODE = "node"  # the journal's `gpu` for a unit stopped for the whole node's reboot


@dataclass
class Rebooted:
    """What one reboot took: the boot ids and the seconds until SSH answered with the new one."""

    old: str
    new: str
    seconds: float
    units: list[str] = field(default_factory=list)  # stopped for the reboot, active again after it


def boot_id(conn: Any, timeout: float = READ_TIMEOUT) -> str | None:
    """Return the target's boot id, or None when it cannot be read now."""
    r = conn.run(["cat", BOOT_ID], timeout=timeout)
    text = (r.stdout or "").strip()
    return text if r.rc == 0 and not r.timed_out and text else None


def reboot_and_wait(conn: Any, old: str, timeout: float) -> Rebooted:
    """Issue `systemctl reboot` and wait, within `timeout` s, for SSH to answer with a new boot id."""
    ev = evidence.current()
    t0 = time.monotonic()
    try:
        r = conn.run(["systemctl", "reboot"], timeout=COMMAND_TIMEOUT)
    except GpuhostError as exc:  # the connection went with the host: the reboot is under way
        ev.note(f"reboot: the connection dropped under systemctl reboot ({type(exc).__name__})")
    else:
        if not r.timed_out and r.rc not in _DROPPED:
            raise ProcedureError(
                f"systemctl reboot exited {r.rc}: {(r.stderr or r.stdout).strip()[-300:]}; the node did not reboot"
            )
        ev.note(f"reboot: systemctl reboot {'timed out' if r.timed_out else f'exited {r.rc}'}")
    deadline = t0 + timeout
    last = "the old boot id still answered"
    while True:
        try:
            now = boot_id(conn, timeout=max(1.0, min(READ_TIMEOUT, deadline - time.monotonic())))
        except GpuhostError as exc:  # down, or booting: sshd does not answer yet
            now, last = None, f"{type(exc).__name__}: {exc}"
        if now is not None and now != old:
            took = time.monotonic() - t0
            ev.note(f"reboot: SSH answered with boot id {now} after {took:.1f} s (was {old})")
            return Rebooted(old, now, took)
        if time.monotonic() + POLL > deadline:
            raise ProcedureError(
                f"the node did not answer SSH with a new boot id within {timeout:g} s "
                f"(health_reboot_timeout); last: {last}"
            )
        time.sleep(POLL)


def restart_units(conn: Any, units: Sequence[str]) -> list[str]:
    """Wait for the boot to finish, start each of `units` that is not active; return what was started.

    `systemctl is-system-running --wait` returns once the boot's jobs are done (running, or
    degraded when a unit failed); each unit is then read, and started if it is not active.
    """
    ev = evidence.current()
    r = conn.run(["systemctl", "is-system-running", "--wait"], timeout=BOOT_DONE_TIMEOUT)
    ev.note(f"reboot: systemctl is-system-running: {(r.stdout or '').strip() or r.rc}")
    started = []
    for u in units:
        svc = Service(conn, u)
        before = svc.state()
        if before.active_state == "active":
            ev.note(f"reboot: {before.summary()} (started at boot)")
            continue
        after = svc.start(timeout=UNIT_TIMEOUT)
        if not after.running:
            raise ServiceError(f"{u} is {after.active_state} after the reboot and a start")
        ev.note(f"reboot: {u} was {before.active_state} after the boot; started it")
        started.append(u)
    return started


def owed_reboots(facts: Mapping[str, Any], thresholds: Any) -> dict[str, list[str]]:
    """Return {bus "dddd:bb:dd": why} for every GPU whose debt only a reboot pays, now.

    From the xid verdict (modules/health/xid.py): this run's Xids and the ones still owed from
    earlier runs whose action is `reboot` (RESTART_BM in NVIDIA's catalogue), and a driver
    recovery action of Node Reboot Required. An Xid in `xid_ignore` owes nothing.
    """
    out: dict[str, list[str]] = {}
    st = hm.evaluate("xid", facts, thresholds).state or {}
    ignore = {int(c) for c in thresholds["xid_ignore"]}
    for e in st.get("events") or []:
        if e.get("action") == "reboot" and int(e.get("code", -1)) not in ignore:
            out.setdefault(key(e.get("bdf")), []).append(f"Xid {e.get('code')}: {e.get('msg')}")
    for o in st.get("owed") or []:
        if o.get("action") == "reboot":
            out.setdefault(key(o.get("bdf")), []).append(f"Xid {o.get('code')} still owes a reboot")
    for a in st.get("recovery_actions") or []:
        if a.get("action") == "reboot":
            out.setdefault(key(a.get("bdf")), []).append(f"recovery action {a.get('value')!r}")
    return {k: list(dict.fromkeys(v)) for k, v in out.items()}


def reboot_owed(
    hh: Any,
    owed: Mapping[str, list[str]],
    timeout: float,
    journal: Journal | None = None,
    kept: Sequence[str] = (),
    kept_persistence: Sequence[str] = (),
) -> Rebooted:
    """Reboot the node for GPUs that owe a reboot, its inventory units stopped first.

    Raise ProcedureError, nothing stopped and nothing rebooted, when a process no inventory unit
    owns holds any GPU of the node, or the boot id is unreadable. Each unit's stop is journaled
    (gpu `node`) before it is taken, so a run cut anywhere here is completed by the next
    (reset.py): it takes the reboot the cut run did not, with what that run stopped (`kept`: its
    units; `kept_persistence`: the GPUs it turned persistence off on) journaled again first and
    kept stopped through it, then started, and persistence turned on, after the boot.
    """
    conn = hh.target.conn
    ev = evidence.current()
    node = plan_node(conn, units(hh.thresholds))
    old = _may_reboot(hh, node.refused)
    persistent = list(dict.fromkeys([*_persistent(hh.facts or {}), *kept_persistence]))
    if journal is not None:  # the cut run's leftovers, in this run's journal before anything else
        for u in kept:
            journal.step("stop", unit=u, gpu=NODE)
        for gpu in kept_persistence:
            journal.step("persistence_off", gpu=gpu)
    if kept or kept_persistence:
        ev.note(
            f"reboot: the cut run left {', '.join(kept) or 'no unit'} stopped"
            + (f" and persistence off on {', '.join(kept_persistence)}" if kept_persistence else "")
            + ": kept so through the reboot, put back after it"
        )
    ev.note(
        "reboot: "
        + "; ".join(f"{b} owes a reboot ({', '.join(w)})" for b, w in owed.items())
        + f"; stopping {', '.join(node.units) or 'no unit'}, then rebooting (boot id {old})"
    )
    for u in node.units:
        if journal is not None:
            journal.step("stop", unit=u, gpu=NODE)
        report = Service(conn, u).stop(cutrun.STOP_TIMEOUT)
        ev.note(f"reboot: stopped {u} ({report.duration:g} s)")
    stopped = list(dict.fromkeys([*kept, *node.units]))
    return _reboot(hh, old, stopped, persistent, timeout, journal, [NODE, *kept_persistence])


def reboot_node(
    hh: Any,
    plans: list[GpuReset],
    rows: Mapping[str, Mapping[str, Any]],
    left: Mapping[str, list[str]],
    timeout: float,
    journal: Journal | None = None,
) -> Rebooted:
    """Reboot the node a reset did not repair, once nothing but our units holds its GPUs.

    Called only after every reset returned 0 and the GPUs' signals, read again, still ask for
    one (`left`). Raise ProcedureError, nothing rebooted, when a holder outside the inventory's
    services (or the persistence daemon) appeared since the reset, or the boot id is unreadable.
    """
    conn = hh.target.conn
    ev = evidence.current()
    allowed = units(hh.thresholds)
    foreign = []
    for m in (m for p in plans for m in p.members):
        g = rows.get(m.bus)
        if g is not None:
            foreign += plan_gpu(conn, m.bus, m.why, g, allowed).refused
    old = _may_reboot(hh, foreign)
    shown = {m.bus: m.smi_id for p in plans for m in p.members}
    ev.note(
        "reboot: "
        + "; ".join(
            f"{shown.get(b, b)} still owes a reset after its reset ({', '.join(w)})" for b, w in left.items()
        )
        + f"; rebooting (boot id {old})"
    )
    stopped = list(dict.fromkeys(u for p in plans for u in p.units))
    if journal is not None:  # after a cut here, the next run starts what systemd did not
        for p in plans:
            for u in p.units:
                journal.step("stop", unit=u, gpu=p.smi_id)
            for m in p.members:
                if m.persistence:
                    journal.step("persistence_off", gpu=m.smi_id)
    persistent = [m.smi_id for p in plans for m in p.members if m.persistence]
    return _reboot(hh, old, stopped, persistent, timeout, journal, [i for p in plans for i in p.ids])


def _may_reboot(hh: Any, refused: Sequence[str]) -> str:
    """Refuse the reboot for a holder we may not end, or an unreadable boot id; return the boot id.

    Then wait for this run's kernel-log cursor: the Xids owed under the old boot id must be on
    disk before the boot that settles them.
    """
    if refused:
        raise ProcedureError("no reboot: " + "; ".join(refused) + " (the reboot would kill it)")
    old = boot_id(hh.target.conn)
    if old is None:
        raise ProcedureError(f"no reboot: {BOOT_ID} is unreadable, so its return could not be told")
    line = hh.wait_commit()
    if line:
        evidence.current().note(line)
    return old


def _persistent(facts: Mapping[str, Any]) -> list[str]:
    """The GPUs (as nvidia-smi names them) whose persistence mode is on, from this run's facts."""
    return [
        str(g.get("bdf"))
        for g in gpu_rows(facts).values()
        if str(g.get("persistence_mode", "")).lower() in ("enabled", "1", "on")
    ]


def _reboot(
    hh: Any,
    old: str,
    stopped: Sequence[str],
    persistent: Sequence[str],
    timeout: float,
    journal: Journal | None,
    restored: Sequence[str],
) -> Rebooted:
    """Reboot, wait for the new boot id, start what systemd did not, persistence on again."""
    conn = hh.target.conn
    ev = evidence.current()
    if journal is not None:
        journal.step("reboot", boot_id=old)
    done = reboot_and_wait(conn, old, timeout)
    done.units = list(stopped)
    restart_units(conn, stopped)
    for gpu in persistent:  # legacy persistence mode does not survive a reboot
        try:
            cutrun.run_checked(conn, ["nvidia-smi", "-i", gpu, "-pm", "1"], 30)
        except ProcedureError as exc:
            ev.note(f"reboot: {exc}")
    if journal is not None:
        for gpu in restored:
            journal.step("restored", gpu=gpu)
    hh.facts = None  # every fact of the new boot, read by the re-check
    hh.verdicts.clear()
    hh.samples.clear()
    return done

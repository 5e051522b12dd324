"""`--fix=reset,reboot`: reboot the node when a GPU reset returned but the GPU still owes one.

A reset that `nvidia-smi -r` reports done can leave the GPU in error (its reset-required bit still
set, NVML still answering [GPU requires reset]): nvidia-smi(1) offers the reset for "situations
that would otherwise require a machine reboot", and when it does not clear them the reboot is
what is left. This module is that step, and only that step: reset.py calls it after its own
re-check, with the GPUs still owed, when `reboot` stands beside `reset` in --fix.

- before: what holds each GPU is read again (holders.plan_gpu); a holder that no unit of ours owns
  stops it (a reboot kills what the run did not start), and so does anything else than the reset
  having returned 0: a failed or hung reset is reported, not rebooted away;
- act: the kernel-log cursor this run committed is waited for (the next run must see the Xids
  recorded under the old boot id), then `systemctl reboot`, bounded; the connection dropping
  under it is the reboot under way, not an error;
- wait: SSH polled until it answers with a new boot id (/proc/sys/kernel/random/boot_id, drawn
  anew at each boot: Linux drivers/char/random.c, proc_do_uuid), within `health_reboot_timeout`
  (600 s by default); the connection logs in again by itself (exec/agent_session.py starts a new
  agent, exec/ssh/openssh.py a new master, on the next request);
- after: the units the reset stopped are enabled, so systemd starts them at boot; each one that is
  not active once the boot is done is started (bounded). reset.py then re-reads every fact and
  judges the GPUs again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules.service import Service, ServiceError
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError

__all__ = ["BOOT_ID", "REBOOT_TIMEOUT", "Rebooted", "boot_id", "reboot_and_wait", "restart_units"]

BOOT_ID = "/proc/sys/kernel/random/boot_id"
REBOOT_TIMEOUT = 600.0  # the default of ini health_reboot_timeout (suites/health/options.py)
COMMAND_TIMEOUT = 30.0  # `systemctl reboot` only queues the job; it returns, or the link drops
POLL = 1.0
READ_TIMEOUT = 15.0
BOOT_DONE_TIMEOUT = 120.0  # `systemctl is-system-running --wait`: the boot's jobs, then the units
UNIT_TIMEOUT = 60.0
#: `systemctl reboot` exits 0, or the link drops under it: ssh's 255, the agent's connection lost.
_DROPPED = (0, 255)


@dataclass
class Rebooted:
    """What one reboot took: the boot ids and the seconds until SSH answered with the new one."""

    old: str
    new: str
    seconds: float


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

"""A systemd service on a target (host or container connection): state, bounded stop, start, health.

`systemctl stop` waits TimeoutStopSec (90 s by default) and longer when ExecStop hangs, which is
what a stuck inference server does. `Service.stop` never waits on systemd: it queues the stop
with `--no-block`, polls `systemctl show` up to the caller's bound, then signals the unit's whole
cgroup with `systemctl kill` (SIGTERM, then SIGKILL), verifying after each step. Processes are
selected by the unit's cgroup only, never by a pattern on command lines.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_gpuhost.errors import GpuhostError

__all__ = ["Service", "ServiceError", "ServiceState", "StopReport", "check_health"]

_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.@\\-]+$")
_SHOW = (
    "LoadState",
    "ActiveState",
    "SubState",
    "MainPID",
    "ControlGroup",
    "UnitFileState",
    "ActiveEnterTimestampMonotonic",
)


class _Conn(Protocol):
    name: str

    def run(self, command: Any, *, timeout: float | None = None, **kw: Any) -> Any: ...


class ServiceError(GpuhostError, RuntimeError):
    """A service could not be stopped or started within its bound; the message says which step."""


@dataclass
class ServiceState:
    """What `systemctl show` says about a unit."""

    unit: str
    load_state: str = ""
    active_state: str = ""
    sub_state: str = ""
    main_pid: int = 0
    control_group: str = ""
    unit_file_state: str = ""

    @property
    def exists(self) -> bool:
        """True when systemd knows the unit (LoadState=loaded)."""
        return self.load_state == "loaded"

    @property
    def stopped(self) -> bool:
        """True when nothing of the unit runs: inactive or failed, no main PID."""
        return self.active_state in ("inactive", "failed") and self.main_pid == 0

    @property
    def running(self) -> bool:
        """True when the unit is active (or on its way up)."""
        return self.active_state in ("active", "activating", "reloading")

    def summary(self) -> str:
        """Return "sglang-qwen.service active/running pid 1234"."""
        pid = f" pid {self.main_pid}" if self.main_pid else ""
        return f"{self.unit} {self.active_state}/{self.sub_state}{pid}"


@dataclass
class StopReport:
    """How a stop went: the steps taken with their times, and the final state."""

    unit: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    duration: float = 0.0
    final: ServiceState | None = None
    was_running: bool = False


def _unit(name: str) -> str:
    unit = name if "." in name else f"{name}.service"
    # A leading '-' would read as an option of systemctl (`-Hhost` is --host=host); the commands
    # also pass `--` before the unit.
    if not _UNIT_RE.match(unit) or unit.startswith("-"):
        raise ValueError(f"not a systemd unit name: {name!r}")
    return unit


class Service:
    """One systemd unit reached through `conn` (the host, or the container's connection)."""

    def __init__(self, conn: _Conn, name: str, *, where: str = "") -> None:
        self.conn = conn
        self.unit = _unit(name)
        self.where = where or getattr(conn, "name", "")
        self.poll_interval = 0.25

    def __repr__(self) -> str:
        return f"<Service {self.unit} on {self.where}>"

    # ---------------------------------------------------------------- facts

    def state(self) -> ServiceState:
        """Read the unit's state with `systemctl show` (one command)."""
        r = self.conn.run(["systemctl", "show", "-p", ",".join(_SHOW), "--", self.unit], timeout=8)
        if r.rc != 0:
            raise ServiceError(
                f"{self.where}: systemctl show {self.unit} failed (rc {r.rc}): {(r.stderr or r.stdout).strip()[:200]}"
            )
        values = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        try:
            pid = int(values.get("MainPID", "0") or 0)
        except ValueError:
            pid = 0
        return ServiceState(
            self.unit,
            values.get("LoadState", ""),
            values.get("ActiveState", ""),
            values.get("SubState", ""),
            pid,
            values.get("ControlGroup", ""),
            values.get("UnitFileState", ""),
        )

    def commands(self, stop_timeout: float) -> list[str]:
        """Return the commands `stop` may run, in order, as an operator would type them."""
        return [
            f"systemctl stop --no-block {self.unit}   # then poll `systemctl show` up to {stop_timeout:g} s",
            f"systemctl kill -s SIGTERM --kill-whom=all {self.unit}   # if still running",
            f"systemctl kill -s SIGKILL --kill-whom=all {self.unit}   # if SIGTERM is ignored",
        ]

    # ---------------------------------------------------------------- actions

    def _wait(self, until: float, report: StopReport, step: str) -> ServiceState:
        state = self.state()
        while not state.stopped and time.monotonic() < until:
            time.sleep(self.poll_interval)
            state = self.state()
        report.steps.append(
            {
                "step": step,
                "t": round(time.monotonic() - self._t0, 2),
                "state": state.summary(),
                "stopped": state.stopped,
            }
        )
        return state

    def _kill(self, signal: str) -> None:
        r = self.conn.run(["systemctl", "kill", "-s", signal, "--kill-whom=all", "--", self.unit], timeout=15)
        if r.rc != 0 and "kill-whom" in (r.stderr or ""):
            # systemd before 252 spells it --kill-who
            r = self.conn.run(
                ["systemctl", "kill", "-s", signal, "--kill-who=all", "--", self.unit], timeout=15
            )
        if r.rc != 0:
            raise ServiceError(
                f"{self.where}: systemctl kill -s {signal} {self.unit} failed (rc {r.rc}): {r.stderr.strip()[:200]}"
            )

    def stop(self, stop_timeout: float, *, term_grace: float = 1.5, kill_wait: float = 3.0) -> StopReport:
        """Stop the unit within stop_timeout + term_grace + kill_wait seconds, or raise ServiceError.

        Graceful first (`systemctl stop --no-block`, up to stop_timeout), then SIGTERM to every
        process of the unit, then SIGKILL; each step is verified with `systemctl show`.
        """
        self._t0 = time.monotonic()
        report = StopReport(self.unit)
        state = self.state()
        report.was_running = not state.stopped
        if state.stopped:
            report.final = state
            report.steps.append(
                {"step": "already stopped", "t": 0.0, "state": state.summary(), "stopped": True}
            )
            return report
        r = self.conn.run(["systemctl", "stop", "--no-block", "--", self.unit], timeout=15)
        if r.rc != 0:
            raise ServiceError(
                f"{self.where}: systemctl stop --no-block {self.unit} failed (rc {r.rc}): {r.stderr.strip()[:200]}"
            )
        state = self._wait(self._t0 + stop_timeout, report, "stop --no-block")
        if not state.stopped:
            self._kill("SIGTERM")
            state = self._wait(time.monotonic() + term_grace, report, "kill SIGTERM")
        if not state.stopped:
            self._kill("SIGKILL")
            state = self._wait(time.monotonic() + kill_wait, report, "kill SIGKILL")
        report.duration = round(time.monotonic() - self._t0, 2)
        report.final = state
        if not state.stopped:
            raise ServiceError(
                f"{self.where}: {self.unit} still {state.active_state}/{state.sub_state} (pid {state.main_pid}) "
                f"{report.duration:g} s after stop, SIGTERM and SIGKILL"
            )
        return report

    def start(self, *, timeout: float = 60.0) -> ServiceState:
        """Start the unit (`systemctl start`, bounded) and return its state."""
        r = self.conn.run(["systemctl", "start", "--", self.unit], timeout=timeout)
        if r.timed_out:
            raise ServiceError(f"{self.where}: systemctl start {self.unit} did not return in {timeout:g} s")
        if r.rc != 0:
            raise ServiceError(
                f"{self.where}: systemctl start {self.unit} failed (rc {r.rc}): {r.stderr.strip()[:300]}"
            )
        return self.state()


_HEALTH = (
    "import sys,urllib.request\n"
    "try:\n"
    " r=urllib.request.urlopen(sys.argv[1],timeout=float(sys.argv[2]))\n"
    " print(r.status)\n"
    "except Exception as e:\n"
    " print('ERR',getattr(e,'code','') or e)\n"
)


def check_health(conn: _Conn, url: str, *, bound: float, interval: float = 1.0) -> tuple[bool, str, float]:
    """Poll `url` from the target itself until it answers 200 or `bound` seconds pass.

    Returns (healthy, last answer, seconds waited). Runs on the target so that a service that
    listens on the container's loopback is reachable, under the interpreter the target's agent
    runs on (`Connection.python`: the node's `python3` may be missing or too old); where there is
    none (the fallback), or it cannot run the probe, `curl` prints the status code instead.
    """
    t0 = time.monotonic()
    curl = ["curl", "-s", "-o", "/dev/null", "-m", "3", "-w", "%{http_code}\n", url]
    python = str(getattr(conn, "python", "") or "")
    probe = [python, "-B", "-c", _HEALTH, url, "3"] if python else curl  # -B: no .pyc written there
    while True:
        r = conn.run(probe, timeout=10)
        if probe is not curl and r.rc != 0 and not r.stdout.strip():
            probe = curl  # the program always prints; nothing means the interpreter could not run it
            continue
        lines = (r.stdout or r.stderr).strip().splitlines()
        answer = lines[-1] if lines else f"rc {r.rc}"
        if answer == "200":
            return True, answer, round(time.monotonic() - t0, 2)
        if time.monotonic() - t0 + interval > bound:
            return False, answer, round(time.monotonic() - t0, 2)
        time.sleep(interval)

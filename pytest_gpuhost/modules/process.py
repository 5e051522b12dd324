"""Select processes on a target and stop them: exactly those selected, never the run's own.

Selection is by systemd unit (the unit's cgroup), by matchers on the executable and arguments
(regex on the basename of argv[0] or exe, the module after `-m`, exact argv elements; never a
substring of the whole command line, so `vim sglang_notes.md` is not an SGLang server), or by
"everything holding a GPU" (`/dev/nvidia*` open), and then by TREE: every descendant of a
selected process is selected with it.  Serving programs rename their workers (SGLang's children
call `setproctitle("sglang::scheduler_TP0")`, so their command line no longer names the module),
and with data parallelism those workers keep the GPUs when only the parent is stopped
(sgl-project/sglang#23627: `sglang::scheduler_DP0_TP0_EP0` reparented to PID 1, 100 GB each).
The tree comes from one process-table read: children by ppid, accepted only when the child
started no earlier than its parent, so a PID reused between two reads of /proc never adopts a
stranger.  The agent's own PID, its ancestors and its session are excluded on the node itself.
Stopping records the selection (PIDs, start times, command lines) before any signal, then
SIGTERM, a bounded wait, SIGKILL, and a verifying wait; every signal goes to an exact PID whose
start time is re-checked on the node (pidfd when the node's Python has it), so a PID reused by
another process is never hit.
"""

from __future__ import annotations

import re
import shlex
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Protocol

__all__ = [
    "DRIVER_DAEMONS",
    "Matcher",
    "Proc",
    "ProcessTable",
    "Selection",
    "StopResult",
    "driver_daemon",
    "parse_selection",
    "stop_processes",
]


class _Conn(Protocol):
    def call(self, op: str, **params: Any) -> Any: ...


@dataclass(frozen=True)
class Matcher:
    """Match a process on its executable and arguments; every given field must hold."""

    argv0: str | None = None  # regex, full match on basename(argv[0]) or basename(exe)
    module: str | None = None  # exact: the argument after "-m"
    args: tuple[str, ...] = ()  # exact elements that appear consecutively in argv
    name: str = ""

    def matches(self, proc: Proc) -> bool:
        if not proc.argv:
            return False  # kernel threads and zombies have no argv
        if self.argv0 is not None:
            rx = re.compile(self.argv0)
            names = {proc.argv[0].rsplit("/", 1)[-1]}
            if proc.exe:
                names.add(proc.exe.rsplit("/", 1)[-1])
            if not any(rx.fullmatch(n) for n in names):
                return False
        if self.module is not None:
            argv = proc.argv
            if not any(argv[i] == "-m" and argv[i + 1] == self.module for i in range(1, len(argv) - 1)):
                return False
        if self.args:
            n = len(self.args)
            if not any(tuple(proc.argv[i : i + n]) == self.args for i in range(len(proc.argv) - n + 1)):
                return False
        return True

    def describe(self) -> str:
        parts = []
        if self.argv0 is not None:
            parts.append(f"argv0~/{self.argv0}/")
        if self.module is not None:
            parts.append(f"-m {self.module}")
        if self.args:
            parts.append("args " + shlex.join(self.args))
        return self.name or " ".join(parts)


@dataclass(frozen=True)
class Selection:
    """Which processes a procedure stops."""

    units: tuple[str, ...] = ()  # glob on unit names, e.g. "sglang-*.service"
    matchers: tuple[Matcher, ...] = ()
    gpu_holders: bool = False
    term_timeout: float = 30.0
    kill_timeout: float = 10.0

    @property
    def empty(self) -> bool:
        return not (self.units or self.matchers or self.gpu_holders)


def _texts(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of strings, not {value!r}")
    return tuple(value)


def _seconds(key: str, value: Any) -> float:
    # bool is an int: `term_timeout: yes` is a mistake, not one second
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
        raise ValueError(f"{key} must be a number of seconds in (0, 3600], not {value!r}")
    return float(value)


def parse_selection(doc: dict[str, Any]) -> Selection:
    """Build a Selection from a manifest's `stop:` mapping; raise ValueError naming the bad key.

    Types are checked, not coerced: `gpu_holders: "false"` or `args: "--port"` is an error.
    """
    unknown = set(doc) - {"units", "match", "gpu_holders", "term_timeout", "kill_timeout"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown, key=str)}")
    matchers = []
    match = doc.get("match") or []
    if not isinstance(match, list):
        raise ValueError(f"match must be a list of matchers, not {match!r}")
    for i, m in enumerate(match):
        if (
            not isinstance(m, dict)
            or not set(m) <= {"argv0", "module", "args", "name"}
            or not ({"argv0", "module", "args"} & set(m))
        ):
            raise ValueError(f"match[{i}] needs argv0 (regex), module and/or args (list)")
        for k in ("argv0", "module", "name"):
            if m.get(k) is not None and not isinstance(m[k], str):
                raise ValueError(f"match[{i}].{k} must be a string, not {m[k]!r}")
        if m.get("argv0") is not None:
            try:
                re.compile(m["argv0"])
            except re.error as exc:
                raise ValueError(f"match[{i}].argv0 {m['argv0']!r}: {exc}") from exc
        matchers.append(
            Matcher(
                argv0=m.get("argv0"),
                module=m.get("module"),
                args=_texts(f"match[{i}].args", m["args"]) if m.get("args") is not None else (),
                name=str(m.get("name") or ""),
            )
        )
    units = doc.get("units") or []
    units = _texts("units", [units] if isinstance(units, str) else units)
    gpu_holders = doc.get("gpu_holders", False)
    if not isinstance(gpu_holders, bool):
        raise ValueError(f"gpu_holders must be true or false, not {gpu_holders!r}")
    return Selection(
        units=units,
        matchers=tuple(matchers),
        gpu_holders=gpu_holders,
        term_timeout=_seconds("term_timeout", doc.get("term_timeout", 30.0)),
        kill_timeout=_seconds("kill_timeout", doc.get("kill_timeout", 10.0)),
    )


@dataclass(frozen=True)
class Proc:
    """One process as the node's /proc shows it."""

    pid: int
    ppid: int
    sid: int
    starttime: int
    state: str
    argv: tuple[str, ...]
    exe: str | None
    cgroup: str
    comm: str
    gpus: tuple[str, ...] = ()

    @property
    def unit(self) -> str | None:
        """The systemd unit whose cgroup holds this process (innermost .service/.scope)."""
        for part in reversed(self.cgroup.split("/")):
            if part.endswith((".service", ".scope")):
                return part
        return None

    @property
    def cmdline(self) -> str:
        return shlex.join(self.argv) if self.argv else f"[{self.comm}]"

    def record(self) -> dict[str, Any]:
        """Return what the evidence keeps of this process (enough to find it again, or not)."""
        return {
            "pid": self.pid,
            "ppid": self.ppid,
            "starttime": self.starttime,
            "unit": self.unit,
            "cmdline": self.cmdline,
            "comm": self.comm,
            "exe": self.exe,
            "gpus": list(self.gpus),
        }


# The driver's own daemons keep every GPU open without a compute context (nvidia-smi lists no
# process for them); "every process holding a GPU" means the workloads, so these are left out
# unless a unit or a matcher names them.
DRIVER_DAEMONS = ("nvidia-persistenced", "nv-fabricmanager", "nv-hostengine", "nvidia-fabricmanager")


def driver_daemon(p: Proc) -> bool:
    """Say whether `p` is one of the driver's daemons (by argv[0], exe or its 15-byte comm)."""
    names = {p.comm, (p.exe or "").rsplit("/", 1)[-1], *(a.rsplit("/", 1)[-1] for a in p.argv[:2])}
    return any(n == d or (len(n) == 15 and d.startswith(n)) for n in names if n for d in DRIVER_DAEMONS)


def _argv(raw: Sequence[str]) -> tuple[str, ...]:
    """Return argv without the empty tail a renamed process leaves in /proc/PID/cmdline.

    setproctitle writes the title over the old argv area and pads it with NULs, so the kernel
    hands back "sglang::detokenizer" followed by dozens of empty arguments; ps shows the title.
    """
    argv = list(raw)
    while len(argv) > 1 and argv[-1] == "":
        argv.pop()
    return tuple(argv)


@dataclass
class ProcessTable:
    """The node's processes and the agent's own tree (never to be selected)."""

    procs: list[Proc]
    own_pid: int
    own_ancestors: tuple[int, ...]
    own_sid: int

    @classmethod
    def read(cls, conn: _Conn, *, gpu_holders: bool = True) -> ProcessTable:
        res = conn.call("proc_list", gpu_holders=gpu_holders)
        return cls.from_result(res)

    @classmethod
    def from_result(cls, res: dict[str, Any]) -> ProcessTable:
        procs = [
            Proc(
                pid=p["pid"],
                ppid=p["ppid"],
                sid=p["sid"],
                starttime=p["starttime"],
                state=p["state"],
                argv=_argv(p["argv"]),
                exe=p.get("exe"),
                cgroup=p.get("cgroup", ""),
                comm=p.get("comm", ""),
                gpus=tuple(p.get("gpus", ())),
            )
            for p in res["processes"]
        ]
        own = res["self"]
        return cls(procs, own["pid"], tuple(own["ancestors"]), own["sid"])

    def is_own(self, p: Proc) -> bool:
        return p.pid == self.own_pid or p.pid in self.own_ancestors or p.sid == self.own_sid

    def selectable(self, p: Proc) -> bool:
        # PID 1, kthreadd and kernel threads (children of PID 2) are never ours to stop
        return not (self.is_own(p) or p.state in ("Z", "X") or p.pid in (1, 2) or p.ppid == 2)

    def children(self) -> dict[int, list[Proc]]:
        """Map PID -> its children in this read; a child older than its "parent" is not one."""
        by_pid = {p.pid: p for p in self.procs}
        out: dict[int, list[Proc]] = {}
        for p in self.procs:
            parent = by_pid.get(p.ppid)
            if parent is not None and p.pid != p.ppid and p.starttime >= parent.starttime:
                out.setdefault(parent.pid, []).append(p)
        return out

    def descendants(self, roots: Sequence[Proc]) -> list[tuple[Proc, Proc]]:
        """Return (descendant, the root it descends from) for every process below `roots`."""
        kids = self.children()
        seen = {r.pid for r in roots}
        out: list[tuple[Proc, Proc]] = []
        stack = [(r, r) for r in roots]
        while stack:
            node, root = stack.pop()
            for child in kids.get(node.pid, ()):
                if child.pid not in seen:
                    seen.add(child.pid)
                    out.append((child, root))
                    stack.append((child, root))
        return out

    def _why(self, p: Proc, sel: Selection) -> str | None:
        unit = p.unit
        if unit and any(fnmatchcase(unit, u) for u in sel.units):
            return f"unit {unit}"
        for m in sel.matchers:
            if m.matches(p):
                return f"matcher {m.describe()}"
        if sel.gpu_holders and p.gpus and not driver_daemon(p):
            return "holds " + ",".join(p.gpus)
        return None

    def select(self, sel: Selection) -> list[tuple[Proc, str]]:
        """Return (process, why selected), in PID order: the matches and all their descendants.

        Never the run's own tree, PID 1 or kernel threads, even as a descendant.
        """
        direct: dict[int, tuple[Proc, str]] = {}
        for p in self.procs:
            if self.selectable(p):
                why = self._why(p, sel)
                if why is not None:
                    direct[p.pid] = (p, why)
        chosen = dict(direct)
        for child, root in self.descendants([p for p, _ in direct.values()]):
            if child.pid not in chosen and self.selectable(child):
                chosen[child.pid] = (child, f"descendant of PID {root.pid} ({direct[root.pid][1]})")
        return [chosen[pid] for pid in sorted(chosen)]

    def gpu_holders(self) -> list[Proc]:
        return [p for p in self.procs if p.gpus and p.state not in ("Z", "X")]


@dataclass
class StopResult:
    """What stop_processes did, step by step."""

    selected: list[dict[str, Any]]
    termed: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)  # reused / refused / gone
    units_stopped: list[str] = field(default_factory=list)
    timeline: list[tuple[str, float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.survivors


def _late_children(conn: _Conn, chosen: Sequence[Proc]) -> list[Proc]:
    """Return the descendants of `chosen` in a fresh read that `chosen` does not hold yet."""
    fresh = ProcessTable.read(conn, gpu_holders=False)
    now = {p.pid: p for p in fresh.procs}
    roots = [now[p.pid] for p in chosen if p.pid in now and now[p.pid].starttime == p.starttime]
    have = {p.pid for p in chosen}
    return [c for c, _ in fresh.descendants(roots) if c.pid not in have and fresh.selectable(c)]


def stop_processes(
    conn: _Conn,
    chosen: Sequence[Proc],
    *,
    term_timeout: float = 30.0,
    kill_timeout: float = 10.0,
    record: Callable[[str, Any], None] | None = None,
    run: Callable[[list[str]], Any] | None = None,
    units: Sequence[str] = (),
    tree: bool = True,
) -> StopResult:
    """Stop exactly these processes and their children: record, SIGTERM, wait, SIGKILL, verify.

    With `tree`, the process table is read once more just before the first signal and every
    descendant of a chosen process (same PID and start time) that appeared since the selection
    is added: a worker forked while the operator read the plan is stopped with its parent.
    Once more before SIGKILL, for the children the survivors of SIGTERM forked meanwhile.
    `record(label, value)` is called with the selection before any signal is sent (the evidence).
    `run(argv)` runs a command on the node; when units are given, `systemctl stop --no-block`
    goes first so that systemd does not restart what we kill.
    """
    import time

    chosen = list(chosen)
    if tree and chosen:
        chosen += _late_children(conn, chosen)
    result = StopResult(selected=[p.record() for p in chosen])
    if record is not None:
        record("selected for stop", result.selected)
    targets = [{"pid": p.pid, "starttime": p.starttime} for p in chosen]
    if units and run is not None:
        run(["systemctl", "stop", "--no-block", "--", *units])
        result.units_stopped = list(units)
    if not targets:
        return result
    result.timeline.append(("SIGTERM", time.time()))
    for r in conn.call("proc_signal", targets=targets, signal=int(signal.SIGTERM)):
        if r["status"] == "sent":
            result.termed.append(r["pid"])
        else:
            result.skipped.append(r)
    live = [t for t in targets if t["pid"] in result.termed]
    alive = conn.call("proc_wait", targets=live, timeout=term_timeout)["alive"] if live else []
    if alive:
        left = [t for t in live if t["pid"] in alive]
        if tree:
            # a survivor may have forked while it ignored SIGTERM: its new children go with it,
            # or they outlive it as orphans
            extra = _late_children(conn, [p for p in chosen if p.pid in alive])
            extra = [p for p in extra if p.pid not in {t["pid"] for t in targets}]
            if extra:
                result.selected += [p.record() for p in extra]
                if record is not None:
                    record("added before SIGKILL", [p.record() for p in extra])
                left += [{"pid": p.pid, "starttime": p.starttime} for p in extra]
        result.timeline.append(("SIGKILL", time.time()))
        for r in conn.call("proc_signal", targets=left, signal=int(signal.SIGKILL)):
            if r["status"] == "sent":
                result.killed.append(r["pid"])
        alive = conn.call("proc_wait", targets=left, timeout=kill_timeout)["alive"]
    result.survivors = list(alive)
    result.timeline.append(("verified" if not alive else "survivors", time.time()))
    if record is not None:
        record(
            "stop result",
            {
                "termed": result.termed,
                "killed": result.killed,
                "survivors": result.survivors,
                "skipped": result.skipped,
            },
        )
    return result

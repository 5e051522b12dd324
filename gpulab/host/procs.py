"""Processes and mounts of the lab, seen from this machine: run, wait, stop, find a namespace's PID 1.

Every PID here is one the lab recorded or found below its own launcher; nothing else is signalled.
``NSpid`` in /proc/PID/status gives a process's PID in each PID namespace (proc(5)).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpulab.errors import LabError

__all__ = [
    "alive",
    "children",
    "find_init",
    "mounts_under",
    "nspid",
    "nspid_all",
    "run",
    "stop_pid",
    "umount_under",
    "wait_gone",
]


def run(
    argv: Sequence[str], timeout: float = 30, check: bool = True, **kw: Any
) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and p.returncode != 0:
        raise LabError(
            f"{shlex.join(argv)}: {(p.stderr or p.stdout).strip().splitlines()[-1:] or p.returncode}"
        )
    return p


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not alive(pid):
            return True
        time.sleep(0.02)
    return not alive(pid)


def stop_pid(pid: int | None, timeout: float = 5) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not wait_gone(pid, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_gone(pid, 2)


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


def nspid(pid: int, level: int) -> int:
    """Return ``pid`` as seen at PID-namespace depth ``level`` (0 is the root namespace)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                ids = [int(x) for x in line.split()[1:]]
                return ids[level] if level < len(ids) else ids[-1]
    raise LabError(f"no NSpid for {pid}")


def find_init(launcher: int, timeout: float) -> int | None:
    """Find the PID 1 the launcher (nsenter/unshare) forked: the process whose NSpid ends in 1."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        todo = [launcher]
        seen = set()
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            with contextlib.suppress(OSError, LabError):
                ids = nspid_all(p)
                if len(ids) >= 2 and ids[-1] == 1 and p != launcher:
                    return p
            todo += children(p)
        if not alive(launcher):
            return None
        time.sleep(0.01)
    return None


def nspid_all(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return []


def mounts_under(prefix: Path) -> list[str]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            mp = line.split()[1].encode().decode("unicode_escape")
            if mp == str(prefix) or mp.startswith(str(prefix) + "/"):
                out.append(mp)
    return out


def umount_under(prefix: Path) -> None:
    """Unmount everything at or below ``prefix``, deepest first (lazily: a hung FUSE must not block)."""
    for _ in range(4):
        mps = sorted(set(mounts_under(prefix)), key=lambda m: (-m.count("/"), m))
        if not mps:
            return
        for mp in mps:
            run(["umount", "-l", mp], timeout=10, check=False)

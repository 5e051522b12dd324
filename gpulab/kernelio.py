"""What sysfs writes raise and who holds a file open: shared by the host model and its mixins."""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["SysfsError", "find_holders"]


class SysfsError(OSError):
    """A sysfs write failed with the errno the kernel would return."""

    def __init__(self, err: int, why: str = "") -> None:
        super().__init__(err, os.strerror(err) + (f" ({why})" if why else ""))


def find_holders(paths: Iterable[str | os.PathLike[str]], proc: str = "/proc") -> dict[str, list[int]]:
    """Return path -> PIDs holding that file open, found through ``/proc/*/fd`` by st_dev/st_ino.

    Paths that do not exist are left out. Processes that vanish mid-scan are skipped.
    """
    keys: dict[tuple[int, int], str] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        keys[(st.st_dev, st.st_ino)] = str(p)
    out: dict[str, list[int]] = {v: [] for v in keys.values()}
    if not keys:
        return out
    me = os.getpid()
    try:
        pids = [int(d) for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        if pid == me:
            continue
        fd_dir = f"{proc}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"{fd_dir}/{fd}")
            except OSError:
                continue
            hit = keys.get((st.st_dev, st.st_ino))
            if hit is not None and pid not in out[hit]:
                out[hit].append(pid)
    return out

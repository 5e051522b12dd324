"""What sysfs writes raise and who holds a file open: shared by the host model and its mixins."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

__all__ = ["SysfsError", "find_holders", "open_file_counts"]


class SysfsError(OSError):
    """A sysfs write failed with the errno the kernel would return."""

    def __init__(self, err: int, why: str = "") -> None:
        super().__init__(err, os.strerror(err) + (f" ({why})" if why else ""))


def _descriptors(
    paths: Iterable[str | os.PathLike[str]], proc: str
) -> tuple[list[str], Iterator[tuple[str, int, int]]]:
    """Return (the paths that exist, an iterator of (path, pid, fd) for each descriptor naming one).

    Files are matched by st_dev/st_ino through ``/proc/*/fd``; this process and processes that
    vanish mid-scan are skipped.
    """
    keys: dict[tuple[int, int], str] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        keys[(st.st_dev, st.st_ino)] = str(p)

    def scan() -> Iterator[tuple[str, int, int]]:
        if not keys:
            return
        me = os.getpid()
        try:
            pids = [int(d) for d in os.listdir(proc) if d.isdigit()]
        except OSError:
            return
        for pid in pids:
            if pid == me:
                continue
            fd_dir = f"{proc}/{pid}/fd"
            try:
                names = os.listdir(fd_dir)
            except OSError:
                continue
            for fd in names:
                try:
                    st = os.stat(f"{fd_dir}/{fd}")
                except OSError:
                    continue
                hit = keys.get((st.st_dev, st.st_ino))
                if hit is not None and fd.isdigit():
                    yield hit, pid, int(fd)

    return list(keys.values()), scan()


def find_holders(paths: Iterable[str | os.PathLike[str]], proc: str = "/proc") -> dict[str, list[int]]:
    """Return path -> PIDs holding that file open, found through ``/proc/*/fd`` by st_dev/st_ino.

    Paths that do not exist are left out. Processes that vanish mid-scan are skipped.
    """
    found, descriptors = _descriptors(paths, proc)
    out: dict[str, list[int]] = {path: [] for path in found}
    for path, pid, _fd in descriptors:
        if pid not in out[path]:
            out[path].append(pid)
    return out


_KCMP_FILE = 0
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}


def _same_file(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two (pid, fd) name one open file (kcmp(2) KCMP_FILE; a fork or dup shares it)."""
    import ctypes
    import platform

    nr = _SYS_KCMP.get(platform.machine())
    if nr is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(nr, a[0], b[0], _KCMP_FILE, a[1], b[1]) == 0


def open_file_counts(paths: Iterable[str | os.PathLike[str]], proc: str = "/proc") -> dict[str, int]:
    """Return path -> how many open files (struct file) name it, as the kernel counts module references.

    chrdev_open() (fs/char_dev.c) takes two module references per open file; descriptors that
    share one open file (dup(2), or inherited through fork(2)) add none, so they are counted once
    (told apart with kcmp(2)).
    """
    found, descriptors = _descriptors(paths, proc)
    fds: dict[str, list[tuple[int, int]]] = {path: [] for path in found}
    for path, pid, fd in descriptors:
        fds[path].append((pid, fd))
    out = {}
    for path, entries in fds.items():
        kept: list[tuple[int, int]] = []
        for e in entries:
            if not any(_same_file(e, k) for k in kept):
                kept.append(e)
        out[path] = len(kept)
    return out

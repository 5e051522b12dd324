"""FUSE daemon that serves a directory at a bounded write rate: a slow data volume for a lab host.

Run: ``python -m gpulab.kernel.slowfs --backing DIR --mount DIR --write-bps N`` (foreground).
Every file operation passes through to ``DIR``; each write is held until the volume's rate
allows it (one token bucket for the whole volume, what a throttled or failing device gives),
so a writer measures ``N`` bytes/s whatever the page cache would have given: mounted with
``direct_io``, "the page cache is completely bypassed for reads and writes" (the kernel's
Documentation/filesystems/fuse-io.rst), each write(2) waits for the daemon. Used by tests/accept/test_accept_lab.py
("a really slow data volume"), mounted under a lab host's root so the host sees it (docs/accept.md).
"""

from __future__ import annotations

import argparse
import errno
import os
import threading
import time
from typing import Any

try:
    import mfusepy
except OSError as exc:  # as gpulab/kernel/sysfs.py: tests skip on ImportError where libfuse is missing
    raise ImportError(f"mfusepy cannot load libfuse ({exc}): apt-get install fuse3") from exc

__all__ = ["SlowOps", "main"]


class SlowOps(mfusepy.Operations):  # type: ignore[misc]
    """Pass-through operations on `backing`, writes paced at `write_bps` bytes/s."""

    def __init__(self, backing: str, write_bps: float) -> None:
        self.backing = os.path.realpath(backing)
        self.write_bps = float(write_bps)
        self._next = time.monotonic()  # when the volume can take its next byte
        self._lock = threading.Lock()

    def _p(self, path: str) -> str:
        full = os.path.realpath(os.path.join(self.backing, path.lstrip("/")))
        if full != self.backing and not full.startswith(self.backing + os.sep):
            raise mfusepy.FuseOSError(errno.EACCES)
        return full

    def __call__(self, op: str, *args: Any) -> Any:
        try:
            return super().__call__(op, *args)
        except OSError as e:
            if isinstance(e, mfusepy.FuseOSError):
                raise
            raise mfusepy.FuseOSError(e.errno or errno.EIO) from None

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        st = os.lstat(self._p(path))
        keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime", "st_mtime", "st_ctime")
        return {k: getattr(st, k) for k in keys}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *os.listdir(self._p(path))]

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._p(path))
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_namemax")
        return {k: getattr(st, k) for k in keys}

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

    def open(self, path: str, flags: int) -> int:
        return os.open(self._p(path), flags & ~os.O_CREAT)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        with self._lock:  # the volume takes one write at a time, at its rate
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + len(data) / self.write_bps
            wait = self._next - now
        time.sleep(wait)
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: Any = None) -> int:
        os.truncate(self._p(path), length)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        os.fsync(fh)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._p(path))
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._p(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._p(path))
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._p(path), mode)
        return 0

    def utimens(self, path: str, times: Any = None) -> int:
        os.utime(self._p(path), times)
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpulab.kernel.slowfs")
    ap.add_argument("--backing", required=True)
    ap.add_argument("--mount", required=True)
    ap.add_argument("--write-bps", type=float, required=True)
    args = ap.parse_args(argv)
    mfusepy.FUSE(
        SlowOps(args.backing, args.write_bps), args.mount, foreground=True, allow_other=True, direct_io=True
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

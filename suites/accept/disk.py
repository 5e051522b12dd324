"""The data volume, measured on the node: free space, and a bounded write and read of one scratch file.

`PROGRAM` runs on the node with the node's python3 (as the agent does), in one command:
statvfs of the volume, then (unless asked to write nothing) a scratch file of incompressible
bytes made with O_EXCL|O_NOFOLLOW under a random name, written in 4 MiB blocks, fsync'd (the
write time includes the fsync: what reached the device, not the page cache), its pages dropped
from the cache (posix_fadvise DONTNEED), read back, and removed in a `finally`. The write stops
at the size or at half the bound, whichever comes first, so a slow volume is measured, not
waited for; the command is bounded again on the controller's side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["PROGRAM", "VolumeReading", "read_volume"]

PROGRAM = r"""
import json, os, sys, time
path, mib, write, bound = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", float(sys.argv[4])
out = {}
if not os.path.isdir(path) or os.path.islink(path):
    print(json.dumps({"error": "not a directory"}))
    sys.exit(0)
st = os.statvfs(path)
out["free"], out["total"] = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
if write:
    name = os.path.join(path, ".gpuhost-accept-%d-%s" % (os.getpid(), os.urandom(6).hex()))
    block = os.urandom(4 << 20)
    want = max(len(block), mib << 20)
    out["scratch"] = name
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        t0, done = time.monotonic(), 0
        while done < want and time.monotonic() - t0 < bound / 2:
            done += os.write(fd, block[: min(len(block), want - done)])
        os.fsync(fd)
        out["written"], out["write_s"] = done, time.monotonic() - t0
        os.close(fd)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0, got = time.monotonic(), 0
        while True:
            chunk = os.read(fd, 4 << 20)
            if not chunk:
                break
            got += len(chunk)
        out["read"], out["read_s"] = got, time.monotonic() - t0
    except OSError as exc:
        out["error"] = "%s: %s" % (type(exc).__name__, exc.strerror)
    finally:
        os.close(fd)
        os.unlink(name)
        out["removed"] = not os.path.lexists(name)
print(json.dumps(out))
"""


@dataclass(frozen=True)
class VolumeReading:
    """What the program reported (None where it did not measure)."""

    free: int | None = None
    total: int | None = None
    write_mb_s: float | None = None
    read_mb_s: float | None = None
    written: int = 0
    removed: bool | None = None
    error: str | None = None


def _rate(n: Any, s: Any) -> float | None:
    if not isinstance(n, int) or not isinstance(s, int | float) or n <= 0:
        return None
    return n / 1e6 / max(float(s), 1e-6)


def read_volume(conn: Any, path: str, *, mib: int, write: bool, bound: float) -> VolumeReading:
    """Run PROGRAM on the node; one reading, or one with `error` saying why there is none."""
    argv = ["python3", "-c", PROGRAM, path, str(mib), "1" if write else "0", f"{bound:g}"]
    r = conn.run(argv, timeout=bound + 30)
    lines = (r.stdout or "").strip().splitlines()
    try:
        out = json.loads(lines[-1]) if r.rc == 0 and lines else None
    except ValueError:
        out = None
    if not isinstance(out, dict):
        why = ((r.stderr or r.stdout or "").strip().splitlines() or [f"rc {r.rc}"])[-1]
        return VolumeReading(error=f"the volume program failed: {why[:200]}")
    return VolumeReading(
        free=out.get("free") if isinstance(out.get("free"), int) else None,
        total=out.get("total") if isinstance(out.get("total"), int) else None,
        write_mb_s=_rate(out.get("written"), out.get("write_s")),
        read_mb_s=_rate(out.get("read"), out.get("read_s")),
        written=int(out.get("written") or 0) if isinstance(out.get("written"), int) else 0,
        removed=out.get("removed") if isinstance(out.get("removed"), bool) else None,
        error=str(out["error"])[:200] if out.get("error") else None,
    )

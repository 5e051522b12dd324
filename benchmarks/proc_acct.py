"""CPU seconds of every process that exits during a benchmark run, by who started it and by name.

Linux BSD process accounting (acct(2), `CONFIG_BSD_PROCESS_ACCT_V3`; man 5 acct) appends one
64-byte `struct acct_v3` per exiting process to a file, from every PID namespace below the one
that switched it on (kernel/acct.c: `acct_process` walks the namespace's parents), with the
process's user and system time, its PID and parent PID and its command name. Lab hosts run in
PID namespaces of their own, so one file sees the controller, the xdist workers, the ssh clients,
and on the lab hosts sshd, the agent and each emulated nvidia-smi or dmesg.

Times are in ticks of 1/100 s (AHZ), truncated per process: a tool that runs for 8 ms of CPU
reads 0, so short processes are undercounted and a name's total is a lower bound; the counts of
exits are exact. For the CPU of one tool, time many runs of it instead.

Processes that live through the whole window (a lab host's systemd, a FUSE daemon) are not in it;
`health_cpu` counts those. Root only. Used by `bench_health.py --acct`, or alone:

    sudo python benchmarks/proc_acct.py -- pytest suites/health ...
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Accounting", "Exited", "summary"]

RECORD = struct.Struct("<cBHIIIIIIf8H16s")  # struct acct_v3 (include/uapi/linux/acct.h), 64 bytes
AHZ = 100  # comp_t times are in units of 1/AHZ s (include/uapi/linux/acct.h: AHZ 100)


def _comp(v: int) -> int:
    """Decode a comp_t: 13-bit mantissa, 3-bit base-8 exponent (kernel/acct.c: encode_comp_t)."""
    return (v & 0x1FFF) << (3 * (v >> 13))


@dataclass
class Exited:
    """One process that exited during the window."""

    pid: int
    ppid: int
    comm: str
    cpu: float  # user + system seconds


class Accounting:
    """Switch process accounting on for a `with` block; `records` holds what exited in it."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd, name = tempfile.mkstemp(prefix="acct-", suffix=".bin")
        os.close(fd)
        self.path = Path(name)
        self.records: list[Exited] = []

    def __enter__(self) -> Accounting:
        if self._libc.acct(str(self.path).encode()) != 0:
            err = ctypes.get_errno()
            self.path.unlink(missing_ok=True)
            raise OSError(err, f"acct({self.path}): {os.strerror(err)}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._libc.acct(None)
        data = self.path.read_bytes()
        self.path.unlink(missing_ok=True)
        for off in range(0, len(data) - RECORD.size + 1, RECORD.size):
            f = RECORD.unpack_from(data, off)
            utime, stime = _comp(f[10]), _comp(f[11])
            comm = f[18].split(b"\0", 1)[0].decode("ascii", "replace")
            self.records.append(Exited(f[6], f[7], comm, (utime + stime) / AHZ))


def _descendants(records: list[Exited], roots: set[int]) -> set[int]:
    """PIDs of the records whose parent chain (through other records) reaches one of `roots`."""
    parent = {r.pid: r.ppid for r in records}
    out: set[int] = set()
    for pid in parent:
        seen: list[int] = []
        p = pid
        while p in parent and p not in roots and p not in out and len(seen) < 64:
            seen.append(p)
            p = parent[p]
        if p in roots or p in out:
            out.update(seen)
    return out


def cgroup_pids(cgroup_dirs: Iterable[Path]) -> set[int]:
    """The PIDs (root namespace) in these cgroups and every cgroup below them, now."""
    pids: set[int] = set()
    for d in cgroup_dirs:
        for procs in d.rglob("cgroup.procs"):
            try:
                pids.update(int(x) for x in procs.read_text().split())
            except (OSError, ValueError):
                continue
    return pids


def summary(records: list[Exited], groups: dict[str, set[int]], top: int = 6) -> list[str]:
    """Lines: per group (records descending from its root PIDs) the CPU total and the top names."""
    lines = []
    claimed: set[int] = set()
    for name, roots in groups.items():
        mine = _descendants(records, roots) - claimed
        claimed |= mine
        lines.append(_group_line(name, [r for r in records if r.pid in mine], top))
    lines.append(_group_line("other", [r for r in records if r.pid not in claimed], top))
    return lines


def _group_line(name: str, recs: list[Exited], top: int) -> str:
    by: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        by[r.comm].append(r.cpu)
    parts = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
    detail = ", ".join(f"{c} {sum(v):.2f}/{len(v)}" for c, v in parts)
    return f"{name}: {sum(r.cpu for r in recs):.2f} CPU-s in {len(recs)} exits ({detail})"


def main(argv: list[str]) -> int:
    """Run a command under accounting, print the summary (name CPU-s/count)."""
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    if not argv:
        print("usage: proc_acct.py -- COMMAND...", file=sys.stderr)
        return 2
    with Accounting() as acc:
        rc = subprocess.call(argv)
    for line in summary(acc.records, {"command": {os.getpid()}}):
        print(line)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

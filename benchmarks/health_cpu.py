"""CPU seconds one benchmark run cost, by who spent them: pytest, the lab hosts, sysfs, the bench.

The lab machine has few cores, so a large run is CPU-bound and its CPU account explains its wall
time. Lab hosts are read from their cgroup's `cpu.stat` (cgroup v2, hybrid or pure), their FUSE
sysfs daemons from /proc; the pytest processes are this process's waited-for children.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpulab.host.lab import LabHost

__all__ = ["CpuAccount", "cpu_now", "cpu_since"]

CGROUP_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))  # cgroup v1+v2 hybrid, pure v2


def _cgroup_cpu(host: LabHost) -> float | None:
    """Return the CPU seconds a lab host's cgroup used so far (cgroup v2 `cpu.stat`), None if unknown."""
    for root in CGROUP_ROOTS:
        try:
            text = (root / host.cgroup / "cpu.stat").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    return None


def _daemon_cpu(host: LabHost) -> float | None:
    """Return the CPU seconds of the host's FUSE sysfs daemon so far, None if unknown."""
    try:
        pid = int((host.dir / "pids" / "sysfs").read_text())
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuAccount:
    """CPU seconds one run cost, by who spent them."""

    pytest: float  # the suite's pytest processes (controller and xdist workers)
    lab: float | None  # the lab hosts' cgroups (sshd, agent or commands, emulated tools, systemd)
    sysfs: float | None  # the lab's FUSE sysfs daemons
    bench: float  # this script (the delay proxy's thread, when used)

    def line(self) -> str:
        def f(v: float | None) -> str:
            return "?" if v is None else f"{v:.2f}"

        return f"pytest {f(self.pytest)} + lab {f(self.lab)} + sysfs {f(self.sysfs)} + proxy {f(self.bench)}"


def _sum(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def cpu_now(hosts: list[LabHost]) -> tuple[float, float | None, float | None, float]:
    """Return the CPU seconds so far of: this process's children, the hosts, their daemons, this process."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return (
        kids.ru_utime + kids.ru_stime,
        _sum([_cgroup_cpu(h) for h in hosts]),
        _sum([_daemon_cpu(h) for h in hosts]),
        me.ru_utime + me.ru_stime,
    )


def cpu_since(before: tuple[float, float | None, float | None, float], hosts: list[LabHost]) -> CpuAccount:
    """Return the CPU account from a `cpu_now` reading to now."""
    after = cpu_now(hosts)

    def d(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    return CpuAccount(
        after[0] - before[0], d(before[1], after[1]), d(before[2], after[2]), after[3] - before[3]
    )

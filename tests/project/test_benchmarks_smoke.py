"""CI runs each benchmark at smoke size: they must still run and print their figures.

The full runs (and the figures quoted in the README and the issue notes) are made by hand:
`python benchmarks/bench_X.py` without `--smoke`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB = os.geteuid() == 0 and os.path.exists("/dev/fuse")


@pytest.mark.parametrize(
    ("script", "needs_lab", "expect"),
    [
        ("bench_exec.py", True, "less time per command than testinfra"),
        ("bench_lab_boot.py", True, "s"),
        ("bench_backup.py", True, "rsync"),
        ("bench_health.py", True, "hosts"),
        ("bench_merge.py", False, "nodes merged in under 5 s"),
        ("bench_inplace.py", False, "bytes sent while verifying: 0 in"),
        ("bench_slurm.py", True, "nodes=2: srun -N 2 health"),
        ("bench_nodecheck.py", True, "within budget: yes"),
        ("bench_decommission_credentials.py", True, "credentials step measured"),
        ("bench_p2p_diagnosis.py", True, "within 1 s: yes"),
        ("bench_accept.py", True, "accept measured"),
    ],
)
def test_benchmark_smoke(script: str, needs_lab: bool, expect: str) -> None:
    if needs_lab and not LAB:
        pytest.skip("needs root and /dev/fuse (sshd and lab hosts)")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert expect in out, out[-3000:]


def test_bench_reset_smoke() -> None:
    """bench_reset.py at smoke size: the reset path once, then one in-host reboot (about 7 s)."""
    test_benchmark_smoke("bench_reset.py", True, "in-host reboot alone")


def test_bench_nccl_smoke() -> None:
    """bench_nccl.py at smoke size: one repair run of the seed's Proxmox host with the collective."""
    test_benchmark_smoke("bench_nccl.py", True, "collective step measured")


def test_bench_backup_files_smoke() -> None:
    """bench_backup.py --files at smoke size: 2,000 small files, ours and rsync, peak RSS printed."""
    if not LAB:
        pytest.skip("needs root and /dev/fuse (sshd and lab hosts)")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_backup.py"), "--files", "2000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "peak RSS under 1 GiB: yes" in out, out[-3000:]

"""`suites/health --health-nccl` on a health-ok lab host over real SSH: the opt-in collective.

The lab's all_reduce_perf (gpulab/tools/gpulab_tools/all_reduce_perf.py) runs both arms on the
host's four GPUs; the check passes with correct data, fails naming the GPUs when the P2P arm
hangs (fault `nccl_hang`, ended by `timeout` on the host) or returns wrong data (`nccl_wrong`),
and is not collected at all without --health-nccl.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.health.test_health_lab_gpus import inject, run_suite


def _cell(h: Any, tmp: Path, name: str, *extra: str) -> dict[str, Any]:
    summary = run_suite(h, tmp, *extra, name=name)
    return dict(summary["hosts"][h.name]["checks"])


def test_the_collective_runs_only_when_asked_and_fails_a_hang_in_its_bound(lab: Any, tmp_path: Path) -> None:
    h = lab.host("health-ok", name=f"nc{os.getpid() % 100000}")
    try:
        cells = _cell(h, tmp_path, "off")
        assert "nccl_collective" not in cells, sorted(cells)  # opt-in
        cells = _cell(h, tmp_path, "on", "--health-nccl")
        c = cells["nccl_collective"]
        assert c["outcome"] == "passed", c
        assert "correct data" in c["summary"] or "P2P" in c["summary"], c
        inject(h, {"nccl_wrong": 7})
        c = _cell(h, tmp_path, "wrong", "--health-nccl")["nccl_collective"]
        assert c["outcome"] == "failed" and "wrong" in c["summary"], c
        inject(h, {"nccl_hang": True})
        c = _cell(h, tmp_path, "hang", "--health-nccl", "-o", "health_nccl_timeout=5")["nccl_collective"]
        assert c["outcome"] == "failed" and "hung after 5 s" in c["summary"], c
        assert h.ssh(["pgrep", "-x", "all_reduce_perf"]).returncode != 0  # nothing left behind
    finally:
        inject(h, {})

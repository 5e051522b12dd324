"""NVLink error counters since the last run on lab hosts, over real SSH.

The B200 host's nvidia-smi prints `nvlink -e` with NVLink 5's counters (0 unless the fault
`nvlink_errors` says more); two runs of suites/health: the first is the baseline, then counters
that grew fail the nvlink check naming GPU, link and counter. A host without NVLink never starts
`nvidia-smi nvlink -e`: the lab's nvidia-smi appends each `nvlink -e` run to the host's record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.test_health_lab_gpus import boot, inject, run_health

STATE = "/var/lib/gpuhost/health-state.json"


def _nvlink_e_runs(h: Any) -> int:
    return sum(1 for r in h.record() if r.get("op") == "nvidia-smi" and r.get("argv") == ["nvlink", "-e"])


def test_b200_nvlink_counters_grown_since_the_last_run_fail_naming_gpu_link_and_counter(
    lab: Any, tmp_path: Path
) -> None:
    h = boot(lab, "b200-nvl8")
    assert h.ssh(["rm", "-f", STATE]).returncode == 0  # no earlier run: this one is the baseline
    # lifetime counts from before the first run: recorded, not judged
    inject(h, {"gpus": {"0000:43:00.0": {"nvlink_errors": {"7": {"Link recovery successful events": 500}}}}})
    try:
        before = _nvlink_e_runs(h)
        c = run_health(h, tmp_path, name="n1")["nvlink"]
        assert c["outcome"] == "passed", c
        assert "1728 NVLink error counters on 8 GPUs recorded as the baseline (first run)" in c["summary"], c
        assert _nvlink_e_runs(h) == before + 1  # one nvlink -e per run, in the facts request
        inject(
            h,
            {
                "gpus": {
                    "0000:43:00.0": {"nvlink_errors": {"7": {"Link recovery successful events": 503}}},
                    "0000:9d:00.0": {"nvlink_errors": {"12": {"Symbol Errors": 2, "Rx Errors": 1}}},
                }
            },
        )
        c = run_health(h, tmp_path, name="n2")["nvlink"]
        assert c["outcome"] == "failed", c
        assert c["reasons"] == [
            "GPU 1 (0000:43:00.0) link 7: Link recovery successful events +3 since the last run "
            "(now 503; limit 0, recovery)",
            "GPU 4 (0000:9d:00.0) link 12: Rx Errors +1 since the last run (now 1; limit 0, link_errors)",
            "GPU 4 (0000:9d:00.0) link 12: Symbol Errors +2 since the last run (now 2; limit 0, link_errors)",
        ], c
        c = run_health(h, tmp_path, name="n3")["nvlink"]  # no growth since: passes
        assert c["outcome"] == "passed", c
    finally:
        inject(h, {})


def test_a_host_without_nvlink_never_starts_nvlink_e(lab: Any, tmp_path: Path) -> None:
    h = boot(lab, "health-ok")
    inject(h, {})
    before = _nvlink_e_runs(h)
    c = run_health(h, tmp_path, name="p1")["nvlink"]
    assert c["outcome"] == "skipped", c
    assert _nvlink_e_runs(h) == before
    # the record is written where the test reads it: the same host answers `nvlink -e` when asked
    r = h.ssh(["nvidia-smi", "nvlink", "-e"])
    assert r.returncode == 0 and _nvlink_e_runs(h) == before + 1, r

"""NVLink error counters since the last run on lab hosts, over real SSH.

The B200 host's nvidia-smi prints `nvlink -e` with NVLink 5's counters (0 unless the fault
`nvlink_errors` says more); two runs of suites/health: the first is the baseline, then counters
that grew fail the nvlink check naming GPU, link and counter. A host without NVLink never starts
`nvidia-smi nvlink -e`: the lab's nvidia-smi appends each `nvlink -e` run to the host's record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.modules.health import controller_state
from pytest_gpuhost.modules.health.facts import SOURCE_ENV
from tests.health.test_health_lab_gpus import boot, inject, run_health

STATE = "/var/lib/gpuhost/health-state.json"


def _nvlink_e_runs(h: Any) -> int:
    return sum(1 for r in h.record() if r.get("op") == "nvidia-smi" and r.get("argv") == ["nvlink", "-e"])


@pytest.mark.parametrize(("source", "nvlink_e_runs"), [("nvidia-smi", 1), ("auto", 0)])
def test_b200_nvlink_counters_grown_since_the_last_run_fail_naming_gpu_link_and_counter(
    lab: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, nvlink_e_runs: int
) -> None:
    """The same verdicts from `nvidia-smi nvlink -e` and from NVML (auto: the lab's libnvidia-ml),
    and each path is the one taken: NVML starts no `nvidia-smi nvlink -e`."""
    monkeypatch.setenv(SOURCE_ENV, source)
    h = boot(lab, "b200-nvl8")
    # no earlier run: this one is the baseline (what a fixing run left on the node, and what a
    # --check-only run kept on the controller: modules/health/controller_state.py)
    assert h.ssh(["rm", "-f", STATE]).returncode == 0
    controller_state.path_for(h.name).unlink(missing_ok=True)
    # lifetime counts from before the first run: recorded, not judged
    inject(h, {"gpus": {"0000:43:00.0": {"nvlink_errors": {"7": {"Link recovery successful events": 500}}}}})
    try:
        before = _nvlink_e_runs(h)
        c = run_health(h, tmp_path, name="n1")["nvlink"]
        assert c["outcome"] == "passed", c
        assert "1728 NVLink error counters on 8 GPUs recorded as the baseline (first run)" in c["summary"], c
        assert _nvlink_e_runs(h) == before + nvlink_e_runs  # nvidia-smi: one nvlink -e per run
        assert c["state"]["source"] == ("nvml" if source == "auto" else "nvidia-smi"), c["state"]
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


def test_b200_links_down_fabric_and_memory_limit_give_the_same_verdicts_through_nvml(
    lab: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two links down on GPU 1, GPU 2's fabric still training, GPU 4's own HBM limit lowered:
    nvidia-smi (`nvlink -s`, `-q`) and NVML (link state and speed, fabric info, the MEM_MAX
    threshold) give the same nvlink, fabric and memory_temperature verdicts."""
    h = boot(lab, "b200-nvl8")
    faults = {
        "gpus": {
            "0000:43:00.0": {"nvlinks_down": [3, 11]},
            "0000:52:00.0": {"fabric_state": "In Progress", "fabric_status": "N/A"},
            "0000:9d:00.0": {"memory_temp_max": 30},
        }
    }
    inject(h, faults)
    try:
        got = {}
        for source in ("nvidia-smi", "auto"):
            monkeypatch.setenv(SOURCE_ENV, source)
            checks = run_health(h, tmp_path, name=f"same-{source}")
            got[source] = {k: {f: checks[k].get(f) for f in ("outcome", "summary", "reasons")} for k in PICK}
            want = "nvml" if source == "auto" else "nvidia-smi"
            assert {checks[k]["state"].get("source") for k in ("nvlink", "fabric")} == {want}, checks
    finally:
        inject(h, {})
    assert got["auto"] == got["nvidia-smi"]
    smi = got["nvidia-smi"]
    assert smi["nvlink"]["outcome"] == "failed" and smi["nvlink"]["reasons"][:1] == [
        "GPU 1 (0000:43:00.0): 16 of 18 NVLinks active (18 link lines)"
    ], smi["nvlink"]
    assert "GPU 2 (0000:52:00.0): fabric state In Progress" in smi["fabric"]["reasons"][0], smi["fabric"]
    mem = smi["memory_temperature"]
    assert mem["outcome"] == "failed" and any("0000:9d:00.0" in r for r in mem["reasons"]), mem


PICK = ("nvlink", "fabric", "memory_temperature")

"""`Memory Max Operating T.Limit Temp` in nvidia-smi -q: a margin's reference, never a limit in C."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_health, probe_health_smi
from pytest_gpuhost.modules.health import checks as hm

OUTPUTS = Path(__file__).resolve().parents[2] / "fixtures" / "outputs"


def fabric_part(monkeypatch: pytest.MonkeyPatch, q: str) -> dict[str, Any]:
    def run(argv: list[str], timeout: float, record: list[Any]) -> dict[str, Any]:
        out = q if argv[:2] == ["nvidia-smi", "-q"] else "LoadState=loaded\nActiveState=active\n"
        return {"rc": 0, "stdout": out, "stderr": "", "timed_out": False}

    for module in (probe_health, probe_health_smi):  # the readers, and the fabric part's systemctl
        monkeypatch.setattr(module, "run_recorded", run)
    return probe_health.part_fabric({}, [])


def test_the_tlimit_reference_of_an_h200_is_not_read_as_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    part = fabric_part(monkeypatch, (OUTPUTS / "nvidia-smi-q-550.90.12-h200-tlimit.txt").read_text())
    assert part["memory_temp_max"] == {}  # no limit in C on this driver
    assert part["memory_temp_max_tlimit"] == {"0000:03:00.0": 0.0}
    assert part["gpus"]["0000:03:00.0"] == {"state": "Completed", "status": "Success"}
    g = {"bdf": "0000:03:00.0", "index": 0, "name": "NVIDIA H200", "temperature.memory": 25}
    facts = {"gpus": {"ok": True, "gpus": [g]}, "fabric": part}
    v = hm.evaluate("memory_temperature", facts, hm.Thresholds.from_vars({}))
    assert v.ok, v  # 25 C, judged by the model's limit, not by 0 C
    (lim,) = v.state["limits"].values()
    assert lim["limit"] == 95.0
    assert "T.Limit reference, Memory Max Operating T.Limit Temp 0 C" in lim["from"]


def test_an_absolute_memory_limit_is_still_the_gpus_own(monkeypatch: pytest.MonkeyPatch) -> None:
    q = (
        "GPU 00000000:03:00.0\n    Temperature\n        Memory Current Temp               : 90 C\n"
        "        Memory Max Operating Temp         : 85 C\n"
    )
    part = fabric_part(monkeypatch, q)
    assert part["memory_temp_max"] == {"0000:03:00.0": 85.0} and part["memory_temp_max_tlimit"] == {}
    g = {"bdf": "0000:03:00.0", "index": 0, "name": "NVIDIA H200", "temperature.memory": 90}
    v = hm.evaluate(
        "memory_temperature", {"gpus": {"ok": True, "gpus": [g]}, "fabric": part}, hm.Thresholds.from_vars({})
    )
    assert not v.ok and "85 C (the GPU's Memory Max Operating Temp)" in v.reasons[0]

"""What reaches the report when nvidia-smi fails: the line that says the error, on real output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_health, probe_health_smi
from pytest_gpuhost.modules.health import checks as hm

OUTPUTS = Path(__file__).resolve().parents[2] / "fixtures" / "outputs"


def failing_smi(monkeypatch: pytest.MonkeyPatch, stdout: str, rc: int) -> None:
    def run(argv: list[str], timeout: float, record: list[Any]) -> dict[str, Any]:
        return {"rc": rc, "stdout": stdout, "stderr": "", "timed_out": False}

    for module in (probe_health, probe_health_smi):  # the readers, and the fabric part's systemctl
        monkeypatch.setattr(module, "run_recorded", run)


def test_an_nvml_mismatch_keeps_the_line_that_says_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # nvidia-smi prints both lines on stdout and exits 18 (github.com/mozilla/translations/issues/1167)
    failing_smi(monkeypatch, (OUTPUTS / "nvidia-smi-nvml-mismatch-580.txt").read_text(), 18)
    want = (
        "exited 18: Failed to initialize NVML: Driver/library version mismatch; NVML library version: 580.178"
    )
    gpus = probe_health.part_gpus({}, [])
    assert not gpus["ok"] and gpus["error"] == "nvidia-smi --query-gpu " + want
    assert probe_health_smi.part_smi({"no_cache": True}, [])["error"] == "nvidia-smi " + want
    v = hm.evaluate("gpu_count", {"gpus": gpus}, hm.Thresholds.from_vars({}))
    assert not v.ok and "Driver/library version mismatch" in v.summary


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("No devices were found\n", "No devices were found"),
        (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
            "the latest NVIDIA driver is installed and running.\n\n",
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
            "the latest NVIDIA driver is installed and running.",
        ),
        ("something\nthe last word\n", "the last word"),
        ("", ""),
    ],
)
def test_error_line_of_other_failures(text: str, line: str) -> None:
    assert probe_health_smi.error_line(text) == line

"""The mig_mode check, from the cells nvidia-smi prints, through the probe's own parser.

The rows are `nvidia-smi --query-gpu=index,pci.bus_id,name,mig.mode.current,mig.mode.pending
--format=csv,noheader,nounits` as operators publish them: `Enabled, Enabled` on a partitioned
A100 (NVIDIA's GPU Operator guide for OpenShift, "Verify that MIG has been enabled"),
`Disabled, Enabled` after `nvidia-smi -i N -mig 1` and before the reset, `[N/A], [N/A]` on a
model without MIG (an A2).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_health_smi
from pytest_gpuhost.modules.health import checks as hm

FIELDS = ["index", "pci.bus_id", "name", "mig.mode.current", "mig.mode.pending"]


def facts(monkeypatch: pytest.MonkeyPatch, *rows: str, stderr: str = "", rc: int = 0) -> dict[str, Any]:
    """Parse `rows` as nvidia-smi's csv with the probe's smi_gpus; return the facts the check reads."""

    def run(argv: list[str], timeout: float, record: list[Any]) -> dict[str, Any]:
        return {"rc": rc, "stdout": "\n".join(rows) + "\n", "stderr": stderr, "timed_out": False}

    monkeypatch.setattr(probe_health_smi, "run_recorded", run)
    return {"gpus": probe_health_smi.smi_gpus({"query_fields": FIELDS}, [])}


def judge(f: dict[str, Any], **vars: Any) -> hm.Verdict:
    return hm.evaluate("mig_mode", f, hm.Thresholds.from_vars(vars))


A100 = "NVIDIA A100-SXM4-40GB"


def test_whole_gpus_pass_and_a_model_without_mig_is_not_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    f = facts(
        monkeypatch,
        f"0, 00000000:07:00.0, {A100}, Disabled, Disabled",
        "1, 00000000:08:00.0, NVIDIA A2, [N/A], [N/A]",
    )
    v = judge(f)
    assert (v.ok, v.skip, v.summary) == (True, None, "MIG mode Disabled on all 1 GPUs with MIG")
    v = judge(facts(monkeypatch, "0, 00000000:08:00.0, NVIDIA A2, [N/A], [N/A]"))
    assert v.ok and v.skip == "no GPU here has MIG"


def test_a_gpu_left_in_mig_mode_and_one_with_a_change_pending_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    f = facts(
        monkeypatch,
        f"0, 00000000:07:00.0, {A100}, Enabled, Enabled",
        f"1, 00000000:0F:00.0, {A100}, Disabled, Enabled",
        f"2, 00000000:47:00.0, {A100}, Enabled, Disabled",
        f"3, 00000000:4E:00.0, {A100}, Disabled, Disabled",
    )
    v = judge(f)
    assert not v.ok and v.summary == "MIG mode not Disabled on 3 of 4 GPUs"
    assert v.reasons == [
        "GPU 0 (0000:07:00.0): MIG mode Enabled, the inventory expects Disabled (nvidia-smi -i 0 -mig 0, then a GPU reset)",
        "GPU 1 (0000:0f:00.0): MIG mode Enabled pending: the next GPU reset applies it (nvidia-smi -i 1 -mig 0 undoes it)",
        "GPU 2 (0000:47:00.0): MIG mode Enabled, Disabled pending (the next GPU reset applies it)",
    ]
    assert v.state["mig_mode"]["0000:0f:00.0"] == ["Disabled", "Enabled"]


def test_a_partitioned_fleet_says_so_in_its_inventory(monkeypatch: pytest.MonkeyPatch) -> None:
    f = facts(monkeypatch, f"0, 00000000:07:00.0, {A100}, Enabled, Enabled")
    assert judge(f, mig_mode="enabled").ok  # the word is matched without case
    assert judge(f, mig_mode="any").skip == "not judged (mig_mode: any)"
    with pytest.raises(
        hm.ThresholdError, match=r"mig_mode='partitioned': expected one of Disabled, Enabled, any"
    ):
        hm.Thresholds.from_vars({"mig_mode": "partitioned"})


def test_an_nvml_error_in_the_cell_fails_and_a_driver_without_the_field_skips(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = facts(monkeypatch, f"0, 00000000:07:00.0, {A100}, [GPU requires reset], [GPU requires reset]")
    v = judge(f)
    assert not v.ok and v.reasons == ["GPU 0 (0000:07:00.0): MIG mode [GPU requires reset]"]
    f = {"gpus": {"ok": True, "gpus": [{"index": 0, "bdf": "0000:07:00.0"}], "dropped": ["mig.mode.current"]}}
    assert (
        judge(f).skip
        == "this driver's nvidia-smi does not know the field mig.mode.current (nor another name for it)"
    )

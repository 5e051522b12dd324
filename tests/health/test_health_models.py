"""Per-model expectations (health.thresholds.MODELS) and GPUs that match no model.

Names are matched as real nvidia-smi prints them (fixtures/outputs: a B300 HGX node on 610.57.04,
and `--query-gpu=name,memory.total,driver_version` of eleven cloud GPU types). A GPU matching no
model is reported as `unknown model: <name>`, and every check that needs a model's figure says it
cannot judge, never judging it as if it were a PCIe card.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_health, probe_health_smi
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import thresholds as th
from tests.health.test_health_verdicts import BDFS, healthy, judge

OUTPUTS = Path(__file__).resolve().parents[2] / "fixtures" / "outputs"
B300_CAPTURE = OUTPUTS / "nvidia-smi-610.57.04-b300x7-query-name-nvlink-s.txt"
NAMES_CAPTURE = OUTPUTS / "nvidia-smi-query-name-memory-driver-datacentre.txt"


def b300_capture() -> tuple[list[str], str]:
    """Return the GPU names of the B300 capture's --query-gpu and its `nvidia-smi nvlink -s` text."""
    text = B300_CAPTURE.read_text()
    query, status = text.split("$ nvidia-smi nvlink --status\n")
    names = [line.split(", ")[1] for line in query.splitlines()[2:] if line.strip()]
    return names, status


def parse_nvlink_s(monkeypatch: pytest.MonkeyPatch, out: str) -> dict[str, Any]:
    """Run the probe's `nvlink` part on a captured `nvidia-smi nvlink -s` (and no error counters)."""

    def run(argv: list[str], timeout: float, record: list[Any]) -> dict[str, Any]:
        return {"rc": 0, "stdout": out if argv[-1] == "-s" else "", "stderr": "", "timed_out": False}

    for module in (probe_health, probe_health_smi):  # the readers, and the fabric part's systemctl
        monkeypatch.setattr(module, "run_recorded", run)
    part = probe_health.part_nvlink({}, [])
    part.pop("errors", None)  # counters are judged elsewhere (tests/health/test_health_nvlink.py)
    return part


def with_names(*names: str) -> dict[str, Any]:
    facts = healthy()
    for g, name in zip(facts["gpus"]["gpus"], names, strict=False):
        g["name"] = name
    return facts


def test_a_b300_with_its_links_down_fails_on_the_real_name_and_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B300 HGX: 18 NVLink 5 links per GPU; a GPU with none printed used to be skipped as 'no NVLink'."""
    names, status = b300_capture()
    assert set(names) == {"NVIDIA B300 SXM6 AC"}
    facts = with_names(*names)
    facts["nvlink"] = parse_nvlink_s(monkeypatch, status)
    assert sorted(facts["nvlink"]["gpus"]) == ["0", "1"]  # the capture keeps GPUs 0 and 1
    assert len(facts["nvlink"]["gpus"]["0"]["links"]) == 18
    v = judge("nvlink", facts)
    assert not v.ok and v.reasons == [
        "GPU 2 (0000:3a:00.0): 0 of 18 NVLinks active (no link lines)",
        "GPU 3 (0000:3b:00.0): 0 of 18 NVLinks active (no link lines)",
    ], v
    # every link of every GPU down, none printed: the model's count still fails it
    facts["nvlink"] = {"ok": True, "gpus": {}}
    v = judge("nvlink", facts)
    assert not v.ok and len(v.reasons) == 4 and "0 of 18 NVLinks active" in v.reasons[0], v
    # all links printed <inactive>
    down = status.replace("53.125 GB/s", "<inactive>")
    facts["nvlink"] = parse_nvlink_s(monkeypatch, down)
    v = judge("nvlink", facts)
    assert not v.ok and v.reasons[0] == "GPU 0 (0000:17:00.0): 0 of 18 NVLinks active (18 link lines)", v


def test_an_unknown_model_is_reported_never_judged_as_a_pcie_card() -> None:
    """A GPU matching no model: the NVLink count cannot be judged, and the verdict says why."""
    facts = with_names(*(["NVIDIA Z900 SXM9"] * 4))
    v = judge("nvlink", facts)
    # before: skipped as "no NVLink on this host", the verdict of a PCIe card
    assert v.skip != "no NVLink on this host", v
    assert v.skip is not None and "unknown model: NVIDIA Z900 SXM9" in v.skip, v
    assert "nvlink_active_min" in v.skip
    assert judge("nvlink", facts, nvlink_active_min=18).ok is False  # the inventory's count judges it
    # links that are printed are still judged on an unknown model
    facts["nvlink"]["gpus"] = {"0": {"links": {"0": {"up": False, "text": "<inactive>"}}}}
    v = judge("nvlink", facts)
    assert not v.ok and "GPU 0 link 0: <inactive>" in v.reasons, v
    assert "unknown model: NVIDIA Z900 SXM9" in v.summary, v


def test_an_unknown_model_is_named_by_every_check_that_needs_its_figure() -> None:
    facts = with_names(*(["NVIDIA Z900 SXM9"] * 4))
    v = judge("gpu_count", facts)
    assert v.ok and "unknown model: NVIDIA Z900 SXM9" in v.summary, v
    assert v.state["unknown_models"] == ["NVIDIA Z900 SXM9"]
    # ECC off on an unknown model: whether it supports ECC is not known, said so
    for g in facts["gpus"]["gpus"]:
        g.update(
            {
                "ecc.mode.current": 0,
                "ecc.errors.uncorrected.volatile.total": None,
                "ecc.errors.corrected.volatile.total": None,
            }
        )
    v = judge("ecc", facts)
    assert v.skip is not None and "unknown model: NVIDIA Z900 SXM9" in v.skip and "ecc_required" in v.skip, v
    assert not judge("ecc", facts, ecc_required=True).ok
    # memory temperature with no limit read: the model is unknown, said so
    for i, g in enumerate(facts["gpus"]["gpus"]):
        g["temperature.memory"] = 60 + i
    v = judge("memory_temperature", facts)
    assert v.skip is not None and "unknown model: NVIDIA Z900 SXM9" in v.skip, v
    # fabric: whether the GPUs sit on NVSwitches is not known
    v = judge("fabric", facts)
    assert v.skip is not None and "unknown model: NVIDIA Z900 SXM9" in v.skip, v


def test_one_unknown_gpu_among_known_ones_is_named_and_the_others_judged() -> None:
    facts = with_names("NVIDIA B200", "NVIDIA B200", "NVIDIA B200", "NVIDIA Z900 SXM9")
    up = {str(i): {"up": True, "gbps": 53.125, "text": "53.125 GB/s"} for i in range(18)}
    facts["nvlink"]["gpus"] = {str(i): {"links": dict(up)} for i in range(3)}
    v = judge("nvlink", facts)
    assert (
        v.ok
        and v.summary == "all 54 NVLinks up; unknown model: NVIDIA Z900 SXM9 (GPU 3): NVLink count not judged"
    ), v
    del facts["nvlink"]["gpus"]["1"]
    v = judge("nvlink", facts)
    assert not v.ok and v.reasons == ["GPU 1 (0000:18:00.0): 0 of 18 NVLinks active (no link lines)"], v


def test_a_grace_hopper_or_grace_blackwell_name_is_not_read_as_its_hgx_sibling() -> None:
    """GH200 contains "H200", GB200 "B200", H200 "H20": matched as whole model names, not substrings."""
    assert th.model_spec("NVIDIA GH200 480GB") is None
    assert th.model_name("NVIDIA GB200") == "GB200"
    assert th.model_name("NVIDIA GB300") == "GB300"
    assert th.model_name("NVIDIA H200") == "H200 SXM"
    assert th.model_name("NVIDIA H20") == "H20"
    assert th.model_name("NVIDIA H200 NVL") == "H200 NVL"
    # the probe reads the fabric by the first substring of fabric_models, so the order must agree
    params = hm.probe_params(hm.Thresholds.from_vars({}))
    for name in ("NVIDIA GB200", "NVIDIA GB300", "NVIDIA H20", "NVIDIA H200", "NVIDIA B300 SXM6 AC"):
        spec = th.model_spec(name) or {}
        assert probe_health.fabric_wanted(params, [{"name": name}]) is bool(spec.get("fabric")), name


def test_gh200_read_by_the_probe_is_not_judged_as_an_hgx_fabric() -> None:
    """The probe's substring match reads -q on a GH200 ("H200"); the check judges only known fabric models."""
    facts = with_names(*(["NVIDIA GH200 480GB"] * 4))
    facts["fabric"] = {
        "ok": True,
        "gpus": {b: {"state": "N/A", "status": "N/A"} for b in BDFS},
        "unit": "nvidia-fabricmanager.service",
        "service": {"LoadState": "not-found", "ActiveState": "inactive"},
    }
    v = judge("fabric", facts)
    assert v.skip is not None and "unknown model: NVIDIA GH200 480GB" in v.skip, v


#: name as nvidia-smi prints it -> (model, NVLinks expected, NVSwitch fabric, ECC, PCIe gen, width)
EXPECTED: dict[str, tuple[str, int, bool, bool, int | None, int | None]] = {
    "NVIDIA B300 SXM6 AC": ("B300", 18, True, True, 6, 16),
    "NVIDIA GB300": ("GB300", 18, False, True, None, None),
    "NVIDIA GB200": ("GB200", 18, False, True, None, None),
    "NVIDIA B200": ("B200", 18, True, True, 5, 16),
    "NVIDIA H200": ("H200 SXM", 18, True, True, 5, 16),
    "NVIDIA H200 NVL": ("H200 NVL", 0, False, True, 5, 16),
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 18, True, True, 5, 16),
    "NVIDIA H100 PCIe": ("H100 PCIe", 0, False, True, 5, 16),
    "NVIDIA H100 NVL": ("H100 NVL", 0, False, True, 5, 16),
    "NVIDIA H800": ("H800 SXM", 8, True, True, 5, 16),
    "NVIDIA H800 PCIe": ("H800 PCIe", 0, False, True, 5, 16),
    "NVIDIA H20": ("H20", 18, True, True, 5, 16),
    "NVIDIA A100-SXM4-80GB": ("A100 SXM4", 12, False, True, 4, 16),
    "NVIDIA A100-SXM4-40GB": ("A100 SXM4", 12, False, True, 4, 16),
    "NVIDIA A100 80GB PCIe": ("A100 PCIe", 0, False, True, 4, 16),
    "NVIDIA A100-PCIE-40GB": ("A100 PCIe", 0, False, True, 4, 16),
    "NVIDIA L40S": ("L40S", 0, False, True, 4, 16),
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": ("RTX PRO 6000", 0, False, True, 5, 16),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_models_lookup(name: str) -> None:
    model, nvlinks, fabric, ecc, gen, width = EXPECTED[name]
    spec = th.model_spec(name)
    assert spec is not None, name
    assert th.model_name(name) == model
    assert (spec["nvlinks"], spec["fabric"], spec["ecc"]) == (nvlinks, fabric, ecc), name
    assert (spec.get("pcie_gen"), spec.get("pcie_width")) == (gen, width), name
    assert th.model_spec(name.lower()) is spec  # case-insensitive, as before


def test_the_names_real_gpus_printed_are_matched() -> None:
    """`--query-gpu=name,memory.total,driver_version` of real cloud GPUs (fixtures/outputs)."""
    names = [line.split(", ")[0] for line in NAMES_CAPTURE.read_text().splitlines() if line.strip()]
    got = {n: th.model_name(n) for n in names}
    assert got == {
        "Tesla T4": None,
        "NVIDIA L4": None,
        "NVIDIA A10": None,
        "NVIDIA L40S": "L40S",
        "NVIDIA A100-SXM4-40GB": "A100 SXM4",
        "NVIDIA A100-SXM4-80GB": "A100 SXM4",
        "NVIDIA RTX PRO 6000 Blackwell Server Edition": "RTX PRO 6000",
        "NVIDIA H100 80GB HBM3": "H100 SXM",
        "NVIDIA H200": "H200 SXM",
        "NVIDIA B200": "B200",
        "NVIDIA B300 SXM6 AC": "B300",
    }
    # an L4 or A10 (not in the table): unknown, so NVLinks are not judged as on a PCIe card
    facts = with_names(*(["NVIDIA L4"] * 4))
    assert "unknown model: NVIDIA L4" in str(judge("nvlink", facts).skip)


def test_the_model_table_says_where_each_figure_comes_from() -> None:
    """Every model has a source line; the figures not confirmed say so."""
    for model, spec in th.MODEL_SPECS.items():
        assert spec.get("source"), model
    assert "not verified" in th.MODEL_SPECS["H20"]["source"]


def test_unknown_model_facts_do_not_change_known_verdicts() -> None:
    """The healthy RTX PRO 6000 host is judged exactly as before."""
    facts = healthy()
    before = copy.deepcopy(facts)
    assert judge("nvlink", facts).skip == "no NVLink on this host"
    assert "unknown" not in judge("gpu_count", facts).summary
    assert facts == before

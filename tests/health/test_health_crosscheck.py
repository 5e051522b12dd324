"""NVML against nvidia-smi (modules/health/crosscheck.py): lab hosts read both ways agree, and
every kind of disagreement is found.

On a lab host both readers read one state (gpulab/nvml and the lab's nvidia-smi), so a
difference there is a bug in one of our two readers; on a real GPU scripts/gpu_check.py runs the
same comparison against the driver.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from gpulab.host.lab import CLIENT_KEY
from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url
from pytest_gpuhost.modules.health.crosscheck import differences, read_both
from pytest_gpuhost.modules.health.thresholds import Thresholds, probe_params
from tests.health.test_health_lab_gpus import boot, inject


def _conn(h: Any) -> Iterator[Any]:
    opts = TargetOptions(identity=str(CLIENT_KEY), known_hosts=str(h.known_hosts), command_timeout=30)
    c = open_connection(parse_host_url(f"ssh://root@{h.address}"), opts)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize(
    ("profile", "faults"),
    [
        ("health-ok", {"gpus": {"0000:23:00.0": {"nvml_error": "GPU requires reset"}}}),
        (
            "b200-nvl8",
            {
                "gpus": {
                    "0000:43:00.0": {"nvlinks_down": [3], "nvlink_errors": {"7": {"Rx Errors": 4}}},
                    "0000:52:00.0": {"fabric_state": "In Progress", "fabric_status": "N/A"},
                    "0000:61:00.0": {"nvlinks_down": "all", "memory_temp_max": 85},
                }
            },
        ),
    ],
)
def test_a_lab_host_reads_the_same_through_nvml_and_nvidia_smi(lab: Any, profile: str, faults: dict) -> None:
    h = boot(lab, profile)
    inject(h, faults)
    try:
        for c in _conn(h):
            nvml, smi = read_both(c, probe_params(Thresholds.from_vars({})))
    finally:
        inject(h, {})
    assert nvml["gpus"]["source"] == "nvml" and smi["gpus"]["source"] == "nvidia-smi"
    if profile == "b200-nvl8":  # the parts compared were read both ways
        assert nvml["nvlink"]["source"] == nvml["fabric"]["source"] == "nvml", nvml["nvlink"]
        assert smi["nvlink"]["source"] == smi["fabric"]["source"] == "nvidia-smi"
        assert nvml["nvlink"]["errors"]["gpus"]["1"]["links"] == {"7": {"Rx Errors": 4}}
    assert differences(nvml, smi) == []


def _facts(source: str) -> dict[str, Any]:
    row = {"bdf": "0000:17:00.0", "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-1", "temperature.gpu": 40}
    row.update({"ecc.errors.uncorrected.volatile.total": 0, "pcie.link.width.current": 16})
    link = {
        "0": {"up": True, "gbps": 26.562, "text": "26.562 GB/s"},
        "1": {"up": True, "gbps": 26.562, "text": ""},
    }
    return {
        "gpus": {"ok": True, "source": source, "gpus": [row]},
        "remap": {"ok": True, "gpus": {"0000:17:00.0": {"remapped_rows.pending": 0}}},
        "nvlink": {
            "ok": True,
            "gpus": {"0": {"links": link}},
            "errors": {"ok": True, "gpus": {"0": {"read": 6, "links": {}}}},
        },
        "fabric": {
            "ok": True,
            "gpus": {"0000:17:00.0": {"state": "Completed", "status": "Success"}},
            "memory_temp_max": {"0000:17:00.0": 95.0},
        },
    }


def _set(facts: dict[str, Any], path: str, value: Any) -> None:
    *head, last = path.split("/")
    node: Any = facts
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value


@pytest.mark.parametrize(
    ("path", "value", "said"),
    [
        ("gpus/gpus/0/uuid", "GPU-2", "GPU 0000:17:00.0 uuid: NVML 'GPU-1', nvidia-smi 'GPU-2'"),
        ("gpus/gpus/0/pcie.link.width.current", 8, "pcie.link.width.current: NVML 16, nvidia-smi 8"),
        (
            "gpus/gpus/0/cell_errors",
            {"ecc.errors.uncorrected.volatile.total": "GPU is lost"},
            "nvidia-smi '[GPU is lost]'",
        ),
        ("gpus/gpus/0/temperature.gpu", 50, "temperature.gpu: NVML 40, nvidia-smi 50"),
        ("remap/gpus/0000:17:00.0/remapped_rows.pending", 1, "remapped_rows.pending: NVML 0, nvidia-smi 1"),
        ("nvlink/gpus/0/links/1/up", False, "GPU 0 NVLinks up: NVML ['0', '1'], nvidia-smi ['0']"),
        ("nvlink/errors/gpus/0/links", {"1": {"CRC Errors": 2}}, "GPU 0 NVLink error counters"),
        ("fabric/gpus/0000:17:00.0/state", "In Progress", "GPU 0000:17:00.0 fabric: NVML"),
        ("fabric/memory_temp_max/0000:17:00.0", 85.0, "memory limit: NVML 95.0 C, nvidia-smi 85.0 C"),
    ],
)
def test_every_kind_of_disagreement_is_said(path: str, value: Any, said: str) -> None:
    nvml, smi = _facts("nvml"), _facts("nvidia-smi")
    assert differences(nvml, copy.deepcopy(smi)) == []
    _set(smi, path, value)
    got = differences(nvml, smi)
    assert len(got) == 1 and said in got[0], got


def test_a_small_temperature_step_and_a_field_one_side_lacks_are_not_disagreements() -> None:
    nvml, smi = _facts("nvml"), _facts("nvidia-smi")
    smi["gpus"]["gpus"][0]["temperature.gpu"] = 42
    del smi["gpus"]["gpus"][0]["uuid"]  # this driver's nvidia-smi dropped the field
    smi["nvlink"]["gpus"]["0"]["links"] = {}  # all links down: some drivers print no line
    nvml["nvlink"]["gpus"]["0"]["links"] = {k: {"up": False} for k in ("0", "1")}
    assert differences(nvml, smi) == []


def test_no_nvml_read_is_said_first() -> None:
    nvml = _facts("nvidia-smi")
    nvml["gpus"]["nvml_fallback"] = "libnvidia-ml.so.1: cannot open shared object file"
    assert differences(nvml, _facts("nvidia-smi")) == [
        "NVML was not read: libnvidia-ml.so.1: cannot open shared object file"
    ]

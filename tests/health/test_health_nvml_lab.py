"""suites/health through NVML on a lab host: the stand-in libnvidia-ml.so.1 (gpulab/nvml/).

The same verdicts as through nvidia-smi (GPUHOST_HEALTH_SOURCE=nvidia-smi forces that path),
the evidence's source, and the lab fault `nvml_hang` failing the node within the probe's bound
with the call named.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_program
from pytest_gpuhost.modules.health.facts import SOURCE_ENV
from tests.health.test_health_lab_gpus import inject, run_suite


@pytest.fixture(scope="module")
def host(lab: Any) -> Any:
    return lab.host("health-ok", name=f"nv{os.getpid() % 100000}")


def nvml_fact(h: Any, params: dict[str, Any]) -> dict[str, Any]:
    """Run the agent's NVML probe alone on the lab host; return the fact and the `health` parts."""
    call = (
        "import json as _j\n"
        f"_p = {params!r}\n"
        "_f = fact_health_nvml(_p)\n"
        "print(_j.dumps({'fact': _f, 'read': _p.get('_health_nvml')}))\n"
    )
    r = h.ssh(["python3", "-S", "-c", probe_program("probe_health_nvml", call)], timeout=60)
    assert r.returncode == 0, r.stderr
    got: dict[str, Any] = json.loads(r.stdout)
    return got


def test_the_lab_host_answers_through_its_libnvidia_ml(host: Any) -> None:
    got = nvml_fact(host, {"timeout": 10})
    assert got["fact"]["ok"] and got["fact"]["source"] == "nvml", got["fact"]
    gpus = got["read"]["gpus"]["gpus"]
    smi = host.ssh(["nvidia-smi", "--query-gpu=pci.bus_id,uuid,temperature.gpu", "--format=csv,noheader"])
    want = [[c.strip() for c in line.split(",")] for line in smi.stdout.splitlines() if line.strip()]
    assert [[g["raw"]["pci.bus_id"], g["uuid"], str(g["temperature.gpu"])] for g in gpus] == want


def test_nvml_and_nvidia_smi_give_the_same_verdicts(
    host: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_suite(host, tmp_path, name="baseline")  # both runs below compare with a last run
    monkeypatch.setenv(SOURCE_ENV, "nvidia-smi")
    smi = run_suite(host, tmp_path, name="smi")["hosts"][host.name]
    monkeypatch.setenv(SOURCE_ENV, "auto")
    nvml = run_suite(host, tmp_path, name="nvml")["hosts"][host.name]
    assert smi["status"] == nvml["status"]
    pick = {"outcome", "summary", "reasons"}
    same = {k: {f: v for f, v in c.items() if f in pick} for k, c in smi["checks"].items() if k != "xid"}
    assert {
        k: {f: v for f, v in c.items() if f in pick} for k, c in nvml["checks"].items() if k != "xid"
    } == same


def test_the_evidence_says_which_source_was_read(
    host: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SOURCE_ENV, "auto")
    state = run_suite(host, tmp_path, name="nvml")["hosts"][host.name]["checks"]["gpu_count"]["state"]
    assert state["source"] == "nvml" and "nvml_fallback" not in state, state
    monkeypatch.setenv(SOURCE_ENV, "nvidia-smi")
    state = run_suite(host, tmp_path, name="smi")["hosts"][host.name]["checks"]["gpu_count"]["state"]
    assert state["source"] == "nvidia-smi" and "nvml_fallback" not in state, state
    # without the library (moved aside), nvidia-smi, and the evidence says why
    lib = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    monkeypatch.setenv(SOURCE_ENV, "auto")
    assert host.ssh(["mv", lib, lib + ".aside"]).returncode == 0
    try:
        state = run_suite(host, tmp_path, name="gone")["hosts"][host.name]["checks"]["gpu_count"]["state"]
    finally:
        assert host.ssh(["mv", lib + ".aside", lib]).returncode == 0
    assert state["source"] == "nvidia-smi" and "libnvidia-ml.so.1" in state["nvml_fallback"], state


def test_a_hung_nvml_call_fails_the_node_within_the_bound(host: Any, tmp_path: Path) -> None:
    inject(host, {"nvml_hang": "nvmlDeviceGetTemperature"})
    try:
        t0 = time.monotonic()
        got = run_suite(host, tmp_path, host_vars=", probe_timeout: 3", name="hang")["hosts"][host.name]
        took = time.monotonic() - t0
    finally:
        inject(host, {})
    assert got["status"] == "failed", got
    said = [c["summary"] for c in got["checks"].values()]
    assert any("NVML call nvmlDeviceGetTemperature hung after 3 s" in s for s in said), said
    assert took < 40, f"the hung call held the run up: {took:.1f} s"

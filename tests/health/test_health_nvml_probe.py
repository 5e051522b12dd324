"""The NVML probe against the stand-in library, in process: structure layouts, errors, a hang.

The ctypes structures are checked against the C compiler's own layout of nvml.h's structures
(as the stand-in declares them, from https://github.com/NVIDIA/go-nvml/blob/main/gen/nvml/nvml.h).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gpulab import nvml
from pytest_gpuhost.exec.agent import probe_health, probe_health_nvml, probe_health_smi, probe_nvml

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

STATE = """driver 590.48.01
gpu 0
name NVIDIA H100 80GB HBM3
uuid GPU-0
busid 00000000:17:00.0
persistence 1
temp 41
ecc_mode 1
ecc_corrected 3
ecc_uncorrected 0
retired_pending 0
clocks_event 0x0000000000000008
pcie_gen 5
pcie_gen_max 5
pcie_width 16
pcie_width_max 16
fi_82 46
fi_226 !3
fi_230 1
fi_74 0
fi_269 2000000
fi_270 0
fi_271 0
remap_corrected 0
remap_uncorrected 1
remap_pending 1
remap_failure 0
gpu 1
name NVIDIA H100 80GB HBM3
uuid GPU-1
busid 00000000:2A:00.0
persistence 1
temp !15
remap_corrected !15
remap_uncorrected !15
remap_pending !15
remap_failure !15
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(nvml.build(tmp_path_factory.mktemp("nvml-build")))


def read(lib: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, timeout: float = 10) -> dict:
    (tmp_path / "state").write_text(text)
    monkeypatch.setenv("GPULAB_NVML_STATE_FILE", str(tmp_path / "state"))
    params = {"timeout": timeout, "nvml_library": lib}
    probe_health_nvml.fact_health_nvml(params)
    return params


def c_values(tmp_path: Path, fmt: str, *exprs: str) -> list[int]:
    """Compile a program that includes the stand-in's nvml.h declarations; return what `exprs` print."""
    prog = tmp_path / "layout.c"
    prog.write_text(
        f'#include "{nvml.SOURCE}"\n#include <stddef.h>\n'
        f'int main(void) {{ printf("{fmt}\\n", {", ".join(exprs)}); return 0; }}\n'
    )
    subprocess.run(["cc", "-o", str(tmp_path / "layout"), str(prog)], check=True, timeout=60)
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def test_the_structures_are_laid_out_as_nvml_h(tmp_path: Path) -> None:
    got = c_values(
        tmp_path,
        "%zu %zu %zu %zu %zu",
        "sizeof(nvmlPciInfo_t)",
        "offsetof(nvmlPciInfo_t, busId)",
        "sizeof(nvmlFieldValue_t)",
        "offsetof(nvmlFieldValue_t, nvmlReturn)",
        "offsetof(nvmlFieldValue_t, value)",
    )
    p, f = probe_nvml.PciInfo, probe_nvml.FieldValue
    want = [ctypes.sizeof(p), p.busId.offset, ctypes.sizeof(f), f.nvmlReturn.offset, f.value.offset]
    assert got == want == [68, 36, 40, 28, 32]


def test_the_parts_have_the_nvidia_smi_shape(
    lib: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = read(lib, tmp_path, monkeypatch, STATE)
    gpus = probe_health.part_gpus(params, [])
    assert gpus["ok"] and gpus["source"] == "nvml"
    g0, g1 = gpus["gpus"]
    assert (g0["bdf"], g0["temperature.gpu"], g0["ecc.errors.corrected.volatile.total"]) == (
        "0000:17:00.0",
        41,
        3,
    )
    assert g0["gpu_recovery_action"] == "Reset" and "reset_status.reset_required" not in g0
    assert gpus["renamed"] == {"reset_status.reset_required": "gpu_recovery_action"}
    assert g0["clocks_event_reasons_counters.sw_thermal_slowdown"] == 2000  # ns in NVML, us as nvidia-smi
    assert g0["clocks_throttle_reasons.active"] == 8 and g0["temperature.memory"] == 46
    assert g1["cell_errors"]["temperature.gpu"] == "GPU is lost" and g1["temperature.gpu"] is None
    assert g1["ecc.mode.current"] is None and "ecc.mode.current" not in g1["cell_errors"]  # not supported
    remap = probe_health.part_remap(params, [])
    assert remap["gpus"]["0000:17:00.0"]["remapped_rows.pending"] == 1
    assert remap["gpus"]["0000:2a:00.0"]["cell_errors"]["remapped_rows.pending"] == "GPU is lost"


def test_a_hung_call_is_killed_at_the_bound(
    lib: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t0 = time.monotonic()
    params = read(lib, tmp_path, monkeypatch, STATE + "hang nvmlDeviceGetRemappedRows\n", timeout=1)
    assert time.monotonic() - t0 < 3
    got = params[probe_health.NVML_KEY]
    assert (got["error"], got["call"], got["after_s"]) == ("driver hung", "nvmlDeviceGetRemappedRows", 1.0)
    part = probe_health.part_gpus(params, [])
    assert not part["ok"] and part["error"] == "NVML call nvmlDeviceGetRemappedRows hung after 1 s"


def test_no_library_falls_back_to_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = {"timeout": 5, "nvml_library": str(tmp_path / "libnvidia-ml.so.1")}
    fact = probe_health_nvml.fact_health_nvml(params)
    assert fact["absent"] and "cannot open shared object file" in fact["error"]
    monkeypatch.setattr(
        probe_health_smi,
        "run_recorded",
        lambda argv, timeout, record: {"rc": 127, "stdout": "", "stderr": "", "timed_out": False},
    )
    part = probe_health.part_gpus(params, [])
    assert part["source"] == "nvidia-smi" and "cannot open shared object file" in part["nvml_fallback"]


def test_a_failed_init_says_nvmls_error(lib: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULAB_NVML_STATE_FILE", str(tmp_path / "absent"))
    params = {"timeout": 5, "nvml_library": lib}
    fact = probe_health_nvml.fact_health_nvml(params)
    assert fact["error"] == "nvmlInit_v2: Driver Not Loaded"


def test_a_bad_source_in_the_environment_is_a_one_line_usage_error(tmp_path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "GPUHOST_HEALTH_SOURCE": "nvml"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/health", "--host=local://", "--check-only", "-q",
         "-p", "no:cacheprovider", f"--report-dir={tmp_path}"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        "ERROR: gpuhost: GPUHOST_HEALTH_SOURCE='nvml' (from the environment): use one of auto, nvidia-smi"
    ], r.stderr


# NVLink and fabric: an H100 (NVLink 4's data-link counters, link 1 down), a B200 (NVLink 5's
# counters as field values, its fabric still training) and an H100 in MIG mode.
LINKS = """driver 580.95.05
gpu 0
name NVIDIA H100 80GB HBM3
busid 00000000:17:00.0
fi_91 2
nvl_state.0 1
fi_164.0 26562
nvl_err_0.0 5
nvl_err_1.0 0
nvl_err_2.0 0
nvl_state.1 0
fi_164.1 0
nvl_err_0.1 0
nvl_err_1.1 0
nvl_err_2.1 !15
fabric_state 3
fabric_status 0
temp_mem_max 95
gpu 1
name NVIDIA B200
busid 00000000:43:00.0
fi_91 1
nvl_state.0 1
fi_164.0 50000
fi_221.0 2
fi_208.0 0
fabric_state 2
fabric_status 999
gpu 2
name NVIDIA H100 80GB HBM3
busid 00000000:52:00.0
mig 1
"""


def test_nvlink_and_fabric_come_through_nvml_in_nvidia_smis_shape(
    lib: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = read(lib, tmp_path, monkeypatch, LINKS)
    nv = probe_health.part_nvlink(params, [])
    assert nv["source"] == "nvml" and nv["gpus"]["0"]["links"] == {
        "0": {"up": True, "gbps": 26.562, "text": "26.562 GB/s"},
        "1": {"up": False, "gbps": None, "text": "<inactive>"},
    }
    assert nv["gpus"]["1"]["links"]["0"]["text"] == "50 GB/s"
    assert nv["gpus"]["2"]["links"] == {} and "MIG mode" in nv["gpus"]["2"]["mig"]
    errors = nv["errors"]["gpus"]
    # a counter that could not be read is not counted as read (the GPU lost on link 1's CRC)
    assert (errors["0"]["read"], errors["0"]["links"]) == (5, {"0": {"Replay Errors": 5}})
    assert (errors["1"]["read"], errors["1"]["links"]) == (2, {"0": {"Symbol Errors": 2}})
    assert "2" not in errors
    fab = probe_health.part_fabric(params, [])
    assert fab["source"] == "nvml" and fab["gpus"] == {
        "0000:17:00.0": {"state": "Completed", "status": "Success"},
        "0000:43:00.0": {"state": "In Progress", "status": "N/A"},  # status read only once completed
        "0000:52:00.0": {"state": "N/A", "status": "N/A"},
    }
    assert fab["memory_temp_max"] == {"0000:17:00.0": 95.0}


def test_a_fabric_structure_is_laid_out_as_nvml_h(tmp_path: Path) -> None:
    got = c_values(
        tmp_path,
        "%zu %zu %zu %zu %u",
        "sizeof(nvmlGpuFabricInfo_t)",
        "offsetof(nvmlGpuFabricInfo_t, state)",
        "sizeof(nvmlGpuFabricInfo_v2_t)",
        "offsetof(nvmlGpuFabricInfo_v2_t, healthMask)",
        "nvmlGpuFabricInfo_v2",
    )
    v1, v2 = probe_nvml.FabricInfo, probe_nvml.FabricInfoV2
    want = [ctypes.sizeof(v1), v1.state.offset, ctypes.sizeof(v2), v2.healthMask.offset, probe_nvml.FABRIC_V2]
    assert got == want == [28, 24, 36, 32, 36 | 2 << 24]


def test_a_hung_nvlink_call_is_named(lib: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = read(lib, tmp_path, monkeypatch, LINKS + "hang nvmlDeviceGetNvLinkErrorCounter\n", timeout=1)
    part = probe_health.part_nvlink(params, [])
    assert not part["ok"] and part["error"] == "NVML call nvmlDeviceGetNvLinkErrorCounter hung after 1 s"

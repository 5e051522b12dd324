"""Nightly health checks of GPU hosts: one test per check, parametrized per target.

All checks of a host are judged from one `health` facts request (suites/health/conftest.py);
thresholds come from the inventory's host and group variables (defaults:
pytest_gpuhost.modules.health.checks.THRESHOLDS, docs/fleet.md). Checks only report unless a safe fix
is allowed with `--fix=persistence` / `--fix=service`; under `--check-only` those show as
"would fix" with the exact command.

    pytest suites/health --inventory=fleet.yaml -n 16 --check-only --limit 'rack1 and not gpu-07'
"""

from __future__ import annotations

from collections.abc import Callable

Judge = Callable[[str], None]


def test_gpu_count(judge: Judge) -> None:
    """nvidia-smi sees the GPUs (count and model) the inventory expects."""
    judge("gpu_count")


def test_driver_version(judge: Judge) -> None:
    """One driver version on every GPU, the inventory's if it names one."""
    judge("driver_version")


def test_cuda_version(judge: Judge) -> None:
    """The CUDA version the driver reports, the inventory's if it names one."""
    judge("cuda_version")


def test_persistence_mode(judge: Judge) -> None:
    """Persistence mode is on for every GPU (fixable: --fix=persistence)."""
    judge("persistence_mode")


def test_ecc(judge: Judge) -> None:
    """No uncorrected ECC errors (and corrected ones under their limit, if set)."""
    judge("ecc")


def test_retired_pages(judge: Judge) -> None:
    """No retired pages waiting for a GPU reset."""
    judge("retired_pages")


def test_remapped_rows(judge: Judge) -> None:
    """No row remapping failure."""
    judge("remapped_rows")


def test_xid(judge: Judge) -> None:
    """No Xid error in the kernel log since the last run (first run: since boot)."""
    judge("xid")


def test_sxid(judge: Judge) -> None:
    """No NVSwitch SXid error in the kernel log since the last run."""
    judge("sxid")


def test_pcie_link(judge: Judge) -> None:
    """Every GPU's PCIe link runs at its maximum generation and width."""
    judge("pcie_link")


def test_pcie_aer(judge: Judge) -> None:
    """No fatal or non-fatal PCIe AER error on a GPU since the last run (correctable: under the limit)."""
    judge("pcie_aer")


def test_nvlink(judge: Judge) -> None:
    """Every NVLink is up, as many active as the GPU model has (skipped on hosts without NVLink)."""
    judge("nvlink")


def test_fabric(judge: Judge) -> None:
    """On NVSwitch GPU models: the fabric is trained on every GPU and Fabric Manager runs."""
    judge("fabric")


def test_infiniband(judge: Judge) -> None:
    """RDMA ports active at their rate, no link flaps since the last run, nvidia_peermem loaded."""
    judge("infiniband")


def test_iommu_group_type(judge: Judge) -> None:
    """The IOMMU groups of GPUs on nvidia have an allowed type (identity by default)."""
    judge("iommu_group_type")


def test_acs(judge: Judge) -> None:
    """No ACS request/completion redirect on the bridges above the GPUs."""
    judge("acs")


def test_p2p(judge: Judge) -> None:
    """nvidia-smi reports P2P OK for every pair of GPUs."""
    judge("p2p")


def test_throttle(judge: Judge) -> None:
    """No GPU throttled for a hardware, thermal or power-brake reason."""
    judge("throttle")


def test_clock_events(judge: Judge) -> None:
    """No GPU held down by HW slowdown (or too long by SW thermal slowdown) since the last run."""
    judge("clock_events")


def test_temperature(judge: Judge) -> None:
    """The hottest GPU is under the limit (re-read when within the noise band)."""
    judge("temperature")


def test_memory_temperature(judge: Judge) -> None:
    """Each GPU's memory (HBM) is under its limit (the GPU's own, else its model's)."""
    judge("memory_temperature")


def test_disk_free(judge: Judge) -> None:
    """Each data path has the free space the inventory asks for."""
    judge("disk_free")


def test_mounts(judge: Judge) -> None:
    """Each mount the inventory names is mounted (read-write unless allowed), data paths writable."""
    judge("mounts")


def test_service(judge: Judge) -> None:
    """The inference service's unit is active (fixable: --fix=service)."""
    judge("service")


def test_service_health(judge: Judge) -> None:
    """The inference service answers its /health endpoint on localhost."""
    judge("service_health")


def test_diag(judge: Judge) -> None:
    """Opt-in active diagnostics (inventory `diag`): nvbandwidth host<->device copies, dcgmi diag."""
    judge("diag")

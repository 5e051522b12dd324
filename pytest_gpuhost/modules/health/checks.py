"""Every health check declared once (`DECLARED`), and one host's facts and thresholds -> a verdict per check.

Pure logic, no I/O: the facts come from the agent's `health` facts (exec/agent/probe_health*.py,
one request per host, merged by `health.facts.merge`), the thresholds from the inventory's host
and group variables (`THRESHOLDS` lists every variable with its default and meaning;
docs/fleet.md shows them). Every verdict says why, in one summary line plus one reason per
offending GPU, line or path.

Measurements that jitter (temperature, free disk) are judged with a noise band: a value within
the band of its limit is not trusted on one reading. `evaluate` then returns `reread` naming the
facts part to sample again; the caller gathers N samples (in one more request) and calls
`evaluate` again with them, and the median of all readings decides. A value that flaps around
its limit therefore does not flip the verdict night after night.

This module is the front, and each check is declared here once (`HealthCheck`, in `DECLARED`):
its verdict function, what it says when it holds and when it fails, the facts parts and
inventory variables it reads, its fix, whether the node check runs it, and the lab test that
shows it failing. The suite's tests (suites/health/test_health.py), the node check's subset
(`health.fast`), `FIXES` and the docs' checks table (scripts/docs_tables.py) are made from
that declaration; docs/health-checks.md "Adding a health check" says how to add one.
The parts, by role: `health.thresholds` (the table of inventory variables), `health.verdict`
(`Verdict` and the facts readers), `health.gpu`, `health.fabric`, `health.host` and
`health.counters` (the checks; counters judged against the last run's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pytest_gpuhost.modules.health.counters import check_clock_events, check_pcie_aer
from pytest_gpuhost.modules.health.diag import check_diag
from pytest_gpuhost.modules.health.fabric import (
    check_acs,
    check_fabric,
    check_iommu_group_type,
    check_nvlink,
    check_p2p,
    check_pcie_link,
)
from pytest_gpuhost.modules.health.gpu import (
    check_cuda_version,
    check_driver_version,
    check_ecc,
    check_gpu_count,
    check_persistence_mode,
    check_remapped_rows,
    check_retired_pages,
    check_temperature,
    check_throttle,
    throttle_reason_names,
)
from pytest_gpuhost.modules.health.host import (
    check_disk_free,
    check_service,
    check_service_health,
    check_sxid,
    check_xid,
)
from pytest_gpuhost.modules.health.ib import check_infiniband
from pytest_gpuhost.modules.health.memory import check_memory_temperature
from pytest_gpuhost.modules.health.mig import check_mig_mode
from pytest_gpuhost.modules.health.mounts import check_mounts
from pytest_gpuhost.modules.health.thresholds import (
    THRESHOLDS,
    Threshold,
    ThresholdError,
    Thresholds,
    probe_params,
)
from pytest_gpuhost.modules.health.verdict import NO_DRIVER, Facts, Verdict, failed, no_driver, skipped

__all__ = [
    "CHECKS",
    "DECLARED",
    "FIXES",
    "THRESHOLDS",
    "HealthCheck",
    "Threshold",
    "Thresholds",
    "ThresholdError",
    "Verdict",
    "checks_table",
    "declared",
    "evaluate",
    "probe_params",
    "throttle_reason_names",
]


@dataclass(frozen=True)
class HealthCheck:
    """One health check, declared once: everything else about it is read from here."""

    name: str
    #: the verdict: `judge(facts, thresholds)`, or with `samples` too where `sampled`
    judge: Callable[..., Verdict]
    #: one line: what holds when the check passes (the suite test's docstring)
    holds: str
    #: what makes it fail (the docs' checks table)
    fails_when: str
    #: the facts parts (health.facts.PARTS) it cannot be judged without
    reads: tuple[str, ...] = ("gpus",)
    #: parts it reads when they are there (the last run's counters come with the kernel log)
    also_reads: tuple[str, ...] = ()
    #: the inventory variables (THRESHOLDS) it reads
    thresholds: tuple[str, ...] = ()
    #: the `--fix` name that repairs it, and what that fix runs (the docs)
    fix: str | None = None
    fix_runs: str = ""
    #: a value inside its noise band is re-read before it is judged
    sampled: bool = False
    #: left to the nightly suite: `gpuhost-nodecheck` does not run it by default
    nightly_only: bool = False
    #: the test (tests/FILE.py::NAME) in which a lab host fails it over SSH; "" where none does
    lab: str = ""


_LAB_GPUS = "tests/health/test_health_lab_gpus.py::"
_LAB_FLEET = "tests/health/test_health_lab.py::test_fleet_verdicts_across_two_runs"

#: The checks, in the order the suite runs them.
DECLARED: tuple[HealthCheck, ...] = (
    HealthCheck(
        "gpu_count",
        check_gpu_count,
        "nvidia-smi sees the GPUs (count and model) the inventory expects.",
        "nvidia-smi sees another number of GPUs than `gpu_count`, a name without `gpu_model`, "
        "or a GPU bound to nvidia that nvidia-smi does not list",
        reads=("gpus", "pci"),
        thresholds=("gpu_count", "gpu_model"),
        lab=_LAB_GPUS + "test_gpu_missing_from_nvidia_smi_fails_without_an_inventory_count",
    ),
    HealthCheck(
        "driver_version",
        check_driver_version,
        "One driver version on every GPU, the inventory's if it names one.",
        "GPUs disagree, or the version is not the inventory's; the fleet summary also flags a "
        "fleet that is not uniform",
        thresholds=("driver_version",),
    ),
    HealthCheck(
        "cuda_version",
        check_cuda_version,
        "The CUDA version the driver reports, the inventory's if it names one.",
        "the CUDA version nvidia-smi's header reports is not the inventory's",
        thresholds=("cuda_version", "driver_version"),
        nightly_only=True,
    ),
    HealthCheck(
        "persistence_mode",
        check_persistence_mode,
        "Persistence mode is on for every GPU (fixable: --fix=persistence).",
        "any GPU has persistence mode off",
        thresholds=("persistence_mode",),
        fix="persistence",
        fix_runs="`systemctl start nvidia-persistenced.service` where the unit exists, else `nvidia-smi -pm 1`",
        lab=_LAB_FLEET,
    ),
    HealthCheck(
        "ecc",
        check_ecc,
        "No uncorrected ECC errors (and corrected ones under their limit, if set).",
        "uncorrected ECC errors over the limit, corrected ones over theirs, or ECC off on a model "
        "that supports it",
        thresholds=("ecc_uncorrected_max", "ecc_corrected_max", "ecc_required"),
        lab=_LAB_GPUS + "test_ecc_disabled_on_an_rtx_pro_6000_fails",
    ),
    HealthCheck(
        "retired_pages",
        check_retired_pages,
        "No retired pages waiting for a GPU reset.",
        "retired pages are pending (a GPU reset owed); GPUs with row remapping instead: skipped",
    ),
    HealthCheck(
        "remapped_rows",
        check_remapped_rows,
        "No row remapping failure.",
        "a row remap is pending or row remapping failed",
        lab=_LAB_GPUS + "test_row_remap_pending_fails_the_gpu",
    ),
    HealthCheck(
        "mig_mode",
        check_mig_mode,
        "Every GPU with MIG is in the inventory's MIG mode (Disabled by default), now and after its next reset.",
        "a GPU whose model has MIG is in another MIG mode than `mig_mode`, or has a change to "
        "another pending for its next reset (models without MIG: not judged)",
        thresholds=("mig_mode",),
        lab=_LAB_GPUS + "test_a_gpu_left_in_mig_mode_fails",
    ),
    HealthCheck(
        "xid",
        check_xid,
        "No Xid error in the kernel log since the last run (first run: since boot).",
        "an Xid not in the ignore list appeared since the last successful run; an Xid that owes a "
        "GPU reset or a reboot fails every night until that GPU was reset or the host rebooted "
        "(kernel log denied, as in a container: cannot see)",
        reads=("kernel_log",),
        thresholds=("xid_ignore",),
        lab=_LAB_GPUS + "test_xid_79_fails_night_after_night_until_the_host_reboots",
    ),
    HealthCheck(
        "sxid",
        check_sxid,
        "No NVSwitch SXid error in the kernel log since the last run.",
        "an NVSwitch SXid not in the ignore list appeared since the last successful run",
        reads=("kernel_log",),
        thresholds=("sxid_ignore",),
    ),
    HealthCheck(
        "pcie_link",
        check_pcie_link,
        "Every GPU's PCIe link runs at its maximum width, and at its maximum generation while at work.",
        "a GPU's link width is below its maximum (or the inventory's minimum), or its generation "
        "is while the GPU is at work (P0..P2); an idle GPU's generation is not judged (it trains "
        "down to save power), its maximum is held against `pcie_gen_min`",
        reads=("gpus", "pci"),
        thresholds=("pcie_gen_min", "pcie_width_min"),
        lab=_LAB_FLEET,
    ),
    HealthCheck(
        "pcie_aer",
        check_pcie_aer,
        "No fatal or non-fatal PCIe AER error on a GPU since the last run (correctable: under the limit).",
        "a fatal or non-fatal PCIe AER error on a GPU since the last run, or more correctable ones "
        "than `pcie_aer_correctable_max`",
        also_reads=("kernel_log",),
        thresholds=("pcie_aer_correctable_max",),
        lab=_LAB_GPUS + "test_pcie_aer_errors_since_the_last_run_fail_once",
    ),
    HealthCheck(
        "nvlink",
        check_nvlink,
        "Every NVLink is up, as many active as the GPU model has (skipped on hosts without NVLink).",
        "an NVLink is down, fewer active than the GPU model has, or a link's error counters "
        "(`nvidia-smi nvlink -e`: replay, recovery, CRC; NVLink 5 packet/link errors) grew past "
        "their limit since the last run (hosts without NVLink: skipped)",
        also_reads=("kernel_log",),
        thresholds=(
            "nvlink_required",
            "nvlink_active_min",
            "nvlink_replay_max",
            "nvlink_recovery_max",
            "nvlink_crc_max",
            "nvlink_link_errors_max",
        ),
        lab=_LAB_GPUS + "test_b200_gpu_with_all_nvlinks_down_fails",
    ),
    HealthCheck(
        "fabric",
        check_fabric,
        "On NVSwitch GPU models: the fabric is trained on every GPU and Fabric Manager runs.",
        "on NVSwitch models: a GPU's fabric not trained, or Fabric Manager not running (other "
        "models: skipped; no systemctl on the node: cannot see)",
        lab=_LAB_GPUS + "test_b200_fabric_in_progress_or_fabric_manager_down_fails",
    ),
    HealthCheck(
        "infiniband",
        check_infiniband,
        "RDMA ports active at their rate, no link flaps since the last run, nvidia_peermem loaded.",
        "an RDMA port the inventory names (or that was active last run) is not ACTIVE, runs "
        "slower, or flapped since the last run; `nvidia_peermem` not loaded where a port is "
        "active (no RDMA ports: skipped)",
        also_reads=("kernel_log",),
        thresholds=("ib_ports", "ib_rate_min_gbps", "ib_link_downed_max", "ib_peermem_required"),
        lab=_LAB_GPUS + "test_infiniband_port_down_since_the_last_run_fails",
    ),
    HealthCheck(
        "iommu_group_type",
        check_iommu_group_type,
        "The IOMMU groups of GPUs on nvidia have an allowed type (identity by default).",
        "a GPU on nvidia sits in an IOMMU group whose type is not allowed (GPUs on vfio-pci "
        "belong to VMs and are not judged)",
        thresholds=("iommu_group_types",),
        nightly_only=True,
    ),
    HealthCheck(
        "acs",
        check_acs,
        "No ACS request/completion redirect on the bridges above the GPUs.",
        "a bridge above a GPU has ACS request or completion redirect on (P2P goes through the "
        "root complex); unknown ACS state (no readable config space, no lspci): skipped",
        thresholds=("acs_redirect_allowed",),
        nightly_only=True,
        lab=_LAB_FLEET,
    ),
    HealthCheck(
        "p2p",
        check_p2p,
        "nvidia-smi reports P2P OK for every pair of GPUs.",
        "`nvidia-smi topo -p2p r` reports a pair that is not OK",
        thresholds=("p2p_required",),
        nightly_only=True,
        lab=_LAB_FLEET,
    ),
    HealthCheck(
        "throttle",
        check_throttle,
        "No GPU throttled for a hardware, thermal or power-brake reason.",
        "a GPU is throttled for a reason in `throttle_fail_mask`",
        thresholds=("throttle_fail_mask",),
        lab=_LAB_GPUS + "test_gpu_that_requires_reset_fails_and_a_renamed_field_is_read_by_its_new_name",
    ),
    HealthCheck(
        "clock_events",
        check_clock_events,
        "No GPU held down by HW slowdown (or too long by SW thermal slowdown) since the last run.",
        "a GPU's clocks were held down by HW slowdown (or too long by SW thermal slowdown) since "
        "the last run",
        reads=("gpus", "kernel_log"),  # the last run's counters come back with the kernel log
        thresholds=("clock_event_hw_max_s", "clock_event_sw_thermal_max_s"),
        lab=_LAB_GPUS + "test_clock_event_time_since_the_last_run_fails_then_passes_when_it_stops_growing",
    ),
    HealthCheck(
        "temperature",
        check_temperature,
        "The hottest GPU is under the limit (re-read when within the noise band).",
        "the hottest GPU is over `temperature_max`",
        thresholds=("temperature_max", "temperature_noise", "reread_count", "reread_interval"),
        sampled=True,
    ),
    HealthCheck(
        "memory_temperature",
        check_memory_temperature,
        "Each GPU's memory (HBM) is under its limit (the GPU's own, else its model's).",
        "a GPU's memory (HBM) is over its limit (the GPU's own, else its model's)",
        thresholds=("memory_temperature_max",),
        lab=_LAB_GPUS + "test_b200_hbm_above_its_own_limit_fails",
    ),
    HealthCheck(
        "disk_free",
        check_disk_free,
        "Each data path has the free space the inventory asks for.",
        "a data path has less free space than asked (or a named mount is missing)",
        reads=("disk",),
        thresholds=(
            "data_paths",
            "mounts",
            "disk_free_min_pct",
            "disk_free_min_gib",
            "disk_free_noise_pct",
            "reread_count",
            "reread_interval",
        ),
        sampled=True,
        lab=_LAB_GPUS + "test_a_missing_model_mount_and_a_read_only_remount_fail",
    ),
    HealthCheck(
        "mounts",
        check_mounts,
        "Each mount the inventory names is mounted (read-write unless allowed), data paths writable.",
        "a mount the inventory names is missing or read-only, or a data path is on a read-only mount",
        reads=("mounts",),
        thresholds=("mounts", "data_paths"),
        lab=_LAB_GPUS + "test_a_missing_model_mount_and_a_read_only_remount_fail",
    ),
    HealthCheck(
        "service",
        check_service,
        "The inference service's unit is active (fixable: --fix=service).",
        "the inference service's unit is not active",
        thresholds=("service",),
        fix="service",
        fix_runs="`systemctl restart UNIT` for a failed or inactive unit",
        nightly_only=True,
        lab=_LAB_FLEET,
    ),
    HealthCheck(
        "service_health",
        check_service_health,
        "The inference service answers its /health endpoint on localhost.",
        "its `/health` on localhost does not answer 200",
        thresholds=("service", "service_port", "service_health_path", "service_health_timeout"),
        nightly_only=True,
    ),
    HealthCheck(
        "diag",
        check_diag,
        "Opt-in active diagnostics (inventory `diag`): nvbandwidth host<->device copies, dcgmi diag.",
        "opt-in (inventory `diag`): nvbandwidth host<->device copies under the floor, or a "
        "`dcgmi diag` test FAIL (not asked for: skipped)",
        thresholds=("diag", "diag_level", "diag_timeout", "h2d_bandwidth_min_gbps"),
        nightly_only=True,
        lab=_LAB_GPUS + "test_opt_in_nvbandwidth_fails_gpus_whose_host_copies_are_slow",
    ),
)

#: The checks' names, in the order the suite runs them.
CHECKS: tuple[str, ...] = tuple(c.name for c in DECLARED)
_BY_NAME: Mapping[str, HealthCheck] = {c.name: c for c in DECLARED}

#: Safe fixes `--fix=NAME` offers, and the check each repairs.
FIXES: Mapping[str, str] = {c.fix: c.name for c in DECLARED if c.fix}


def declared(check: str) -> HealthCheck:
    """Return a check's declaration; an unknown name raises KeyError naming the known ones."""
    try:
        return _BY_NAME[check]
    except KeyError:
        raise KeyError(f"unknown health check {check!r}; known: {', '.join(CHECKS)}") from None


def evaluate(check: str, facts: Facts, t: Thresholds, samples: Sequence[Facts] | None = None) -> Verdict:
    """Judge one check from a host's facts; pass `samples` after a `reread` was asked for."""
    c = declared(check)
    nd = no_driver(facts)
    if nd and {"gpus", "smi", "pci"} & set(c.reads):
        # One line for the host, not one failure per check: gpu_count says it, the rest stand aside.
        if check != "gpu_count":
            return skipped(check, NO_DRIVER)
        if t["gpu_count"] == 0:
            return Verdict("gpu_count", True, f"{nd}; the inventory expects no GPU", state={"count": 0})
        return failed("gpu_count", nd, [nd], state={"count": 0, "driver": None})
    if c.sampled:
        return c.judge(facts, t, samples)
    return c.judge(facts, t)


def checks_table() -> str:
    """Return the checks table of docs/fleet.md, one row per declared check, in suite order.

    scripts/docs_tables.py writes it into the doc; a test fails when the doc's copy is stale.
    """
    rows = ["| check | fails when | fix | node check |", "|---|---|---|---|"]
    for c in DECLARED:
        fix = f"`--fix={c.fix}`: {c.fix_runs}" if c.fix else ""
        rows.append(
            f"| `{c.name}` | {c.fails_when} | {fix} | {'nightly only' if c.nightly_only else 'yes'} |"
        )
    return "\n".join(rows) + "\n"

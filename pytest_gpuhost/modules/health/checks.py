"""Health verdicts: one host's `health` facts and its thresholds -> one verdict per check.

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

This module is the front: `CHECKS`, `FIXES` and `evaluate`, and the names other modules import.
The parts, by role: `health.thresholds` (the table of inventory variables), `health.verdict`
(`Verdict` and the facts readers), `health.gpu`, `health.fabric`, `health.host` and
`health.counters` (the checks; counters judged against the last run's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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
from pytest_gpuhost.modules.health.mounts import check_mounts
from pytest_gpuhost.modules.health.thresholds import (
    THRESHOLDS,
    Threshold,
    ThresholdError,
    Thresholds,
    probe_params,
)
from pytest_gpuhost.modules.health.verdict import Facts, Verdict

__all__ = [
    "CHECKS",
    "FIXES",
    "THRESHOLDS",
    "Threshold",
    "Thresholds",
    "ThresholdError",
    "Verdict",
    "evaluate",
    "probe_params",
    "throttle_reason_names",
]

#: The checks, in the order the suite runs them.
CHECKS: tuple[str, ...] = (
    "gpu_count",
    "driver_version",
    "cuda_version",
    "persistence_mode",
    "ecc",
    "retired_pages",
    "remapped_rows",
    "xid",
    "sxid",
    "pcie_link",
    "pcie_aer",
    "nvlink",
    "fabric",
    "infiniband",
    "iommu_group_type",
    "acs",
    "p2p",
    "throttle",
    "clock_events",
    "temperature",
    "memory_temperature",
    "disk_free",
    "mounts",
    "service",
    "service_health",
    "diag",
)

#: Safe fixes `--fix=NAME` offers, and the check each repairs.
FIXES: Mapping[str, str] = {"persistence": "persistence_mode", "service": "service"}


_CHECK_FUNCS: dict[str, Callable[..., Verdict]] = {
    "gpu_count": check_gpu_count,
    "driver_version": check_driver_version,
    "cuda_version": check_cuda_version,
    "persistence_mode": check_persistence_mode,
    "ecc": check_ecc,
    "retired_pages": check_retired_pages,
    "remapped_rows": check_remapped_rows,
    "xid": check_xid,
    "sxid": check_sxid,
    "pcie_link": check_pcie_link,
    "pcie_aer": check_pcie_aer,
    "nvlink": check_nvlink,
    "fabric": check_fabric,
    "infiniband": check_infiniband,
    "iommu_group_type": check_iommu_group_type,
    "acs": check_acs,
    "p2p": check_p2p,
    "throttle": check_throttle,
    "clock_events": check_clock_events,
    "temperature": check_temperature,
    "memory_temperature": check_memory_temperature,
    "disk_free": check_disk_free,
    "mounts": check_mounts,
    "service": check_service,
    "service_health": check_service_health,
    "diag": check_diag,
}
_SAMPLED = {"temperature", "disk_free"}


def evaluate(check: str, facts: Facts, t: Thresholds, samples: Sequence[Facts] | None = None) -> Verdict:
    """Judge one check from a host's facts; pass `samples` after a `reread` was asked for."""
    fn = _CHECK_FUNCS.get(check)
    if fn is None:
        raise KeyError(f"unknown health check {check!r}; known: {', '.join(CHECKS)}")
    if check in _SAMPLED:
        return fn(facts, t, samples)
    return fn(facts, t)

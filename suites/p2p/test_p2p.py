"""Restore GPU peer-to-peer DMA on a host whose IOMMU blocks it, safely, in nine ordered steps.

    pytest suites/p2p --host=ssh://root@gpu-host --container=pct:101 [--check-only]

On a host that is already healthy every step passes and the service is never touched.
"""

from __future__ import annotations

import pytest

from .collective import step_p2p_collective
from .prepare import step_gpus_released, step_iommu_groups_identity, step_plan, step_service_stopped
from .procedure import P2PProcedure
from .restore import step_drivers_bound, step_p2p_bandwidth, step_persisted, step_service_restored

pytestmark = pytest.mark.gpuhost_procedure


def test_plan(p2p: P2PProcedure, remediate) -> None:
    """Facts in one round trip; GPUs in scope (never vfio-pci); lock and journal when a repair is due."""
    plan = p2p.gather()
    if plan.errors:
        pytest.fail("refusing to act: " + "; ".join(plan.errors), pytrace=False)
    remediate(step_plan(p2p))


def test_service_stopped(p2p: P2PProcedure, remediate) -> None:
    """The service holding the GPUs is stopped within --stop-timeout (+ SIGTERM, SIGKILL), if a repair is due."""
    remediate(step_service_stopped(p2p))


def test_gpus_released(p2p: P2PProcedure, remediate) -> None:
    """No process holds the GPUs; nvidia-persistenced stopped; legacy persistence off."""
    remediate(step_gpus_released(p2p))


def test_iommu_groups_identity(p2p: P2PProcedure, remediate) -> None:
    """Every in-scope IOMMU group is identity: functions unbound (watched), type written and read back."""
    remediate(step_iommu_groups_identity(p2p))


def test_drivers_bound(p2p: P2PProcedure, remediate) -> None:
    """Functions rebound in the original order; /dev/nvidiaN unchanged; nvidia-smi sees every GPU."""
    remediate(step_drivers_bound(p2p))


def test_p2p_bandwidth(p2p: P2PProcedure, remediate) -> None:
    """Every in-scope pair reaches its P2P threshold (heatmaps before and after in the report)."""
    remediate(step_p2p_bandwidth(p2p))


def test_p2p_collective(p2p: P2PProcedure, remediate) -> None:
    """An NCCL all_reduce on the in-scope GPUs completes in bound, via P2P, with 0 wrong, faster than without P2P."""
    remediate(step_p2p_collective(p2p))


def test_persisted(p2p: P2PProcedure, remediate) -> None:
    """A boot-time unit puts exactly these groups in identity before the GPUs' users start."""
    remediate(step_persisted(p2p))


def test_service_restored(p2p: P2PProcedure, remediate) -> None:
    """The service this run stopped runs again, /health answers, NCCL goes via P2P."""
    remediate(step_service_restored(p2p))

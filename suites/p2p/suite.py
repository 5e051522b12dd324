"""suites/p2p declared: its options, its procedure, its nine steps in order, its refusals and verdict.

The tests of test_p2p.py are made from `STEPS` (run/suite.py); a step is added here, with the
function that builds its `Remediation` (prepare.py, restore.py, collective.py).
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.run.suite import StepSpec, Suite

from . import answer
from .collective import step_p2p_collective
from .options import P2POptions, per_target
from .prepare import step_gpus_released, step_iommu_groups_identity, step_plan, step_service_stopped
from .procedure import P2PProcedure
from .restore import step_drivers_bound, step_p2p_bandwidth, step_persisted, step_service_restored

__all__ = ["STEPS", "SUITE"]

Step = StepSpec[P2PProcedure]

STEPS: tuple[Step, ...] = (
    Step(
        "plan",
        "Facts in one round trip; GPUs in scope (never vfio-pci); lock and journal when a repair is due.",
        step_plan,
        first=True,
    ),
    Step(
        "service stopped",
        "The service holding the GPUs is stopped within --stop-timeout (+ SIGTERM, SIGKILL), if a repair is due.",
        step_service_stopped,
    ),
    Step(
        "gpus released",
        "No process holds the GPUs; nvidia-persistenced stopped; legacy persistence off.",
        step_gpus_released,
    ),
    Step(
        "iommu groups identity",
        "Every in-scope IOMMU group is identity: functions unbound (watched), type written and read back.",
        step_iommu_groups_identity,
    ),
    Step(
        "drivers bound",
        "Functions rebound in the original order; /dev/nvidiaN unchanged; nvidia-smi sees every GPU.",
        step_drivers_bound,
    ),
    Step(
        "p2p bandwidth",
        "Every in-scope pair reaches its P2P threshold (heatmaps before and after in the report).",
        step_p2p_bandwidth,
    ),
    Step(
        "p2p collective",
        "An NCCL all_reduce on the in-scope GPUs completes in bound, via P2P, with 0 wrong, faster than "
        "without P2P.",
        step_p2p_collective,
    ),
    Step(
        "persisted",
        "A boot-time unit puts exactly these groups in identity before the GPUs' users start.",
        step_persisted,
    ),
    Step(
        "service restored",
        "The service this run stopped runs again, /health answers, NCCL goes via P2P.",
        step_service_restored,
    ),
)


def _procedure(target: Any, opts: P2POptions, check_only: bool, config: Any) -> P2PProcedure:
    return P2PProcedure(target, opts, check_only=check_only)


def _refusals(proc: P2PProcedure) -> list[str]:
    """What step 1's read finds the kernel or the host would refuse, before anything is stopped."""
    return list(proc.gather().errors)


SUITE: Suite[P2POptions, P2PProcedure] = Suite(
    name="p2p",
    options=P2POptions,
    procedure=_procedure,
    steps=STEPS,
    per_target=per_target,
    refusals=_refusals,
    verdict=answer.headline,
)

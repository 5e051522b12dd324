"""suites/accept declared: its options, its procedure, its six steps in order, its preconditions.

The tests of test_accept.py are made from `STEPS` (run/suite.py). Every step is a check and runs
whatever the others found (`blocking=False`); the last, the verdict (verdict.py), always runs and
says "ACCEPT" or "REJECT: ..." with the promised-vs-found table. The preconditions are checked
at configure, before any node is reached: the order file given and valid against its schema
(order.py), every problem one line, all listed at once in one usage error (exit 4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.run.suite import Configured, StepSpec, Suite

from .options import AcceptOptions, settle
from .procedure import AcceptProcedure
from .steps import step_data_volume, step_gpus, step_health, step_interconnect, step_s3
from .verdict import step_verdict

__all__ = ["STEPS", "SUITE"]

Step = StepSpec[AcceptProcedure]

STEPS: tuple[Step, ...] = (
    Step("gpus", "The GPUs and driver the order promised: model, count, memory, driver and CUDA.", step_gpus),
    Step("health", "Every health check passes, judged from one facts request.", step_health),
    Step(
        "interconnect",
        "P2P bandwidth per GPU pair meets its link's expectation; NCCL all-reduce works.",
        step_interconnect,
    ),
    Step(
        "data_volume", "The data volume has the free space and write throughput promised.", step_data_volume
    ),
    Step("s3", "The order's S3 bucket answers with the credentials given (nothing written).", step_s3),
    Step(
        "verdict", "ACCEPT, or REJECT naming every promise the node does not keep.", step_verdict, final=True
    ),
)

NO_ORDER = "no order: pass --order=PATH, what the provider promised (docs/accept.md, 'The order file')"


def _procedure(target: Any, opts: AcceptOptions, check_only: bool, config: pytest.Config) -> AcceptProcedure:
    """The acceptance of a target against the order `settle` read (every step errors without one)."""
    if opts.loaded is None:
        why = opts.order_problems[0] if opts.order_problems else NO_ORDER
        pytest.fail(f"gpuhost: {why}", pytrace=False)
    root = Path(config.invocation_params.dir)
    return AcceptProcedure(target, opts.loaded, opts, check_only=check_only, root=root)


def _preconditions(ctx: Configured[AcceptOptions]) -> list[str]:
    """Every reason the run cannot start, one line each: no order, or each of its problems."""
    if not ctx.targets or ctx.config.option.collectonly or not SUITE.in_run(ctx.config):
        return []  # no target: nothing runs; --co touches nothing; another suite's run needs no order
    if not ctx.options.order:
        return [NO_ORDER]
    return list(ctx.options.order_problems)


SUITE: Suite[AcceptOptions, AcceptProcedure] = Suite(
    name="accept",
    options=AcceptOptions,
    procedure=_procedure,
    steps=STEPS,
    settle=settle,
    preconditions=_preconditions,
    blocking=False,
)

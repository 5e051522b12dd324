"""Fixtures of suites/accept: the preconditions, the acceptance of the current target, its steps.

`preconditions` runs once per run, on the controller, before any node is reached: the order
file given and valid against its schema (suites/accept/order.py). Each problem is one line and
all are listed at once; pytest exits 4 (usage error) and nothing has connected to a node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run.remediation import Remediation, WouldFix
from pytest_gpuhost.run.targets_stash import targets_key

from . import options
from .order import Order, OrderError, load_order
from .procedure import AcceptProcedure, Observation

_ORDER = pytest.StashKey[Order]()


def preconditions(config: pytest.Config) -> list[str]:
    """Every reason the run cannot start, one line each; the order is stashed when it loads."""
    opts = options.options(config)
    if not opts.order:
        return ["no order: pass --order=PATH, what the provider promised (docs/accept.md, 'The order file')"]
    try:
        config.stash[_ORDER] = load_order(opts.order)
    except OrderError as exc:
        return [printable(p) for p in exc.problems]
    return []


@pytest.hookimpl(trylast=True)  # after the plugin's configure has loaded the run's targets
def pytest_configure(config: pytest.Config) -> None:
    """Refuse, as one usage error before any test runs, an order that is missing or invalid."""
    if not config.stash.get(targets_key, []) or config.option.collectonly:
        return  # no target: nothing runs; --co touches nothing
    problems = preconditions(config)
    if problems:
        raise pytest.UsageError(*(f"gpuhost: {p}" for p in problems))


@pytest.fixture(scope="module")
def accept(target: Any, check_only: bool, pytestconfig: pytest.Config) -> Iterator[AcceptProcedure]:
    """The AcceptProcedure of the current target (module scope: shared by every step)."""
    order = pytestconfig.stash.get(_ORDER, None)
    if order is None:  # an xdist worker: the controller checked it, read it here once
        try:
            order = load_order(str(options.options(pytestconfig).order))
        except OrderError as exc:
            pytest.fail("gpuhost: " + printable(exc.problems[0]), pytrace=False)
    root = Path(pytestconfig.invocation_params.dir)
    yield AcceptProcedure(target, order, options.options(pytestconfig), check_only=check_only, root=root)


@pytest.fixture
def step(accept: AcceptProcedure, remediate: Any) -> Any:
    """Run one step through `remediate` and remember its outcome for the verdict."""

    def run(rem: Remediation) -> Any:
        name = rem.name
        try:
            out = remediate(rem)
        except pytest.skip.Exception:
            seen = rem.seen if isinstance(rem, Observation) else None
            if seen is not None and seen.cannot_see:  # nothing proved: the verdict cannot accept
                accept.outcomes[name] = "cannot see"
                accept.summaries.setdefault(name, seen.cannot_see)
            else:
                accept.outcomes[name] = "skipped"
            raise
        except WouldFix:
            accept.outcomes[name] = "would fix"
            raise
        except BaseException as exc:
            accept.outcomes[name] = "failed"
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            accept.summaries.setdefault(name, printable(redact(first))[:300])
            raise
        accept.outcomes[name] = out.outcome
        return out

    return run

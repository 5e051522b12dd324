"""Fixtures of suites/p2p: one procedure object per target, finished at the end of the module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pytest_gpuhost.run import evidence

from . import answer, options
from .procedure import P2PProcedure


@pytest.fixture(scope="module")
def p2p(target: Any, check_only: bool, pytestconfig: pytest.Config) -> Iterator[P2PProcedure]:
    """The P2P procedure for this target; its teardown never leaves a GPU without its driver."""
    proc = P2PProcedure(
        target, options.options(pytestconfig, getattr(target, "vars", None)), check_only=check_only
    )
    yield proc
    problems = proc.finish()
    said = answer.headline(proc)
    if said is not None:
        ok, line, details = said
        evidence.current().answer(proc.conn.name, ok and not problems, line, [*problems, *details])

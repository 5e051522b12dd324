"""Acceptance of a rented GPU node before a job starts: is it what the order promised?

    pytest suites/accept --host=ssh://root@NODE --order=order.yaml [--check-only]

The tests are made here from the steps' declaration (`STEPS` in suites/accept/steps.py), one
`test_NAME` each, in their order, with the declaration's one line as the docstring; a step is
added there, not here (docs/adding-a-suite.md). Every step only reads, except the data volume's
scratch file (written, fsync'd, read back, removed; not even that under --check-only), and
every step runs whatever the others found: the last, the verdict, says "ACCEPT" or "REJECT:
..." naming every promise not kept (docs/accept.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .procedure import StepFactory
from .steps import STEPS

Step = Callable[[Any], Any]


def _test_of(name: str, holds: str, factory: StepFactory) -> Callable[..., None]:
    """Return the suite's test of one declared step: it runs that step on the target."""

    def test(accept: Any, step: Step) -> None:
        step(factory(accept))

    test.__name__ = test.__qualname__ = f"test_{name}"
    test.__doc__ = holds
    return test


for _name, _holds, _factory in STEPS:
    globals()[f"test_{_name}"] = _test_of(_name, _holds, _factory)
del _name, _holds, _factory

"""Options of every suite, registered whichever suite (or all of them) pytest is pointed at.

The suites are those of the `gpuhost.suites` entry points (pyproject.toml), read in one place:
`pytest_gpuhost.run.suite.registered`. Each is a `Suite` (run/suite.py).
"""

from __future__ import annotations

import pytest

from pytest_gpuhost.run.suite import registered

_SUITES = registered(__package__ or "suites")


def pytest_addoption(parser: pytest.Parser) -> None:
    for suite in _SUITES:
        suite.addoption(parser)


@pytest.hookimpl(trylast=True)  # after the plugin's configure has loaded the run's targets
def pytest_configure(config: pytest.Config) -> None:
    # Every value is read and checked before collection, so a typo fails the run at once, not at
    # step 5; then each suite's preconditions, before any target is reached.
    for suite in _SUITES:
        suite.configure(config)
    for suite in _SUITES:
        suite.check(config)

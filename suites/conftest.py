"""Options of every suite, registered whichever suite (or all of them) pytest is pointed at."""

from __future__ import annotations

import pytest

from .accept import options as accept_options
from .decommission import options as decommission_options
from .health import options as health_options
from .p2p import options as p2p_options

_SUITES = (p2p_options, decommission_options, health_options, accept_options)


def pytest_addoption(parser: pytest.Parser) -> None:
    for suite in _SUITES:
        suite.addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    # Every value is checked before collection, so a typo fails the run at once, not at step 5.
    for suite in _SUITES:
        suite.validate(config)

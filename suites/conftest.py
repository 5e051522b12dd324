"""Options of every suite, registered whichever suite (or all of them) pytest is pointed at.

The suites are those of the `gpuhost.suites` entry points (pyproject.toml), read in one place:
`pytest_gpuhost.run.suite.registered`. Each suite's values are read at configure before the
plugin's own configure, as a typo must fail the run at once, not at step 5; its preconditions
are checked last in configure (`_Checks`), once the plugin has loaded the run's targets and
before any target is reached.
"""

from __future__ import annotations

import pytest

from pytest_gpuhost.run.suite import registered

_SUITES = registered(__package__ or "suites")


class _Checks:
    """The suites' settle and preconditions, after every other configure (the targets are loaded)."""

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        for suite in _SUITES:
            suite.check(config)


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    for suite in _SUITES:
        suite.addoption(parser)
    if not pluginmanager.has_plugin("gpuhost-suites-checks"):
        pluginmanager.register(_Checks(), "gpuhost-suites-checks")


def pytest_configure(config: pytest.Config) -> None:
    for suite in _SUITES:
        suite.configure(config)

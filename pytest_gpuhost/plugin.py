"""pytest plugin entry point: wires options, fixtures and hooks; knows nothing itself.

Options: `run/settings.py` (the table) and `run/options.py` (the reader). The run's targets and
their pool: `run/targets_stash.py`. Fixtures: `run/fixtures.py`. The engine: `run/remediation.py`;
evidence: `run/evidence.py`; xdist scheduling: `run/scheduling.py`; hook specs: `hookspec.py`;
outputs: `report/`.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost import hookspec, redact
from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.report import answer
from pytest_gpuhost.report import html as html_report
from pytest_gpuhost.report.outputs import configure_outputs
from pytest_gpuhost.run import (
    evidence,
    fixtures,
    outcome_terminal,
    remediation,
    settings,
    targets_stash,
    unreachable,
)
from pytest_gpuhost.run.settings import Settings, settings_key
from pytest_gpuhost.run.targets_stash import (
    NO_TARGET_REASON,
    Target,
    get_pool,
    get_target,
    pool_key,
    targets_key,
)

pytest_plugins = ["pytest_gpuhost.run.scheduling", "pytest_gpuhost.run.limit", "pytest_gpuhost.report.fleet"]

# Re-exported: suites and older conftests import these from here.
__all__ = [
    "NO_TARGET_REASON",
    "Settings",
    "Target",
    "get_pool",
    "get_target",
    "pool_key",
    "settings_key",
    "targets_key",
]

_MARKERS = (
    "gpuhost_procedure: the module is an ordered procedure per target; "
    "a failed step skips the later ones for that target",
    "gpuhost_final: a procedure's verdict step; it runs even after a failed step, to list what is missing",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser) -> None:
    settings.add_sudo_if_missing(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspec)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # tryfirst: the report paths must be set before pytest-html and junitxml read them.
    s = settings.read_settings(config)
    config.stash[settings_key] = s
    for line in _MARKERS:
        config.addinivalue_line("markers", line)
    evidence.reset_session()
    redact.remember_env(os.environ)  # an operator's own AWS_SECRET_ACCESS_KEY never reaches a report
    controller = not hasattr(config, "workerinput")
    if controller:
        config.pluginmanager.register(html_report.HtmlCustomisation(config), "gpuhost-html")
    settings.publish(config, s)
    if s.hosts or s.inventory:
        config.stash[targets_key] = targets_stash.load_targets(config, s)
    else:
        config.stash[targets_key] = []
        config.hook.pytest_gpuhost_targets(config=config, targets=config.stash[targets_key])
    # Through the plugin manager: importing scheduling here would keep pytest from rewriting it.
    scheduling = config.pluginmanager.get_plugin("pytest_gpuhost.run.scheduling")
    if scheduling is not None:
        scheduling.fit_workers(config, len(config.stash[targets_key]))
    # Reports only for runs that check targets: never for --co, nor an unrelated test run.
    if (
        s.report_dir is not None
        and controller
        and config.stash[targets_key]
        and not config.option.collectonly
    ):
        s.report_name = s.report_name or settings.default_report_name(config)
        configure_outputs(config, Path(s.report_dir), s.report_name)
        settings.publish(config, s)  # the report name, for xdist workers
    # Registered now, after every entry-point plugin (testinfra included), so that our `host`
    # fixture is the one tests get, whichever order pytest loaded the plugins in.
    if not config.pluginmanager.has_plugin("gpuhost-fixtures"):
        config.pluginmanager.register(fixtures, "gpuhost-fixtures")
    # evidence.py holds the per-phase wrappers; registered here rather than in pytest_plugins,
    # which would ask for an assertion rewrite of a module this one already imported.
    if not config.pluginmanager.has_plugin("gpuhost-evidence"):
        config.pluginmanager.register(evidence, "gpuhost-evidence")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    targets_stash.close_pool(session.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    targets_stash.close_pool(config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    targets_stash.parametrize_targets(metafunc)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # trylast: after -k/-m deselection, so a run that deselected every target test is not refused.
    targets_stash.require_targets(config, items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    targets_stash.require_targets_xdist(node.config, ids)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before fixtures, like skip marks: a blocked procedure step does not touch its host.
    remediation.check_blocked(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    remediation.annotate_report(item, call, report)
    unreachable.mark(item, call, report)
    if call.excinfo is not None and isinstance(call.excinfo.value, GpuhostError):
        report.longrepr = redact.printable(f"{type(call.excinfo.value).__name__}: {call.excinfo.value}")
    evidence.attach(item, report)
    hint = targets_stash.sudo_hint(item, report, call.excinfo.value if call.excinfo else None)
    if hint:
        report.sections.append(("gpuhost hint", hint))
    # HTML for pytest-html only where an HTML report may be written (workers see --report-dir, not
    # the path the controller derives from it): with --report-dir=none and no --html it is never shown
    if settings.read(item.config).report_dir is not None or getattr(item.config.option, "htmlpath", None):
        html_report.add_extras(report)
    return report


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> Any:
    return unreachable.teststatus(report) or outcome_terminal.report_teststatus(report)


@pytest.hookimpl(trylast=True)  # last: the answer in words ends the output, above pytest's counts
def pytest_terminal_summary(terminalreporter: Any) -> None:
    outcome_terminal.terminal_summary(terminalreporter)
    answer.terminal_summary(terminalreporter)

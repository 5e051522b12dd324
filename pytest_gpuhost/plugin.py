"""pytest plugin entry point: hook wiring, the run's targets and their pool.

Thin glue: options live in `settings.py`, fixtures in `fixtures.py`, target URLs and
connections in `targets.py`, the engine in `remediation.py`, evidence in `evidence.py`, the
HTML customisation in `report.py`, hook specs in `hookspec.py`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost import redact
from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.report import html as html_report
from pytest_gpuhost.run import evidence, remediation, settings
from pytest_gpuhost.run.settings import Settings, settings_key

pytest_plugins = ["pytest_gpuhost.run.scheduling", "pytest_gpuhost.report.fleet"]

__all__ = ["Settings", "Target", "get_pool", "get_target", "pool_key", "settings_key", "targets_key"]

NO_TARGET_REASON = (
    "no target: pass --host=URL (e.g. --host=local:// or --host=ssh://root@gpu-host) or --inventory=FILE"
)


targets_key = pytest.StashKey[list[Any]]()
pool_key = pytest.StashKey[Any]()
_target_objects_key = pytest.StashKey[dict[str, Any]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser) -> None:
    settings.add_sudo_if_missing(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_gpuhost import hookspec

    pluginmanager.add_hookspecs(hookspec)


def _load_targets(config: pytest.Config, s: Settings) -> list[Any]:
    # `from package.module import name` (not `from package import module`): pytester's inline
    # runs drop modules from sys.modules between runs, and the package attribute would go stale.
    from pytest_gpuhost.exec.targets import parse_container, parse_host_url

    specs: list[Any] = []
    for url in s.hosts:
        try:
            specs.append(parse_host_url(url))
        except GpuhostError as exc:
            raise pytest.UsageError(f"gpuhost: bad value {url!r} for --host: {exc}") from None
    if s.inventory:
        from pytest_gpuhost.exec.inventory import load_inventory

        try:
            specs.extend(load_inventory(s.inventory))
        except GpuhostError as exc:
            raise pytest.UsageError(f"gpuhost: bad inventory {s.inventory!r} (--inventory): {exc}") from None
    if s.container:
        try:
            container = parse_container(s.container)
        except GpuhostError as exc:
            raise pytest.UsageError(f"gpuhost: bad value {s.container!r} for --container: {exc}") from None
        for spec in specs:
            if getattr(spec, "container", None) is None:
                spec.container = container
    config.hook.pytest_gpuhost_targets(config=config, targets=specs)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise pytest.UsageError(f"gpuhost: target {spec.name!r} is given twice (--host / --inventory)")
        seen.add(spec.name)
    return specs


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # tryfirst: the report paths must be set before pytest-html and junitxml read them.
    s = settings.read_settings(config)
    config.stash[settings_key] = s
    config.addinivalue_line(
        "markers",
        "gpuhost_procedure: the module is an ordered procedure per target; "
        "a failed step skips the later ones for that target",
    )
    config.addinivalue_line(
        "markers",
        "gpuhost_final: a procedure's verdict step; it runs even after a failed step, "
        "to list what is missing",
    )
    evidence.reset_session()
    redact.remember_env(os.environ)  # an operator's own AWS_SECRET_ACCESS_KEY never reaches a report
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(html_report.HtmlCustomisation(), "gpuhost-html")
    if s.report_dir is not None and not hasattr(config, "workerinput"):
        s.report_name = s.report_name or settings.default_report_name(config)
        html_report.configure_outputs(config, Path(s.report_dir), s.report_name)
    settings.publish(config, s)
    if s.hosts or s.inventory:
        config.stash[targets_key] = _load_targets(config, s)
    else:
        config.stash[targets_key] = []
        config.hook.pytest_gpuhost_targets(config=config, targets=config.stash[targets_key])
    # Registered now, after every entry-point plugin (testinfra included), so that our `host`
    # fixture is the one tests get, whichever order pytest loaded the plugins in.
    if not config.pluginmanager.has_plugin("gpuhost-fixtures"):
        config.pluginmanager.register(
            importlib.import_module("pytest_gpuhost.run.fixtures"), "gpuhost-fixtures"
        )
    # evidence.py holds the per-phase wrappers; registered here rather than in pytest_plugins,
    # which would ask for an assertion rewrite of a module this one already imported.
    if not config.pluginmanager.has_plugin("gpuhost-evidence"):
        config.pluginmanager.register(evidence, "gpuhost-evidence")


def _close_pool(config: pytest.Config) -> None:
    pool = config.stash.get(pool_key, None)
    if pool is not None:
        del config.stash[pool_key]
        config.stash[_target_objects_key] = {}
        pool.close_all()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    _close_pool(session.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    _close_pool(config)


class Target:
    """One machine or container of the run: its spec, its connection (opened on first use), its vars."""

    def __init__(self, spec: Any, pool: Any, config: pytest.Config | None = None) -> None:
        self.spec = spec
        self.name: str = spec.name
        self.vars: dict[str, Any] = dict(getattr(spec, "vars", {}) or {})
        self._pool = pool
        self._config = config

    def _hooked(self, conn: Any) -> Any:
        # The connection calls pytest_gpuhost_command on this config for every command.
        if conn is not None and getattr(conn, "config", None) is None:
            conn.config = self._config
        return conn

    @property
    def conn(self) -> Any:
        """The target's Connection (its agent is started on first use)."""
        return self._hooked(self._pool.get(self.spec))

    @property
    def container_conn(self) -> Any:
        """The Connection into the target's container, or None when it has none."""
        if getattr(self.spec, "container", None) is None:
            return None
        return self._hooked(self._pool.container(self.spec))

    def __repr__(self) -> str:
        return f"<Target {self.name}>"


def get_pool(config: pytest.Config) -> Any:
    """Return the run's TargetPool, made on first use (connections open lazily)."""
    pool = config.stash.get(pool_key, None)
    if pool is None:
        from pytest_gpuhost.exec.targets import TargetOptions, TargetPool

        s = config.stash[settings_key]
        pool = TargetPool(
            TargetOptions(
                command_timeout=s.command_timeout,
                connect_timeout=s.connect_timeout,
                identity=s.ssh_identity,
                known_hosts=s.known_hosts,
                host_key_policy=s.host_key_policy,
                sudo=s.sudo,
            )
        )
        config.stash[pool_key] = pool
    return pool


def get_target(config: pytest.Config, name: str) -> Target:
    """Return the Target called `name` (one object per name and run)."""
    cache = config.stash.setdefault(_target_objects_key, {})
    if name not in cache:
        spec = next(s for s in config.stash[targets_key] if s.name == name)
        cache[name] = Target(spec, get_pool(config), config)
    return cache[name]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if remediation.TARGET_PARAM not in metafunc.fixturenames:
        return
    names = [spec.name for spec in metafunc.config.stash.get(targets_key, [])]
    if names:
        metafunc.parametrize(remediation.TARGET_PARAM, names, ids=names, indirect=True, scope="module")
    else:
        params = [pytest.param(None, id="no-target", marks=pytest.mark.skip(reason=NO_TARGET_REASON))]
        metafunc.parametrize(remediation.TARGET_PARAM, params, indirect=True, scope="module")


# --- test phases: evidence, procedures, outcomes ---------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before fixtures, like skip marks: a blocked procedure step does not touch its host.
    remediation.check_blocked(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    remediation.annotate_report(item, call, report)
    if call.excinfo is not None and isinstance(call.excinfo.value, GpuhostError):
        report.longrepr = f"{type(call.excinfo.value).__name__}: {call.excinfo.value}"
    evidence.attach(item, report)
    html_report.add_extras(report)
    return report


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> Any:
    return remediation.report_teststatus(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    remediation.terminal_summary(terminalreporter)

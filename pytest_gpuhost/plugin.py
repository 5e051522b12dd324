"""pytest plugin entry point: options, fixtures and hook wiring.

Thin glue: targets live in `targets.py`, the engine in `remediation.py`, evidence in
`evidence.py`, the HTML customisation in `report.py`.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Generator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost import evidence, redact, remediation
from pytest_gpuhost import report as html_report
from pytest_gpuhost.errors import GpuhostError

pytest_plugins = ["pytest_gpuhost.scheduling", "pytest_gpuhost.fleet"]

__all__ = ["Settings", "Target", "get_pool", "get_target", "pool_key", "settings_key", "targets_key"]

GROUP = "gpuhost"
TARGET_FIXTURES = ("target", "host", "container", "gpus")
NO_TARGET_REASON = (
    "no target: pass --host=URL (e.g. --host=local:// or --host=ssh://root@gpu-host) or --inventory=FILE"
)


@dataclass
class Settings:
    """The validated gpuhost options of one run."""

    hosts: list[str] = field(default_factory=list)
    container: str | None = None
    inventory: str | None = None
    check_only: bool = False
    command_timeout: float = 60.0
    connect_timeout: float = 10.0
    ssh_identity: str | None = None
    known_hosts: str | None = None
    host_key_policy: str = "strict"
    sudo: bool = False
    report_dir: str | None = "reports"
    report_name: str = ""


settings_key = pytest.StashKey[Settings]()
targets_key = pytest.StashKey[list[Any]]()
pool_key = pytest.StashKey[Any]()
_target_objects_key = pytest.StashKey[dict[str, Any]]()


@dataclass(frozen=True)
class _Opt:
    flag: str
    dest: str
    ini: str
    help: str
    kind: str = "str"  # str | list | bool | float | choice
    default: Any = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None


_OPTS = (
    _Opt(
        "--host",
        "gpuhost_hosts",
        "gpuhost_hosts",
        "target URL: ssh://user@host:port, local://, or a testinfra scheme; repeat for several targets",
        "list",
        [],
        metavar="URL",
    ),
    _Opt(
        "--container",
        "gpuhost_container",
        "gpuhost_container",
        "container that holds the service: pct:ID, lxc:NAME, docker:NAME or ssh://...",
        metavar="SPEC",
    ),
    _Opt(
        "--inventory",
        "gpuhost_inventory",
        "gpuhost_inventory",
        "inventory of targets (YAML or Ansible INI) with per-host variables",
        metavar="FILE",
    ),
    _Opt(
        "--check-only",
        "gpuhost_check_only",
        "gpuhost_check_only",
        "check and plan, never change a target: failing checks report 'would fix' with the exact actions",
        "bool",
        False,
    ),
    _Opt(
        "--command-timeout",
        "gpuhost_command_timeout",
        "gpuhost_command_timeout",
        "default timeout of every command on a target, seconds (default 60)",
        "float",
        60.0,
        metavar="S",
    ),
    _Opt(
        "--connect-timeout",
        "gpuhost_connect_timeout",
        "gpuhost_connect_timeout",
        "timeout to reach a target and start its agent, seconds (default 10)",
        "float",
        10.0,
        metavar="S",
    ),
    _Opt(
        "--ssh-identity",
        "gpuhost_ssh_identity",
        "gpuhost_ssh_identity",
        "SSH private key file",
        metavar="FILE",
    ),
    _Opt(
        "--known-hosts",
        "gpuhost_known_hosts",
        "gpuhost_known_hosts",
        "known_hosts file used to check host keys (default ~/.ssh/known_hosts)",
        metavar="FILE",
    ),
    _Opt(
        "--host-key-policy",
        "gpuhost_host_key_policy",
        "gpuhost_host_key_policy",
        "unknown host keys: strict refuses them (default), accept-new records them in --known-hosts",
        "choice",
        "strict",
        ("strict", "accept-new"),
    ),
    _Opt(
        "--sudo",
        "sudo",
        "gpuhost_sudo",
        "run commands on targets through sudo (shared with testinfra's --sudo)",
        "bool",
        False,
    ),
    _Opt(
        "--report-dir",
        "gpuhost_report_dir",
        "gpuhost_report_dir",
        "directory for the HTML, JSON and JUnit reports (default reports; 'none' writes none)",
        "str",
        "reports",
        metavar="DIR",
    ),
    _Opt(
        "--report-name",
        "gpuhost_report_name",
        "gpuhost_report_name",
        "base name of the report files (default: the suite or test path and a UTC timestamp)",
        metavar="NAME",
    ),
)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_gpuhost import hookspec

    pluginmanager.add_hookspecs(hookspec)


def _add(group: pytest.OptionGroup, opt: _Opt) -> None:
    if opt.kind == "bool":
        group.addoption(opt.flag, action="store_true", dest=opt.dest, default=None, help=opt.help)
    elif opt.kind == "list":
        group.addoption(
            opt.flag, action="append", dest=opt.dest, default=None, metavar=opt.metavar, help=opt.help
        )
    else:
        group.addoption(
            opt.flag, action="store", dest=opt.dest, default=None, metavar=opt.metavar, help=opt.help
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(GROUP, "gpuhost: verify and repair GPU hosts")
    for opt in _OPTS:
        if opt.flag != "--sudo":  # added in pytest_load_initial_conftests, see there
            _add(group, opt)
        if opt.kind == "list":
            parser.addini(opt.ini, type="linelist", default=None, help=opt.help)
        else:
            parser.addini(opt.ini, type="string", default=None, help=opt.help)


def _has_option(parser: pytest.Parser, flag: str) -> bool:
    # pytest has no public lookup; the groups are where addoption puts options.
    groups = [*parser._groups, parser._anonymous]
    return any(flag in opt.names() for group in groups for opt in group.options)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser) -> None:
    # testinfra defines --sudo too, and argparse refuses a second one. Every entry-point plugin
    # is loaded by now, so add ours only when nobody did; both mean "run through sudo".
    if not _has_option(parser, "--sudo"):
        _add(parser.getgroup(GROUP), next(o for o in _OPTS if o.flag == "--sudo"))


class _Bad(Exception):
    pass


def _parse(opt: _Opt, raw: Any) -> Any:
    if opt.kind == "list":
        return [str(v) for v in raw]
    if opt.kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise _Bad("expected true or false")
    if opt.kind == "float":
        try:
            value = float(raw)
        except ValueError:
            raise _Bad("expected a number of seconds") from None
        if not value > 0 or value == float("inf"):
            raise _Bad("expected a number of seconds greater than 0")
        return value
    if opt.kind == "choice":
        if raw not in opt.choices:
            raise _Bad("expected one of " + ", ".join(opt.choices))
        return raw
    return str(raw)


def _read(config: pytest.Config, opt: _Opt) -> tuple[Any, str]:
    """Return an option's raw value and where it came from (command line, ini file, default)."""
    cli = config.getoption(opt.dest, default=None)
    if cli is not None and cli is not False:
        return cli, f"command line {opt.flag}"
    ini = config.getini(opt.ini)
    if ini not in (None, [], ""):
        return ini, f"ini option {opt.ini} in {config.inipath}"
    return opt.default, "default"


def _usage(opt: _Opt, raw: Any, source: str, why: str) -> pytest.UsageError:
    return pytest.UsageError(f"gpuhost: bad value {raw!r} for {opt.flag} ({source}): {why}")


def read_settings(config: pytest.Config) -> Settings:
    """Read and validate every gpuhost option; raise UsageError naming the bad value and its source."""
    values: dict[str, Any] = {}
    sources: dict[str, tuple[_Opt, Any, str]] = {}
    for opt in _OPTS:
        raw, source = _read(config, opt)
        sources[opt.flag] = (opt, raw, source)
        if raw is None:
            continue
        try:
            values[opt.flag] = _parse(opt, raw)
        except _Bad as exc:
            raise _usage(opt, raw, source, str(exc)) from None
    s = Settings(
        hosts=values.get("--host", []),
        container=values.get("--container"),
        inventory=values.get("--inventory"),
        check_only=values.get("--check-only", False),
        command_timeout=values.get("--command-timeout", 60.0),
        connect_timeout=values.get("--connect-timeout", 10.0),
        ssh_identity=values.get("--ssh-identity"),
        known_hosts=values.get("--known-hosts"),
        host_key_policy=values.get("--host-key-policy", "strict"),
        sudo=values.get("--sudo", False),
        report_dir=values.get("--report-dir", "reports"),
        report_name=values.get("--report-name") or "",
    )
    for flag in ("--ssh-identity", "--inventory"):
        path = values.get(flag)
        if path is not None and not Path(path).expanduser().is_file():
            opt, raw, source = sources[flag]
            raise _usage(opt, raw, source, "no such file")
    if s.known_hosts is not None:
        kh = Path(s.known_hosts).expanduser()
        opt, raw, source = sources["--known-hosts"]
        if s.host_key_policy == "strict" and not kh.is_file():
            raise _usage(opt, raw, source, "no such file (with --host-key-policy=accept-new it is created)")
        if not kh.parent.is_dir():
            raise _usage(opt, raw, source, f"directory {kh.parent} does not exist")
    if s.report_name and not re.fullmatch(r"[\w.+-]+", s.report_name):
        opt, raw, source = sources["--report-name"]
        raise _usage(opt, raw, source, "use letters, digits and . _ + - only (no directories)")
    if s.report_dir is not None and s.report_dir.strip().lower() in ("", "none"):
        s.report_dir = None
    return s


def default_report_name(config: pytest.Config) -> str:
    """Name a run after what it ran (suite directory or test file) and the UTC time."""
    parts: list[str] = []
    for arg in config.args:
        path = Path(arg.split("::", 1)[0])
        if path.resolve() == config.invocation_params.dir.resolve():
            path = config.rootpath
        stem = path.stem if path.suffix == ".py" else path.name
        stem = stem.removeprefix("test_")
        if stem and stem not in parts:
            parts.append(stem)
    base = re.sub(r"[^\w.+-]+", "_", "+".join(parts[:3]) or "gpuhost")
    return f"{base}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}"


def _load_targets(config: pytest.Config, s: Settings) -> list[Any]:
    # `from package.module import name` (not `from package import module`): pytester's inline
    # runs drop modules from sys.modules between runs, and the package attribute would go stale.
    from pytest_gpuhost.targets import parse_container, parse_host_url

    specs: list[Any] = []
    for url in s.hosts:
        try:
            specs.append(parse_host_url(url))
        except GpuhostError as exc:
            raise pytest.UsageError(f"gpuhost: bad value {url!r} for --host: {exc}") from None
    if s.inventory:
        from pytest_gpuhost.inventory import load_inventory

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
    s = read_settings(config)
    config.stash[settings_key] = s
    config.addinivalue_line(
        "markers",
        "gpuhost_procedure: the module is an ordered procedure per target; "
        "a failed step skips the later ones for that target",
    )
    evidence.reset_session()
    redact.remember_env(os.environ)  # an operator's own AWS_SECRET_ACCESS_KEY never reaches a report
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(html_report.HtmlCustomisation(), "gpuhost-html")
    if s.report_dir is not None and not hasattr(config, "workerinput"):
        s.report_name = s.report_name or default_report_name(config)
        html_report.configure_outputs(config, Path(s.report_dir), s.report_name)
    _publish(config, s)
    if s.hosts or s.inventory:
        config.stash[targets_key] = _load_targets(config, s)
    else:
        config.stash[targets_key] = []
        config.hook.pytest_gpuhost_targets(config=config, targets=config.stash[targets_key])
    # Registered now, after every entry-point plugin (testinfra included), so that our `host`
    # fixture is the one tests get, whichever order pytest loaded the plugins in.
    if not config.pluginmanager.has_plugin("gpuhost-fixtures"):
        config.pluginmanager.register(importlib.import_module("pytest_gpuhost.fixtures"), "gpuhost-fixtures")
    # evidence.py holds the per-phase wrappers; registered here rather than in pytest_plugins,
    # which would ask for an assertion rewrite of a module this one already imported.
    if not config.pluginmanager.has_plugin("gpuhost-evidence"):
        config.pluginmanager.register(evidence, "gpuhost-evidence")


_FIELDS = {
    "--host": "hosts",
    "--container": "container",
    "--inventory": "inventory",
    "--check-only": "check_only",
    "--command-timeout": "command_timeout",
    "--connect-timeout": "connect_timeout",
    "--ssh-identity": "ssh_identity",
    "--known-hosts": "known_hosts",
    "--host-key-policy": "host_key_policy",
    "--sudo": "sudo",
    "--report-name": "report_name",
}


def _publish(config: pytest.Config, s: Settings) -> None:
    """Write the resolved values back, so `config.getoption("gpuhost_check_only")` sees ini values too.

    xdist hands the controller's option values to its workers, so they also get the same
    report name and the same resolved settings.
    """
    for opt in _OPTS:
        field_name = _FIELDS.get(opt.flag)
        if field_name is None:
            continue
        value = getattr(s, field_name)
        if opt.kind == "str" and not value:
            value = None  # "not given", so ini and default lookups still work
        setattr(config.option, opt.dest, value)


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
        from pytest_gpuhost.targets import TargetOptions, TargetPool

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

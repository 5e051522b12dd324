"""The gpuhost options: one table of command-line flags with ini twins, read and validated once.

Every value is validated at configure time; a bad one is a `pytest.UsageError` that names the
value and where it came from (command line, ini file). The resolved values are kept in
`config.stash[settings_key]` and published back on `config.option`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "GROUP",
    "Settings",
    "add_options",
    "add_sudo_if_missing",
    "default_report_name",
    "publish",
    "read_settings",
    "settings_key",
]

GROUP = "gpuhost"


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


def add_options(parser: pytest.Parser) -> None:
    """Register every gpuhost option and its ini twin (all but --sudo, see add_sudo_if_missing)."""
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


def add_sudo_if_missing(parser: pytest.Parser) -> None:
    """Add --sudo unless a plugin (testinfra) already did; both mean "run commands through sudo".

    Called once every entry-point plugin is loaded, because argparse refuses a second --sudo.
    """
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


def publish(config: pytest.Config, s: Settings) -> None:
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

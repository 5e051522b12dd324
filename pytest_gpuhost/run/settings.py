"""The plugin's options: one table of `Option`s (flags with ini twins), read and validated once.

Every value is validated at configure time; a bad one is a `pytest.UsageError` that names the
option, the value, where it came from (command line, ini file) and what to type instead (see
`run/options.py`). The resolved values are kept in `config.stash[settings_key]` (`read` returns
them) and published back on `config.option`.

The options the report layer needs (`--limit`, `--fleet-json`, `--previous`,
`--prometheus-textfile`) are declared here too, so no module below the suites reads a suite's
option. The connection defaults (command and connect timeout, host-key policy) are the
execution layer's `TargetOptions` defaults, written there once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.inventory.ansible import READERS
from pytest_gpuhost.exec.nodename import check_node_name
from pytest_gpuhost.exec.targets import TargetOptions
from pytest_gpuhost.run import testinfra_compat
from pytest_gpuhost.run.options import (
    GROUP,
    BadValue,
    Option,
    Source,
    add_flag,
    choice,
    existing_file,
    existing_path,
    register,
    seconds,
)
from pytest_gpuhost.run.options import read as read_option

__all__ = [
    "CANNOT_SEE_CHOICES",
    "GROUP",
    "OPTIONS",
    "SCHEDULING_CHOICES",
    "SHARED_FLAGS",
    "Settings",
    "add_options",
    "add_sudo_if_missing",
    "default_report_name",
    "publish",
    "read",
    "read_settings",
    "settings_key",
]

SCHEDULING_CHOICES = ("host", "workers", "xdist")
CANNOT_SEE_CHOICES = ("report", "fail")


def _report_dir(raw: Any) -> str | None:
    value = str(raw).strip()
    return None if value.lower() in ("", "none") else value


def _report_name(raw: Any) -> str:
    value = str(raw).strip()
    if value and not re.fullmatch(r"[\w.+-]+", value):
        raise BadValue("use letters, digits and . _ + - only (no directories)")
    return value


def _previous(raw: Any) -> str:
    value = str(raw).strip()
    if not value.startswith("s3://") and not Path(value).is_file():
        raise BadValue("no such file; give the fleet summary JSON of an earlier run (a path or s3://)")
    return value


def _prometheus_textfile(raw: Any) -> str:
    path = Path(str(raw).strip())
    if path.suffix != ".prom":
        raise BadValue("node_exporter reads only *.prom files; name it e.g. gpuhost.prom")
    if not path.parent.is_dir():
        raise BadValue(f"directory {path.parent} does not exist")
    return str(path)


def _node_name(raw: Any) -> str:
    try:
        return check_node_name(str(raw), "name")
    except TargetError:
        raise BadValue("not a host name: use letters, digits, '_', '-' and dots (e.g. gpu-07)") from None


def _opt(key: str, flag: str, help: str, **kw: Any) -> Option:
    return Option(f"gpuhost_{key}", flag, help, **kw)


#: Every option of the plugin; `Settings` has one field per option, named as its ini name
#: without `gpuhost_`. Suites declare theirs in `suites/*/options.py`.
OPTIONS: tuple[Option, ...] = (
    _opt(
        "hosts",
        "--host",
        "target URL: ssh://user@host:port, local://, or a testinfra scheme; repeat for several targets",
        kind="list",
        default=(),
        metavar="URL",
    ),
    _opt(
        "node_name",
        "--node-name",
        "name of the local:// target in every output (default: this machine's host name)",
        parse=_node_name,
        metavar="NAME",
    ),
    _opt(
        "container",
        "--container",
        "container that holds the service: pct:ID, lxc:NAME, docker:NAME or ssh://...",
        metavar="SPEC",
    ),
    _opt(
        "inventory",
        "--inventory",
        "inventory of targets (YAML, Ansible INI or --list JSON; with --inventory-reader=ansible "
        "any source ansible-inventory reads) with per-host variables",
        parse=existing_path,
        metavar="PATH",
    ),
    _opt(
        "inventory_reader",
        "--inventory-reader",
        "who reads --inventory: auto (ours; Ansible for a plugin config), ansible "
        "(ansible-inventory --list, for any source), builtin (default {default})",
        parse=choice(*READERS),
        default=READERS[0],
        metavar="auto|ansible|builtin",
    ),
    _opt(
        "check_only",
        "--check-only",
        "check and plan, never change a target: failing checks report 'would fix' with the exact actions",
        kind="flag",
        default=False,
    ),
    _opt(
        "command_timeout",
        "--command-timeout",
        "default timeout of every command on a target, seconds (default {default})",
        parse=seconds,
        default=TargetOptions.command_timeout,
        metavar="S",
    ),
    _opt(
        "connect_timeout",
        "--connect-timeout",
        "timeout to reach a target and start its agent, seconds (default {default})",
        parse=seconds,
        default=TargetOptions.connect_timeout,
        metavar="S",
    ),
    _opt("ssh_identity", "--ssh-identity", "SSH private key file", parse=existing_file, metavar="FILE"),
    # dest "ssh_config": testinfra's --ssh-config means the same (ssh -F), whichever plugin adds it.
    _opt(
        "ssh_config",
        "--ssh-config",
        "ssh_config file for ssh targets (ssh -F; default the user's ~/.ssh/config and /etc/ssh/ssh_config)",
        parse=existing_file,
        metavar="FILE",
        dest="ssh_config",
    ),
    _opt(
        "known_hosts",
        "--known-hosts",
        "known_hosts file used to check host keys (default ~/.ssh/known_hosts)",
        metavar="FILE",
    ),
    _opt(
        "host_key_policy",
        "--host-key-policy",
        "unknown host keys: strict refuses them, accept-new records them in --known-hosts (default {default})",
        parse=choice("strict", "accept-new"),
        default=TargetOptions.host_key_policy,
        metavar="strict|accept-new",
    ),
    # dest "sudo": testinfra's --sudo means the same, and whichever plugin adds it, both read it.
    _opt(
        "sudo",
        "--sudo",
        "run commands on targets through sudo (shared with testinfra's --sudo)",
        kind="flag",
        default=False,
        dest="sudo",
    ),
    _opt(
        "report_dir",
        "--report-dir",
        "directory for the HTML, JSON and JUnit reports (default {default}; 'none' writes none)",
        parse=_report_dir,
        default="reports",
        metavar="DIR",
    ),
    _opt(
        "report_name",
        "--report-name",
        "base name of the report files (default: the suite or test path and a UTC timestamp)",
        parse=_report_name,
        default="",
        metavar="NAME",
    ),
    _opt(
        "scheduling",
        "--gpuhost-scheduling",
        "with -n: 'host' keeps each target's tests on one worker in order, or checks in this process "
        "where workers cost more (one target; --check-only of a few); 'workers' always uses the workers; "
        "'xdist' leaves xdist's --dist choice alone (default {default})",
        parse=choice(*SCHEDULING_CHOICES),
        default=SCHEDULING_CHOICES[0],
        metavar="host|workers|xdist",
    ),
    _opt(
        "limit",
        "--limit",
        "run only targets whose name or inventory group matches EXPR "
        "(and/or/not/parentheses, globs): --limit 'rack1 and not gpu-07'",
        metavar="EXPR",
    ),
    _opt(
        "fleet_json",
        "--fleet-json",
        "where the controller writes the hosts x checks summary (default fleet-summary.json in "
        "--report-dir); an s3:// prefix ending in / gets <node name>.json",
        metavar="PATH|s3://BUCKET/PREFIX/",
    ),
    _opt(
        "previous",
        "--previous",
        "fleet summary of an earlier run (path or s3://): list what newly failed and what recovered",
        parse=_previous,
        metavar="JSON",
    ),
    _opt(
        "prometheus_textfile",
        "--prometheus-textfile",
        "write gpuhost_check_ok gauges for node_exporter's textfile collector",
        parse=_prometheus_textfile,
        metavar="PATH.prom",
    ),  # The default is for nightly fleets (docs/fleet.md, "Checks that cannot see"): a check that
    # can never see on a node shape must not fail that node every night.
    _opt(
        "cannot_see",
        "--cannot-see",
        "a check whose input the node does not give (kernel log denied, no systemd, a tool missing): "
        "'report' counts it apart and leaves the exit status alone, 'fail' fails the test (default {default})",
        parse=choice(*CANNOT_SEE_CHOICES),
        default=CANNOT_SEE_CHOICES[0],
        metavar="report|fail",
    ),
)


def _key(opt: Option) -> str:
    return opt.name.removeprefix("gpuhost_")


@dataclass
class Settings:
    """The validated gpuhost options of one run; `sources` says where each value came from."""

    hosts: list[str]
    node_name: str | None
    container: str | None
    inventory: str | None
    inventory_reader: str
    check_only: bool
    command_timeout: float
    connect_timeout: float
    ssh_identity: str | None
    ssh_config: str | None
    known_hosts: str | None
    host_key_policy: str
    sudo: bool
    report_dir: str | None
    report_name: str
    scheduling: str
    limit: str | None
    fleet_json: str | None
    previous: str | None
    prometheus_textfile: str | None
    cannot_see: str
    sources: dict[str, Source] = field(default_factory=dict, repr=False)


settings_key = pytest.StashKey[Settings]()


def add_options(parser: pytest.Parser) -> None:
    """Register every gpuhost option and its ini twin (--sudo's and --ssh-config's flags: see add_sudo_if_missing)."""
    register(parser, OPTIONS, except_flags=SHARED_FLAGS)


def _has_option(parser: pytest.Parser, flag: str) -> bool:
    # pytest has no public lookup; the groups are where addoption puts options.
    groups = [*parser._groups, parser._anonymous]
    return any(flag in opt.names() for group in groups for opt in group.options)


#: Flags testinfra declares with the same meaning and destination; added only where it did not.
SHARED_FLAGS = ("--sudo", "--ssh-config")


def add_sudo_if_missing(parser: pytest.Parser) -> None:
    """Add --sudo and --ssh-config unless a plugin (testinfra) already did; they mean the same there.

    Called once every entry-point plugin is loaded, because argparse refuses a second --sudo.
    """
    for flag in SHARED_FLAGS:
        if not _has_option(parser, flag):
            add_flag(parser.getgroup(GROUP), next(o for o in OPTIONS if o.flag == flag))


def read_settings(config: pytest.Config) -> Settings:
    """Read and validate every gpuhost option; raise UsageError naming the bad value and its source."""
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for opt in OPTIONS:
        value, source = read_option(config, opt)
        values[_key(opt)] = list(value) if opt.kind == "list" else value
        sources[_key(opt)] = source
    s = Settings(**values, sources=sources)
    testinfra_compat.apply(config, s)
    if s.known_hosts is not None:
        kh = Path(s.known_hosts).expanduser()
        if s.host_key_policy == "strict" and not kh.is_file():
            raise sources["known_hosts"].error(
                "no such file (with --host-key-policy=accept-new it is created)"
            )
        if not kh.parent.is_dir():
            raise sources["known_hosts"].error(f"directory {kh.parent} does not exist")
    return s


def read(config: pytest.Config) -> Settings:
    """Return the run's settings: read and validated on the first call, then kept in the stash."""
    s = config.stash.get(settings_key, None)
    if s is None:
        s = config.stash[settings_key] = read_settings(config)
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


def publish(config: pytest.Config, s: Settings) -> None:
    """Write the resolved values back, so `config.getoption("gpuhost_check_only")` sees ini values too.

    xdist hands the controller's option values to its workers, so they also get the same
    report name and the same resolved settings.
    """
    for opt in OPTIONS:
        if opt.flag == "--report-dir":
            continue  # None means "write none"; published, it would read as "not given"
        value = getattr(s, _key(opt))
        if opt.kind == "value" and not value:
            value = None  # "not given", so ini and default lookups still work
        setattr(config.option, opt.attr, value)

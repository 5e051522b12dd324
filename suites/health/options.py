"""Command-line options and ini values of suites/health (registered by suites/conftest.py).

`--fix=NAME` (repeatable; ini `health_fix`, one name a line) turns on a safe fix: `persistence`
(persistence mode on) or `service` (restart a failed inference service). Without it every
check only reports. `--previous` (ini `gpuhost_previous`) names the fleet summary of the last
run to compare with; `--prometheus-textfile` (ini `gpuhost_prometheus_textfile`) is where the
controller writes gauges for node_exporter's textfile collector. pytest_gpuhost.report.fleet reads the
last two.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpuhost.modules.health import FIXES


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group."""
    group = parser.getgroup("gpuhost")
    group.addoption(
        "--fix",
        action="append",
        dest="health_fix",
        default=None,
        metavar="NAME",
        help=f"health: allow a safe fix ({', '.join(FIXES)}); repeat for several. Off by default",
    )
    group.addoption(
        "--previous",
        dest="gpuhost_previous",
        default=None,
        metavar="JSON",
        help="fleet summary of an earlier run (path or s3://): list what newly failed and what recovered",
    )
    group.addoption(
        "--prometheus-textfile",
        dest="gpuhost_prometheus_textfile",
        default=None,
        metavar="PATH.prom",
        help="write gpuhost_check_ok gauges for node_exporter's textfile collector",
    )
    parser.addini(
        "health_fix", "default for --fix: safe fixes allowed, one per line", type="linelist", default=[]
    )
    parser.addini("gpuhost_previous", "default for --previous", default="")
    parser.addini("gpuhost_prometheus_textfile", "default for --prometheus-textfile", default="")


def fixes(config: pytest.Config) -> list[str]:
    """Return the fixes allowed for this run (command line, else the ini value)."""
    cli = config.getoption("health_fix", None)
    if cli:
        return [n for v in cli for n in str(v).split(",") if n]
    return [str(n) for n in config.getini("health_fix") or []]


def validate(config: pytest.Config) -> None:
    """Check this suite's option values; raise pytest.UsageError naming the bad value."""
    where = "--fix" if config.getoption("health_fix", None) else "ini health_fix"
    for name in fixes(config):
        if name not in FIXES:
            raise pytest.UsageError(
                f"{where}={name!r}: unknown fix; choose from {', '.join(FIXES)} (e.g. --fix=persistence --fix=service)"
            )
    prev = config.getoption("gpuhost_previous", None) or config.getini("gpuhost_previous")
    if prev and not str(prev).startswith("s3://") and not Path(prev).is_file():
        where = "--previous" if config.getoption("gpuhost_previous", None) else "ini gpuhost_previous"
        raise pytest.UsageError(
            f"{where}={prev!r}: no such file; give the fleet summary JSON of an earlier run"
        )
    prom = config.getoption("gpuhost_prometheus_textfile", None) or config.getini(
        "gpuhost_prometheus_textfile"
    )
    if prom:
        where = (
            "--prometheus-textfile"
            if config.getoption("gpuhost_prometheus_textfile", None)
            else "ini gpuhost_prometheus_textfile"
        )
        path = Path(prom)
        if path.suffix != ".prom":
            raise pytest.UsageError(
                f"{where}={prom!r}: node_exporter reads only *.prom files; name it e.g. gpuhost.prom"
            )
        if not path.parent.is_dir():
            raise pytest.UsageError(f"{where}={prom!r}: directory {path.parent} does not exist")

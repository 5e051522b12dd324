"""Command-line options and ini values of suites/health (registered by suites/conftest.py).

`--fix=NAME` (repeatable, or comma separated; ini `health_fix`, one name a line) turns on a safe
fix: `persistence` (persistence mode on), `service` (restart a failed inference service) or
`drain` (drain a failed host in Slurm, resume one gpuhost drained: suites/health/drain.py) or
`reset` (reset a GPU that owes a reset: suites/health/reset.py).
Without it every check only reports. The fleet options the health suite is run with
(`--previous`, `--prometheus-textfile`, `--fleet-json`, `--limit`) are the plugin's, declared in
`pytest_gpuhost/run/settings.py`, because the report layer reads them.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.modules.health.checks import FIXES
from pytest_gpuhost.run.options import BadValue, Option, lines, read, register

__all__ = ["OPTIONS", "addoption", "fixes", "validate"]


#: The fixes --fix takes: the checks' (modules/health.FIXES), `drain` (suites/health/drain.py:
#: drain a failed host in Slurm, resume one gpuhost drained) and `reset` (suites/health/reset.py:
#: reset a GPU that owes a reset, its holders stopped and started again).
CHOICES: tuple[str, ...] = (*FIXES, "drain", "reset")


def _fixes(raw: Any) -> list[str]:
    names = lines(raw)
    for name in names:
        if name not in CHOICES:
            raise BadValue(
                f"unknown fix; choose from {', '.join(CHOICES)} (e.g. --fix=persistence --fix=service)", name
            )
    return names


FIX = Option(
    "health_fix",
    "--fix",
    f"health: allow a safe fix ({', '.join(CHOICES)}); repeat for several. Off by default",
    parse=_fixes,
    default=(),
    kind="list",
    metavar="NAME",
)

OPTIONS: tuple[Option, ...] = (FIX,)


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group."""
    register(parser, OPTIONS)


def fixes(config: pytest.Config) -> list[str]:
    """Return the fixes allowed for this run (command line, else the ini value)."""
    return list(read(config, FIX)[0])


def validate(config: pytest.Config) -> None:
    """Check this suite's option values; raise pytest.UsageError naming the bad value."""
    fixes(config)

"""The options of suites/health, declared once: `HealthOptions`, and the suite's `SUITE` (run/suite.py).

`--fix=NAME` (repeatable, or comma separated; ini `health_fix`, one name a line) turns on a safe
fix: `persistence` (persistence mode on), `service` (restart a failed inference service) or
`drain` (drain a failed host in Slurm, resume one gpuhost drained: suites/health/drain.py) or
`reset` (reset a GPU that owes a reset: suites/health/reset.py), with `reboot` beside it
(`--fix=reset,reboot`: reboot the node when the reset leaves the GPU owing one, suites/health/
reboot.py; ini `health_reboot_timeout`, how long the node has to come back, and
`health_reset_verify_timeout`, how long a reset GPU's signals have to clear).
Without it every check only reports. The fleet options the health suite is run with
(`--previous`, `--prometheus-textfile`, `--fleet-json`, `--limit`) are the plugin's, declared in
`pytest_gpuhost/run/settings.py`, because the report layer reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from pytest_gpuhost.modules.health.checks import FIXES
from pytest_gpuhost.modules.health.facts import gpu_source
from pytest_gpuhost.run.options import BadValue, Option, lines, seconds
from pytest_gpuhost.run.suite import Configured, Suite, option, table_of

from ..decommission.options import FIXES as DECOMMISSION_FIXES
from . import reboot, reset

__all__ = [
    "OPTIONS",
    "SUITE",
    "HealthOptions",
    "addoption",
    "fixes",
    "nccl",
    "nccl_timeout",
    "reboot_timeout",
    "reset_verify_timeout",
    "validate",
]


#: The fixes --fix takes: the checks' (modules/health.FIXES), `drain` (suites/health/drain.py:
#: drain a failed host in Slurm, resume one gpuhost drained) and `reset` (suites/health/reset.py:
#: reset a GPU that owes a reset, its holders stopped and started again).
CHOICES: tuple[str, ...] = (*FIXES, "drain", "reset")
#: Allowed only beside `reset`, as its fallback: a node is rebooted for no other reason.
REBOOT = "reboot"


def _fixes(raw: Any) -> list[str]:
    names = lines(raw)
    for name in names:
        if (name == REBOOT and "reset" in names) or name in DECOMMISSION_FIXES:
            continue  # `--fix` is one flag for every suite: suites/decommission reads its own
        if name not in CHOICES:
            hint = "; reboot only beside reset, as its fallback: --fix=reset,reboot" if name == REBOOT else ""
            raise BadValue(
                f"unknown fix; choose from {', '.join(CHOICES)} (e.g. --fix=persistence --fix=service), "
                f"or {', '.join(DECOMMISSION_FIXES)} for suites/decommission{hint}",
                name,
            )
    return names


@dataclass
class HealthOptions:
    """The suite's settings, each an `option()` field: its default written here only."""

    fix: tuple[str, ...] = option(
        (),
        flag="--fix",
        metavar="NAME",
        kind="list",
        help=f"allow a safe fix ({', '.join(CHOICES)}; reset,reboot: reboot when a reset does not "
        f"clear the GPU); decommission: {', '.join(DECOMMISSION_FIXES)} (remove the credentials found); "
        "repeat for several. Off by default",
        parse=_fixes,
    )
    #: Ini only: a real GPU server takes minutes to POST and boot (hundreds of DIMMs, eight GPUs,
    #: the NICs' option ROMs); ten minutes is the bound, a tighter one for a fleet that boots faster.
    reboot_timeout: float = option(
        reboot.REBOOT_TIMEOUT,
        flag=None,
        help="with --fix=reset,reboot, seconds a rebooted node has to answer SSH with a new boot id "
        "(default {default})",
        parse=seconds,
    )
    #: Ini only: how long a reset GPU's signals have to clear before the reset counts as failed
    #: (and, with --fix=reset,reboot, before the node is rebooted).
    reset_verify_timeout: float = option(
        reset.VERIFY_TIMEOUT,
        flag=None,
        help="with --fix=reset, seconds a reset GPU's own signals have to stop asking for a reset "
        "(default {default})",
        parse=seconds,
    )
    #: Opt-in: an NCCL all-reduce on every GPU of each host, against its NCCL_P2P_DISABLE=1 control
    #: (suites/health/test_health_nccl.py); it loads the GPUs for seconds, so never on by default.
    nccl: bool = option(
        False,
        flag="--health-nccl",
        kind="flag",
        help="also run an NCCL all-reduce (nccl-tests all_reduce_perf -c 1, else the torch program "
        "with python3) on every GPU of each host, with a NCCL_P2P_DISABLE=1 control arm, each bounded "
        "on the host; report only",
    )
    nccl_timeout: float = option(
        120.0,
        flag=None,
        help="with --health-nccl, the bound on each arm (all_reduce_perf or the torch program), "
        "enforced on the host (default {default})",
        parse=seconds,
    )


def _preconditions(ctx: Configured[HealthOptions]) -> list[str]:
    try:
        gpu_source()  # GPUHOST_HEALTH_SOURCE, read where the facts are asked for
    except ValueError as exc:
        return [str(exc)]
    return []


#: suites/health on the suite contract: its options and preconditions. Its tests are made from
#: the health checks' declaration (test_health.py), its per-host state is conftest.py's.
SUITE: Suite[HealthOptions, Any] = Suite(
    name="health", options=HealthOptions, label="health", preconditions=_preconditions
)
OPTIONS: tuple[Option, ...] = table_of(HealthOptions, "health", label="health")
FIX, REBOOT_TIMEOUT, RESET_VERIFY_TIMEOUT, NCCL, NCCL_TIMEOUT = OPTIONS


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group (suites/conftest.py does it for every suite)."""
    SUITE.addoption(parser)


def validate(config: pytest.Config) -> None:
    """Read and check this suite's options, as suites/conftest.py does for every suite."""
    SUITE.configure(config)
    SUITE.check(config)


def fixes(config: pytest.Config) -> list[str]:
    """Return the health fixes allowed for this run (command line, else the ini value)."""
    return [n for n in SUITE.settings(config).fix if n not in DECOMMISSION_FIXES]


def nccl(config: pytest.Config) -> bool:
    """Whether the opt-in NCCL collective check runs (--health-nccl, ini health_nccl)."""
    return SUITE.settings(config).nccl


def nccl_timeout(config: pytest.Config) -> float:
    """Return the bound on each arm of the NCCL collective check."""
    return SUITE.settings(config).nccl_timeout


def reboot_timeout(config: pytest.Config) -> float:
    """Return the seconds a node rebooted by --fix=reset,reboot has to come back."""
    return SUITE.settings(config).reboot_timeout


def reset_verify_timeout(config: pytest.Config) -> float:
    """Return the seconds a reset GPU's signals have to clear."""
    return SUITE.settings(config).reset_verify_timeout

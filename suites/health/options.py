"""Command-line options and ini values of suites/health (registered by suites/conftest.py).

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

from typing import Any

import pytest

from pytest_gpuhost.modules.health.checks import FIXES
from pytest_gpuhost.modules.health.facts import gpu_source
from pytest_gpuhost.run.options import BadValue, Option, lines, read, register, seconds

from ..decommission.options import FIXES as DECOMMISSION_FIXES
from . import reboot, reset

__all__ = [
    "OPTIONS",
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


FIX = Option(
    "health_fix",
    "--fix",
    f"health: allow a safe fix ({', '.join(CHOICES)}; reset,reboot: reboot when a reset does not "
    f"clear the GPU); decommission: {', '.join(DECOMMISSION_FIXES)} (remove the credentials found); "
    "repeat for several. Off by default",
    parse=_fixes,
    default=(),
    kind="list",
    metavar="NAME",
)

#: Ini only: a real GPU server takes minutes to POST and boot (hundreds of DIMMs, eight GPUs, the
#: NICs' option ROMs); ten minutes is the bound, a tighter one for a fleet that boots faster.
REBOOT_TIMEOUT = Option(
    "health_reboot_timeout",
    None,
    "health: with --fix=reset,reboot, seconds a rebooted node has to answer SSH with a new boot id "
    "(default {default})",
    parse=seconds,
    default=reboot.REBOOT_TIMEOUT,
)
#: Ini only: how long a reset GPU's signals have to clear before the reset counts as failed (and,
#: with --fix=reset,reboot, before the node is rebooted).
RESET_VERIFY_TIMEOUT = Option(
    "health_reset_verify_timeout",
    None,
    "health: with --fix=reset, seconds a reset GPU's own signals have to stop asking for a reset "
    "(default {default})",
    parse=seconds,
    default=reset.VERIFY_TIMEOUT,
)

#: Opt-in: an NCCL all-reduce on every GPU of each host, against its NCCL_P2P_DISABLE=1 control
#: (suites/health/test_health_nccl.py); it loads the GPUs for seconds, so it is never on by default.
NCCL = Option(
    "health_nccl",
    "--health-nccl",
    "health: also run an NCCL all-reduce (nccl-tests all_reduce_perf -c 1, else the torch program "
    "with python3) on every GPU of each host, with a NCCL_P2P_DISABLE=1 control arm, each bounded "
    "on the host; report only",
    kind="flag",
    default=False,
)
NCCL_TIMEOUT = Option(
    "health_nccl_timeout",
    None,
    "health: with --health-nccl, the bound on each arm (all_reduce_perf or the torch program), "
    "enforced on the host (default {default})",
    parse=seconds,
    default=120.0,
)

OPTIONS: tuple[Option, ...] = (FIX, REBOOT_TIMEOUT, RESET_VERIFY_TIMEOUT, NCCL, NCCL_TIMEOUT)


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group."""
    register(parser, OPTIONS)


def fixes(config: pytest.Config) -> list[str]:
    """Return the health fixes allowed for this run (command line, else the ini value)."""
    return [n for n in read(config, FIX)[0] if n not in DECOMMISSION_FIXES]


def nccl(config: pytest.Config) -> bool:
    """Whether the opt-in NCCL collective check runs (--health-nccl, ini health_nccl)."""
    return bool(read(config, NCCL)[0])


def nccl_timeout(config: pytest.Config) -> float:
    """Return the bound on each arm of the NCCL collective check."""
    return float(read(config, NCCL_TIMEOUT)[0])


def reboot_timeout(config: pytest.Config) -> float:
    """Return the seconds a node rebooted by --fix=reset,reboot has to come back."""
    return float(read(config, REBOOT_TIMEOUT)[0])


def reset_verify_timeout(config: pytest.Config) -> float:
    """Return the seconds a reset GPU's signals have to clear."""
    return float(read(config, RESET_VERIFY_TIMEOUT)[0])


def validate(config: pytest.Config) -> None:
    """Check this suite's option values; raise pytest.UsageError naming the bad value."""
    fixes(config)
    reboot_timeout(config)
    reset_verify_timeout(config)
    nccl_timeout(config)
    try:
        gpu_source()  # GPUHOST_HEALTH_SOURCE, read where the facts are asked for
    except ValueError as exc:
        raise pytest.UsageError(f"gpuhost: {exc}") from None


#: The suite contract's name for `validate` (suites/conftest.py calls it at configure).
configure = validate

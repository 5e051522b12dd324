"""Command-line options and ini values of suites/p2p (registered by suites/conftest.py).

Every default is `P2POptions`'s (suites/p2p/procedure.py); the table takes it from there, and help
texts show it through `{default}`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from urllib.parse import urlparse

import pytest

from pytest_gpuhost.modules import p2p_causes
from pytest_gpuhost.run.options import BadValue, Option, number, read, register

from .plan import parse_gpus_option
from .procedure import P2POptions

__all__ = ["OPTIONS", "addoption", "options", "validate"]

_stash_key = pytest.StashKey[P2POptions]()
_D = P2POptions  # the defaults, as class attributes of the dataclass


def _gpus(raw: Any) -> list[str] | None:
    try:
        return parse_gpus_option(str(raw))
    except ValueError as exc:
        raise BadValue(str(exc).removeprefix("--gpus: ")) from None


def _health_url(raw: Any) -> str:
    url = str(raw).strip()
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise BadValue("not an http(s) URL; give one like http://127.0.0.1:30000/health")
    return url


def _service(raw: Any) -> str:
    unit = str(raw).strip()
    if not unit:
        raise BadValue("give a systemd unit name, e.g. sglang-qwen")
    if unit.startswith("-"):  # it would reach systemctl as an option (-Hhost: --host=host)
        raise BadValue("a unit name does not start with '-'; give the unit, e.g. --service=sglang-qwen")
    return unit


def _expect(raw: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in str(raw).split(","):
        if not item.strip():
            continue
        place, _, frac = item.partition("=")
        names = {k.lower(): k for k in p2p_causes.EXPECTATIONS}
        place = names.get(place.strip().replace("-", " ").lower(), place.strip())
        if place not in p2p_causes.EXPECTATIONS:
            raise BadValue(
                f"{place!r} is not a placement; give PLACE=FRACTION with PLACE one of "
                + ", ".join(p.replace(" ", "-") for p in p2p_causes.EXPECTATIONS)
            )
        try:
            value = float(frac)
        except ValueError:
            raise BadValue(
                f"{item.strip()!r}: the fraction must be a number, e.g. same-numa-node=0.8"
            ) from None
        if not 0.01 <= value <= 1.0:
            raise BadValue(f"{item.strip()!r}: the fraction must be between 0.01 and 1")
        out[place] = value
    return out


def _opt(name: str, flag: str, metavar: str | None, help: str, **kw: Any) -> Option:
    return Option(f"p2p_{name}", flag, "suites/p2p: " + help, metavar=metavar, **kw)


GPUS = _opt(
    "gpus",
    "--gpus",
    "LIST",
    "GPUs in scope, PCI addresses or /dev/nvidiaN minors, comma separated "
    "(default: every GPU on nvidia; never a vfio-pci one)",
    parse=_gpus,
)
STOP_TIMEOUT = _opt(
    "stop_timeout",
    "--stop-timeout",
    "SECONDS",
    "graceful stop bound before SIGTERM then SIGKILL (default {default})",
    parse=number(0, 3600),
    default=_D.stop_timeout,
)
MIN_GBPS = _opt(
    "min_gbps",
    "--p2p-min-gbps",
    "GBPS",
    "P2P threshold per pair in GB/s (default: --p2p-min-fraction of what the pair's link should give)",
    parse=number(0, 100000),
)
MIN_FRACTION = _opt(
    "min_fraction",
    "--p2p-min-fraction",
    "FRACTION",
    "threshold as a fraction of the expected bandwidth (default {default})",
    parse=number(0.01, 1.0),
    default=_D.fraction,
)
SERVICE = _opt(
    "service",
    "--service",
    "UNIT",
    "systemd unit that holds the GPUs, in the container when --container is given "
    f"(default: inventory var p2p_service, else {_D.service})",
    parse=_service,
)
HEALTH_URL = _opt(
    "health_url",
    "--health-url",
    "URL",
    "health URL polled from the service's side (default http://127.0.0.1:PORT/health)",
    parse=_health_url,
)
HEALTH_PORT = _opt(
    "health_port",
    "--health-port",
    "PORT",
    "port of the default health URL (default {default})",
    parse=number(1, 65535, integer=True),
    default=_D.health_port,
)
HEALTH_TIMEOUT = _opt(
    "health_timeout",
    "--health-timeout",
    "SECONDS",
    "how long the restarted service may take to answer /health (default {default})",
    parse=number(1, 3600),
    default=_D.health_timeout,
)
UNBIND_TIMEOUT = _opt(
    "unbind_timeout",
    "--p2p-unbind-timeout",
    "SECONDS",
    "watchdog on each driver unbind/bind write; a write still blocked then is reported (default {default})",
    parse=number(0.5, 600),
    default=_D.unbind_timeout,
)
LOCK_WAIT = _opt(
    "lock_wait",
    "--p2p-lock-wait",
    "SECONDS",
    "how long to wait for another run's lock on the host (default {default})",
    parse=number(0, 86400),
    default=_D.lock_wait,
)
NCCL_TIMEOUT = _opt(
    "nccl_timeout",
    "--p2p-nccl-timeout",
    "SECONDS",
    "bound on each arm of the collective check (all_reduce_perf or the torch program), enforced on "
    "the target; a run still going then is reported as hung (default {default})",
    parse=number(5, 3600),
    default=_D.nccl_timeout,
)
UNSET_SERVICE_ENV = _opt(
    "unset_service_env",
    "--p2p-unset-service-env",
    None,
    "when the collective proves P2P, unset the service's own NCCL_P2P_DISABLE / NCCL_P2P_LEVEL "
    "(a drop-in with UnsetEnvironment=, journaled and undone by a failed run) and restart it; "
    "without it they are reported only",
    kind="flag",
    default=_D.unset_service_env,
)

EXPECT = _opt(
    "expect",
    "--p2p-expect",
    "PLACE=FRACTION,...",
    "override the diagnosis's expected P2P per pair placement, as a fraction of the slower link's rate "
    "(same-switch, same-root-port, same-NUMA-node, across-NUMA-nodes; defaults and their sources in "
    "pytest_gpuhost/modules/p2p_causes.py EXPECTATIONS)",
    parse=_expect,
)

OPTIONS: tuple[Option, ...] = (
    GPUS,
    STOP_TIMEOUT,
    MIN_GBPS,
    MIN_FRACTION,
    SERVICE,
    HEALTH_URL,
    HEALTH_PORT,
    HEALTH_TIMEOUT,
    UNBIND_TIMEOUT,
    LOCK_WAIT,
    NCCL_TIMEOUT,
    UNSET_SERVICE_ENV,
    EXPECT,
)


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group, each with an ini twin."""
    register(parser, OPTIONS)


def validate(config: pytest.Config) -> None:
    """Read and check this suite's option values; raise pytest.UsageError naming the bad value."""

    def value(opt: Option) -> Any:
        return read(config, opt)[0]

    config.stash[_stash_key] = P2POptions(
        gpus=value(GPUS),
        stop_timeout=value(STOP_TIMEOUT),
        min_gbps=value(MIN_GBPS),
        fraction=value(MIN_FRACTION),
        service=value(SERVICE) or "",  # "": not given, options() asks the inventory
        health_url=value(HEALTH_URL),
        health_port=value(HEALTH_PORT),
        health_timeout=value(HEALTH_TIMEOUT),
        lock_wait=value(LOCK_WAIT),
        unbind_timeout=value(UNBIND_TIMEOUT),
        nccl_timeout=value(NCCL_TIMEOUT),
        unset_service_env=bool(value(UNSET_SERVICE_ENV)),
        expect=value(EXPECT) or {},
    )


def options(config: pytest.Config, target_vars: dict[str, Any] | None = None) -> P2POptions:
    """Return the validated options, with per-host inventory variables filling what was not given."""
    base = config.stash.get(_stash_key, None) or P2POptions()
    hv = dict(target_vars or {})
    service = base.service or str(hv.get("p2p_service") or hv.get("service") or _D.service)
    min_gbps = base.min_gbps
    if min_gbps is None and "p2p_min_gbps" in hv:
        min_gbps = float(hv["p2p_min_gbps"])
    return replace(base, service=service, min_gbps=min_gbps)

"""Command-line options and ini values of suites/p2p (registered by suites/conftest.py)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

import pytest

from suites.p2p.plan import parse_gpus_option
from suites.p2p.procedure import P2POptions

__all__ = ["addoption", "validate", "options"]

_stash_key = pytest.StashKey[P2POptions]()

# (flag, dest/ini name, metavar, help, default as text)
_OPTIONS: tuple[tuple[str, str, str, str, str | None], ...] = (
    (
        "--gpus",
        "p2p_gpus",
        "LIST",
        "suites/p2p: GPUs in scope, PCI addresses or /dev/nvidiaN minors, comma separated (default: every GPU on nvidia; never a vfio-pci one)",
        None,
    ),
    (
        "--stop-timeout",
        "p2p_stop_timeout",
        "SECONDS",
        "suites/p2p: graceful stop bound before SIGTERM then SIGKILL (default 20)",
        "20",
    ),
    (
        "--p2p-min-gbps",
        "p2p_min_gbps",
        "GBPS",
        "suites/p2p: P2P threshold per pair in GB/s (default: --p2p-min-fraction of what the pair's link should give)",
        None,
    ),
    (
        "--p2p-min-fraction",
        "p2p_min_fraction",
        "FRACTION",
        "suites/p2p: threshold as a fraction of the expected bandwidth (default 0.5)",
        "0.5",
    ),
    (
        "--service",
        "p2p_service",
        "UNIT",
        "suites/p2p: systemd unit that holds the GPUs, in the container when --container is given (default: inventory var p2p_service, else sglang-qwen)",
        None,
    ),
    (
        "--health-url",
        "p2p_health_url",
        "URL",
        "suites/p2p: health URL polled from the service's side (default http://127.0.0.1:PORT/health)",
        None,
    ),
    (
        "--health-port",
        "p2p_health_port",
        "PORT",
        "suites/p2p: port of the default health URL (default 30000)",
        "30000",
    ),
    (
        "--health-timeout",
        "p2p_health_timeout",
        "SECONDS",
        "suites/p2p: how long the restarted service may take to answer /health (default 120)",
        "120",
    ),
    (
        "--p2p-unbind-timeout",
        "p2p_unbind_timeout",
        "SECONDS",
        "suites/p2p: watchdog on each driver unbind/bind write; a write still blocked then is reported (default 15)",
        "15",
    ),
    (
        "--p2p-lock-wait",
        "p2p_lock_wait",
        "SECONDS",
        "suites/p2p: how long to wait for another run's lock on the host (default 60)",
        "60",
    ),
)


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group, each with an ini twin."""
    group = parser.getgroup("gpuhost")
    for flag, dest, metavar, help_text, _default in _OPTIONS:
        group.addoption(flag, action="store", dest=dest, default=None, metavar=metavar, help=help_text)
        parser.addini(dest, help=help_text, default=None)


def _raw(config: pytest.Config, dest: str, default: str | None) -> tuple[Any, str]:
    flag = next(f for f, d, *_ in _OPTIONS if d == dest)
    value = config.getoption(dest, None)
    if value is not None:
        return value, flag
    ini = config.getini(dest)
    if ini not in (None, "", []):
        return ini, f"ini {dest}"
    return default, "default"


def _number(
    config: pytest.Config, dest: str, default: str | None, *, low: float, high: float
) -> float | None:
    raw, source = _raw(config, dest, default)
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{source}: {raw!r} is not a number") from None
    if not low <= value <= high:
        raise pytest.UsageError(f"{source}: {raw!r} is out of range: give a value from {low:g} to {high:g}")
    return value


def validate(config: pytest.Config) -> None:
    """Check this suite's option values; raise pytest.UsageError naming the bad value."""
    gpus_raw, gpus_source = _raw(config, "p2p_gpus", None)
    try:
        gpus = parse_gpus_option(gpus_raw)
    except ValueError as exc:
        raise pytest.UsageError(f"{gpus_source}: {exc}") from None
    health_url, url_source = _raw(config, "p2p_health_url", None)
    if health_url is not None:
        u = urlparse(str(health_url))
        if u.scheme not in ("http", "https") or not u.netloc:
            raise pytest.UsageError(
                f"{url_source}: {health_url!r} is not an http(s) URL, e.g. http://127.0.0.1:30000/health"
            )
    service, _ = _raw(config, "p2p_service", None)
    if service is not None and not str(service).strip():
        raise pytest.UsageError("--service: give a systemd unit name, e.g. sglang-qwen")
    stop_timeout = _number(config, "p2p_stop_timeout", "20", low=0, high=3600)
    min_gbps = _number(config, "p2p_min_gbps", None, low=0, high=100000)
    fraction = _number(config, "p2p_min_fraction", "0.5", low=0.01, high=1.0)
    port = _number(config, "p2p_health_port", "30000", low=1, high=65535)
    health_timeout = _number(config, "p2p_health_timeout", "120", low=1, high=3600)
    lock_wait = _number(config, "p2p_lock_wait", "60", low=0, high=86400)
    unbind_timeout = _number(config, "p2p_unbind_timeout", "15", low=0.5, high=600)
    config.stash[_stash_key] = P2POptions(
        gpus=gpus,
        stop_timeout=stop_timeout if stop_timeout is not None else 20.0,
        min_gbps=min_gbps,
        fraction=fraction if fraction is not None else 0.5,
        service=str(service).strip() if service else "",
        health_url=str(health_url) if health_url else None,
        health_port=int(port or 30000),
        health_timeout=health_timeout or 120.0,
        lock_wait=lock_wait if lock_wait is not None else 60.0,
        unbind_timeout=unbind_timeout or 15.0,
    )


def options(config: pytest.Config, target_vars: dict[str, Any] | None = None) -> P2POptions:
    """Return the validated options, with per-host inventory variables filling what was not given."""
    base = config.stash.get(_stash_key, None) or P2POptions()
    hv = dict(target_vars or {})
    service = base.service or str(hv.get("p2p_service") or hv.get("service") or "sglang-qwen")
    min_gbps = (
        base.min_gbps
        if base.min_gbps is not None
        else (float(hv["p2p_min_gbps"]) if "p2p_min_gbps" in hv else None)
    )
    return P2POptions(**{**base.__dict__, "service": service, "min_gbps": min_gbps})

"""The options of suites/p2p, declared once: `P2POptions`, one field per setting (run/suite.py).

Each field declared with `option()` is a flag with an ini twin (`p2p_<field>`); its default is
written in the field only, and help texts show it through `{default}`. The values are read once
at configure and stashed (`SUITE.settings(config, target.vars)` returns them); the inventory
variables `p2p_service` and `p2p_min_gbps` fill what the command line and ini left unset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlparse

from pytest_gpuhost.modules import p2p, p2p_causes
from pytest_gpuhost.run.options import BadValue, Option, number
from pytest_gpuhost.run.suite import option, table_of

from .plan import parse_gpus_option

__all__ = ["OPTIONS", "P2POptions", "per_target"]


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
        raise BadValue("give a systemd unit name, e.g. my-inference.service")
    if unit.startswith("-"):  # it would reach systemctl as an option (-Hhost: --host=host)
        raise BadValue(
            "a unit name does not start with '-'; give the unit, e.g. --service=my-inference.service"
        )
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


@dataclass
class P2POptions:
    """The suite's settings: each `option()` field a flag and ini value, the others fixed."""

    gpus: list[str] | None = option(
        flag="--gpus",
        metavar="LIST",
        help="GPUs in scope, PCI addresses or /dev/nvidiaN minors, comma separated "
        "(default: every GPU on nvidia; never a vfio-pci one)",
        parse=_gpus,
    )
    stop_timeout: float = option(
        20.0,
        flag="--stop-timeout",
        metavar="SECONDS",
        help="graceful stop bound before SIGTERM then SIGKILL (default {default})",
        parse=number(0, 3600),
    )
    min_gbps: float | None = option(
        flag="--p2p-min-gbps",
        metavar="GBPS",
        help="P2P threshold per pair in GB/s (default: --p2p-min-fraction of what the pair's link should give)",
        parse=number(0, 100000),
    )
    fraction: float = option(
        p2p.DEFAULT_FRACTION,
        flag="--p2p-min-fraction",
        ini="p2p_min_fraction",
        metavar="FRACTION",
        help="threshold as a fraction of the expected bandwidth (default {default})",
        parse=number(0.01, 1.0),
    )
    # "": not given; `per_target` asks the inventory, else step 1 finds the unit holding the GPUs (holder.py)
    service: str = option(
        "",
        flag="--service",
        metavar="UNIT",
        help="systemd unit that holds the GPUs, in the container when --container is given "
        "(default: inventory var p2p_service, else the unit whose processes hold the in-scope GPUs; "
        "none: nothing stopped)",
        parse=_service,
    )
    health_url: str | None = option(
        flag="--health-url",
        metavar="URL",
        help="health URL polled from the service's side (default http://127.0.0.1:PORT/health)",
        parse=_health_url,
    )
    health_port: int = option(
        30000,
        flag="--health-port",
        metavar="PORT",
        help="port of the default health URL (default {default})",
        parse=number(1, 65535, integer=True),
    )
    health_timeout: float = option(
        120.0,
        flag="--health-timeout",
        metavar="SECONDS",
        help="how long the restarted service may take to answer /health (default {default})",
        parse=number(1, 3600),
    )
    unbind_timeout: float = option(
        15.0,
        flag="--p2p-unbind-timeout",
        metavar="SECONDS",
        help="watchdog on each driver unbind/bind write; a write still blocked then is reported "
        "(default {default})",
        parse=number(0.5, 600),
    )
    lock_wait: float = option(
        60.0,
        flag="--p2p-lock-wait",
        metavar="SECONDS",
        help="how long to wait for another run's lock on the host (default {default})",
        parse=number(0, 86400),
    )
    # each arm of the NCCL collective check, enforced on the target (timeout -k 5): a healthy
    # 8-128 MiB all_reduce on a few GPUs takes seconds; NCCL's init alone can take tens
    nccl_timeout: float = option(
        120.0,
        flag="--p2p-nccl-timeout",
        metavar="SECONDS",
        help="bound on each arm of the collective check (all_reduce_perf or the torch program), enforced on "
        "the target; a run still going then is reported as hung (default {default})",
        parse=number(5, 3600),
    )
    # the service's own NCCL_P2P_DISABLE / NCCL_P2P_LEVEL: reported; unset only when asked
    unset_service_env: bool = option(
        False,
        flag="--p2p-unset-service-env",
        kind="flag",
        help="when the collective proves P2P, unset the service's own NCCL_P2P_DISABLE / NCCL_P2P_LEVEL "
        "(a drop-in with UnsetEnvironment=, journaled and undone by a failed run) and restart it; "
        "without it they are reported only",
    )
    # the operator's expectation per pair placement (modules/p2p_causes.py EXPECTATIONS), as fractions
    expect: dict[str, float] = option(
        flag="--p2p-expect",
        metavar="PLACE=FRACTION,...",
        help="override the diagnosis's expected P2P per pair placement, as a fraction of the slower link's "
        "rate (same-switch, same-root-port, same-NUMA-node, across-NUMA-nodes; defaults and their "
        "sources in pytest_gpuhost/modules/p2p_causes.py EXPECTATIONS)",
        parse=_expect,
        factory=dict,
    )
    lock_stale: float = 600.0
    # after a rebind the first open boots each GPU's firmware (GSP) before nvidia-smi lists it;
    # real figures are not measured (the lab's AMD profile: 3 s per GPU): wait this long at most
    gsp_wait: float = 90.0
    log_paths: tuple[str, ...] = ()


OPTIONS: tuple[Option, ...] = table_of(P2POptions, "p2p")


def per_target(opts: P2POptions, hv: dict[str, Any]) -> P2POptions:
    """Fill what the command line and ini left unset from the target's inventory variables."""
    service = opts.service or str(hv.get("p2p_service") or hv.get("service") or "")
    min_gbps = opts.min_gbps
    if min_gbps is None and "p2p_min_gbps" in hv:
        min_gbps = float(hv["p2p_min_gbps"])
    return replace(opts, service=service, min_gbps=min_gbps)

"""The options of suites/accept, declared once: `AcceptOptions`, one field per setting (run/suite.py).

Each field declared with `option()` is a flag with an ini twin (`accept_<field>`); its default
is written in the field only, and help texts show it through `{default}`. The values are read
once at configure and stashed (`SUITE.settings(config)` returns them). The order file itself is
read by `settle` (`loaded`, or `order_problems`: one line per problem), and the suite's
preconditions list those problems (suites/accept/suite.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pytest_gpuhost.modules import p2p
from pytest_gpuhost.redact import printable
from pytest_gpuhost.run.options import BadValue, Option, number
from pytest_gpuhost.run.suite import Configured, option, table_of

from .order import Order, OrderError, load_order

__all__ = ["OPTIONS", "AcceptOptions", "settle"]


def _order(raw: Any) -> str:
    path = Path(str(raw).strip())
    if not path.is_file():
        raise BadValue("no such file; pass an order such as fixtures/orders/b200-order.yaml")
    return str(path)


def _evidence(raw: Any) -> str:
    value = str(raw).strip()
    if not value or Path(value.replace("{host}", "x")).is_dir():
        raise BadValue("give a file path, e.g. evidence/accept-{host}.json")
    return value


@dataclass(frozen=True)
class AcceptOptions:
    """The suite's settings, each default written here once."""

    order: str | None = option(
        None,
        flag="--order",
        metavar="PATH",
        help="the order file: what the provider promised (docs/accept.md)",
        parse=_order,
    )
    scratch_mib: int = option(
        256,
        flag="--accept-scratch-mib",
        metavar="MIB",
        help="size of the scratch file written and read on the data volume, then removed (default {default})",
        parse=number(1, 65536, integer=True),
    )
    disk_timeout: float = option(
        120.0,
        flag="--accept-disk-timeout",
        metavar="SECONDS",
        help="bound on the scratch file's write and read, enforced on the node (default {default})",
        parse=number(5, 3600),
    )
    p2p_fraction: float = option(
        p2p.DEFAULT_FRACTION,
        flag="--accept-p2p-fraction",
        metavar="FRACTION",
        help="a GPU pair passes at this fraction of what its link should give (default {default})",
        parse=number(0.01, 1.0),
    )
    nccl_timeout: float = option(
        120.0,
        flag="--accept-nccl-timeout",
        metavar="SECONDS",
        help="bound on each arm of the NCCL all-reduce, enforced on the node (default {default})",
        parse=number(5, 3600),
    )
    evidence: str = option(
        "reports/accept-{host}.json",
        flag="--accept-evidence",
        metavar="PATH",
        help="the JSON of promised vs found per item; {host} is the target's name (default {default})",
        parse=_evidence,
    )
    #: the order, read by `settle` (None before, or when it cannot be used)
    loaded: Order | None = None
    #: why the order cannot be used, one line each (`settle`), listed by the preconditions
    order_problems: tuple[str, ...] = ()


OPTIONS: tuple[Option, ...] = table_of(AcceptOptions, "accept")


def settle(ctx: Configured[AcceptOptions]) -> AcceptOptions:
    """Read the order file once (every worker reads it too); keep its problems for the preconditions."""
    opts = ctx.options
    if not opts.order:
        return opts
    try:
        return replace(opts, loaded=load_order(opts.order))
    except OrderError as exc:
        return replace(opts, order_problems=tuple(printable(p) for p in exc.problems))

"""Command-line options and ini values of suites/accept (registered by suites/conftest.py).

Every default is `AcceptOptions`'s, written once there; the table takes it from the dataclass
and help texts show it through `{default}`. `validate` reads every value once and stashes one
`AcceptOptions`; `options(config)` hands it out. The order file itself is read by the suite's
preconditions (suites/accept/conftest.py), where each of its problems is one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.modules import p2p
from pytest_gpuhost.run.options import BadValue, Option, number, read, register

__all__ = ["OPTIONS", "AcceptOptions", "addoption", "options", "validate"]


@dataclass(frozen=True)
class AcceptOptions:
    """The suite's settings, each default written here once."""

    #: the order file (YAML or JSON): what the provider promised (suites/accept/order.py)
    order: str | None = None
    #: size of the scratch file written, fsync'd, read back and removed on the data volume
    scratch_mib: int = 256
    #: bound on the scratch file's write and read together, enforced on the node
    disk_timeout: float = 120.0
    #: a GPU pair passes at this fraction of what its link should give (modules/p2p.py)
    p2p_fraction: float = p2p.DEFAULT_FRACTION
    #: bound on each arm of the NCCL all-reduce, enforced on the node
    nccl_timeout: float = 120.0
    #: where the promised-vs-found JSON goes; {host} is the target's name
    evidence: str = "accept-{host}.json"


_D = AcceptOptions
_stash_key = pytest.StashKey[AcceptOptions]()


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


def _opt(name: str, flag: str, metavar: str | None, help: str, **kw: Any) -> Option:
    return Option(f"accept_{name}", flag, "suites/accept: " + help, metavar=metavar, **kw)


ORDER = _opt(
    "order", "--order", "PATH", "the order file: what the provider promised (docs/accept.md)", parse=_order
)
SCRATCH_MIB = _opt(
    "scratch_mib",
    "--accept-scratch-mib",
    "MIB",
    "size of the scratch file written and read on the data volume, then removed (default {default})",
    parse=number(1, 65536, integer=True),
    default=_D.scratch_mib,
)
DISK_TIMEOUT = _opt(
    "disk_timeout",
    "--accept-disk-timeout",
    "SECONDS",
    "bound on the scratch file's write and read, enforced on the node (default {default})",
    parse=number(5, 3600),
    default=_D.disk_timeout,
)
P2P_FRACTION = _opt(
    "p2p_fraction",
    "--accept-p2p-fraction",
    "FRACTION",
    "a GPU pair passes at this fraction of what its link should give (default {default})",
    parse=number(0.01, 1.0),
    default=_D.p2p_fraction,
)
NCCL_TIMEOUT = _opt(
    "nccl_timeout",
    "--accept-nccl-timeout",
    "SECONDS",
    "bound on each arm of the NCCL all-reduce, enforced on the node (default {default})",
    parse=number(5, 3600),
    default=_D.nccl_timeout,
)
EVIDENCE = _opt(
    "evidence",
    "--accept-evidence",
    "PATH",
    "the JSON of promised vs found per item; {host} is the target's name (default {default})",
    parse=_evidence,
    default=_D.evidence,
)

OPTIONS: tuple[Option, ...] = (ORDER, SCRATCH_MIB, DISK_TIMEOUT, P2P_FRACTION, NCCL_TIMEOUT, EVIDENCE)


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group, each with an ini twin."""
    register(parser, OPTIONS)


def validate(config: pytest.Config) -> None:
    """Read and check this suite's option values once; raise pytest.UsageError naming a bad one."""

    def value(opt: Option) -> Any:
        return read(config, opt)[0]

    config.stash[_stash_key] = AcceptOptions(
        order=value(ORDER),
        scratch_mib=int(value(SCRATCH_MIB)),
        disk_timeout=float(value(DISK_TIMEOUT)),
        p2p_fraction=float(value(P2P_FRACTION)),
        nccl_timeout=float(value(NCCL_TIMEOUT)),
        evidence=str(value(EVIDENCE)),
    )


def options(config: pytest.Config) -> AcceptOptions:
    """Return the options `validate` read (the defaults where it did not run)."""
    return config.stash.get(_stash_key, None) or AcceptOptions()

"""What a GPU pair should reach over PCIe: where it sits, and the links both trained to (pure).

`placement` says where a pair sits (same switch, same root port, same NUMA node, across NUMA
nodes); `EXPECTATIONS` holds the fraction of the slower link's rate each placement reaches, with
its source; `expectation` combines the two for one pair. modules/p2p_causes.py judges the
measured bandwidth against it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["EXPECTATIONS", "PairExpectation", "expectation", "placement", "trained_gbps"]

#: one-way P2P a pair should reach, as a fraction of the slower of its two links' rate at the
#: generation and width both trained to, by where the pair sits; data with its source. An
#: operator overrides any of them with --p2p-expect PLACE=FRACTION.
EXPECTATIONS: dict[str, tuple[float, str]] = {
    "same switch": (
        0.84,
        "no separate public figure: taken as at least the same-NUMA figure (a switch turns the traffic "
        "before the root complex)",
    ),
    "same root port": (0.84, "as same switch"),
    "same NUMA node": (
        0.84,
        "53-56 GB/s of 63 GB/s (Gen5 x16) measured between GPUs on one NUMA node "
        "(voipmonitor/rtx6kpro hardware/pcie-bandwidth.md)",
    ),
    "across NUMA nodes": (
        0.62,
        "39-51 GB/s of 63 GB/s measured across NUMA nodes (voipmonitor/rtx6kpro hardware/pcie-bandwidth.md)",
    ),
}


@dataclass
class PairExpectation:
    """What one GPU pair should reach from where it sits and the links both trained to."""

    a: str
    b: str
    placement: str
    link_gbps: float | None
    fraction: float
    source: str

    @property
    def gbps(self) -> float | None:
        """The expected one-way GB/s (None when no link rate is known)."""
        return round(self.link_gbps * self.fraction, 1) if self.link_gbps else None


def placement(a: str, b: str, gpus: dict[str, Any], ports: dict[str, Any]) -> str:
    """Where a pair sits: same switch, same root port, same NUMA node, or across NUMA nodes."""
    pa = list((gpus.get(a) or {}).get("ports") or [])
    pb = list((gpus.get(b) or {}).get("ports") or [])
    common = [p for p in pa if p in pb]
    if common:
        # the nearest shared bridge: the root port when it is the topmost one, else a switch port
        return "same root port" if common[0] == pa[-1] else "same switch"
    na = (gpus.get(a) or {}).get("numa_node")
    nb = (gpus.get(b) or {}).get("numa_node")
    if isinstance(na, int) and isinstance(nb, int) and na >= 0 and nb >= 0 and na != nb:
        return "across NUMA nodes"
    return "same NUMA node"


def trained_gbps(link: dict[str, Any]) -> float | None:
    """One-way GB/s of a PCIe link at the rate and width it trained to (line coding counted)."""
    m = re.match(r"^\s*([0-9.]+)\s*GT/s", str(link.get("current_link_speed") or ""))
    w = str(link.get("current_link_width") or "")
    if not m or not w.isdigit() or not int(w):
        return None
    gts = float(m.group(1))
    eff = 0.8 if gts <= 5.0 else 128 / 130
    return round(gts * int(w) * eff / 8, 1)


def expectation(
    a: str,
    b: str,
    gpus: dict[str, Any],
    ports: dict[str, Any],
    *,
    overrides: dict[str, float] | None = None,
    links: dict[str, dict[str, Any]] | None = None,
) -> PairExpectation:
    """A pair's expectation from where it sits and the lower of the two links' rates under load.

    `links` (the link each GPU trained to under load, when measured) wins over the idle link the
    fact read: an idle GPU drops to 2.5 GT/s (open-gpu-kernel-modules #731).
    """
    where = placement(a, b, gpus, ports)
    frac, source = EXPECTATIONS[where]
    if overrides and where in overrides:
        frac, source = overrides[where], "--p2p-expect (operator's override)"
    rates = []
    for g in (a, b):
        loaded = (links or {}).get(g)
        if loaded:  # the link as trained under load
            v = trained_gbps(loaded)
        else:  # read idle: the maximum, never the 2.5 GT/s an idle GPU drops to
            link = (gpus.get(g) or {}).get("link") or {}
            v = trained_gbps(
                {
                    "current_link_speed": link.get("max_link_speed"),
                    "current_link_width": link.get("max_link_width"),
                }
            )
        if v is not None:
            rates.append(v)
    return PairExpectation(a, b, where, min(rates) if rates else None, frac, source)

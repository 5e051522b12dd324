"""PCIe ACS on the paths above the GPUs: why a GPU shares its IOMMU group, and where ACS redirect
sends peer traffic up to the root complex (pure: over the agent's `pci_paths` fact).

Facts (docs/FACTS.md "ACS", docs/LAB-SOURCES.md):

- With an IOMMU active the kernel turns on Source Validation, P2P Request Redirect, P2P Completion
  Redirect and Upstream Forwarding on every port that implements them (drivers/pci/pci.c
  `pci_std_enable_acs()`, from `pci_enable_acs()`).
- A device gets an IOMMU group of its own only when every port above it has those four bits on
  (drivers/iommu/iommu.c `pci_device_group()`, `REQ_ACS_FLAGS`, `pci_acs_path_enabled()`); in
  `pci_acs_enabled()` (drivers/pci/pci.c) root and switch downstream ports must have them, an
  upstream port or endpoint only when it is one function of several, and a bit the port does not
  implement counts as on (`pci_acs_flags_enabled()`: `acs_flags &= (cap | PCI_ACS_EC)`).
- With Request or Completion Redirect on at a switch's downstream port, a peer request between
  two devices below that switch goes up to the root complex instead of turning in the switch
  (PCIe Base Spec "Access Control Services"; NCCL troubleshooting "PCI Access Control Services").
  An identity IOMMU domain does not change that routing. `pci=disable_acs_redir=` (commit
  aaca43fda742, Documentation/admin-guide/kernel-parameters.txt) clears RR, CR and EC on the
  ports named, at boot, before the IOMMU groups are built: those ports then no longer isolate
  what is below them, so the kernel merges the devices below into one group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.modules.pci import BDF_RE

__all__ = [
    "ACS_BITS",
    "REDIRECT",
    "REQ_ACS_FLAGS",
    "Port",
    "Redirect",
    "isolation_gaps",
    "parse_paths",
    "redirect",
]

REQ_ACS_FLAGS = ("SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd")  # drivers/iommu/iommu.c
REDIRECT = ("ReqRedir", "CmpltRedir")
ACS_BITS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans")
_TYPES = ("root", "upstream", "downstream", "pcie-to-pci", "pci-to-pcie", "other")


@dataclass(frozen=True)
class Port:
    """A bridge above a GPU: PCIe port type and ACS bits (None: config space unreadable)."""

    bdf: str
    type: str | None  # root | upstream | downstream | other | None (unknown)
    multifunction: bool = False
    present: bool | None = None  # has the ACS capability
    cap: tuple[str, ...] = ()
    ctl: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        """True when the port's type and ACS state were read."""
        return self.type is not None and self.present is not None

    def isolates(self) -> bool | None:
        """drivers/pci/pci.c pci_acs_enabled(port, REQ_ACS_FLAGS); None when unknown."""
        if not self.known:
            return None
        if self.type == "upstream" and not self.multifunction:
            return True  # "no ACS capabilities are applicable to single function devices"
        if self.type in ("pcie-to-pci", "pci-to-pcie"):
            return False  # a PCI/PCI-X side never isolates (conventional PCI is a shared bus)
        if not self.present:
            return False
        need = {b for b in REQ_ACS_FLAGS if b in self.cap}  # missing from cap: hard-wired on
        return need <= set(self.ctl)

    def describe(self) -> str:
        """Say what the port lacks, e.g. "0000:37:01.0 (root port): no ACS capability"."""
        kind = {
            "root": "root port",
            "downstream": "switch downstream port",
            "upstream": "switch upstream port",
        }
        name = f"{self.bdf} ({kind.get(self.type or '', 'bridge')})"
        if not self.known:
            return f"{name}: ACS state unknown (extended config space unreadable: not root?)"
        if not self.present:
            return f"{name}: no ACS capability"
        off = [b for b in REQ_ACS_FLAGS if b in self.cap and b not in self.ctl]
        return f"{name}: ACSCtl {' '.join(b + '-' for b in off)}"

    def redirects(self) -> list[str]:
        """The redirect bits (ReqRedir, CmpltRedir) on at this port."""
        return [b for b in REDIRECT if b in self.ctl]


@dataclass
class GpuPath:
    """One GPU's ports, nearest first."""

    bdf: str
    driver: str | None
    ports: list[Port] = field(default_factory=list)


def parse_paths(raw: Any) -> dict[str, GpuPath]:
    """GPU BDF -> GpuPath from the agent's `pci_paths` fact ({} when it failed or is absent)."""
    if not isinstance(raw, dict) or "error" in raw:
        return {}
    out: dict[str, GpuPath] = {}
    for bdf, entry in raw.items():
        if not isinstance(entry, dict) or not BDF_RE.match(str(bdf)):
            continue  # node data: only PCI addresses, known types and bit names are kept
        ports = []
        for p in entry.get("ports") or []:
            if not isinstance(p, dict) or not BDF_RE.match(str(p.get("bdf"))):
                continue
            acs = p.get("acs") if isinstance(p.get("acs"), dict) else None
            kind = p.get("type") if p.get("type") in _TYPES else None
            ports.append(
                Port(
                    str(p.get("bdf")),
                    kind,
                    bool(p.get("multifunction")),
                    None if acs is None or kind is None else bool(acs.get("present")),
                    _bits((acs or {}).get("cap")),
                    _bits((acs or {}).get("ctl")),
                )
            )
        driver = entry.get("driver")
        out[str(bdf)] = GpuPath(str(bdf), driver if isinstance(driver, str) else None, ports)
    return out


def _bits(raw: Any) -> tuple[str, ...]:
    return tuple(b for b in raw if b in ACS_BITS) if isinstance(raw, list) else ()


def isolation_gaps(path: GpuPath | None) -> list[Port]:
    """Ports above a GPU whose ACS does not isolate it (why the kernel merged its group upward)."""
    if path is None:
        return []
    return [p for p in path.ports if p.isolates() is False]


@dataclass(frozen=True)
class Redirect:
    """A GPU pair under one switch whose peer traffic ACS redirect sends up to the root complex."""

    a: str
    b: str
    switch: str  # the nearest common bridge (the switch's upstream port)
    ports: tuple[str, ...]  # the ports below it with ReqRedir/CmpltRedir on

    def describe(self) -> str:
        """One line: the pair, the ports and the bits."""
        return (
            f"{self.a} <-> {self.b}: ACS redirect on {', '.join(self.ports)} sends their peer traffic from "
            f"switch {self.switch} up to the root complex"
        )


def redirect(paths: dict[str, GpuPath], a: str, b: str) -> Redirect | None:
    """The pair's redirect when both GPUs sit below one switch and a port between them redirects."""
    pa, pb = paths.get(a), paths.get(b)
    if pa is None or pb is None:
        return None
    up_a, up_b = [p.bdf for p in pa.ports], [p.bdf for p in pb.ports]
    common = [x for x in up_a if x in up_b]
    if not common:
        return None  # under different root ports: through the root complex anyway
    below = pa.ports[: up_a.index(common[0])] + pb.ports[: up_b.index(common[0])]
    on = tuple(p.bdf for p in below if p.redirects())
    return Redirect(a, b, common[0], on) if on else None

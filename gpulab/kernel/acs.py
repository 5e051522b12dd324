"""ACS on the lab's PCIe ports: its bits at boot, the IOMMU groups they make, the P2P routes they force.

What real kernels do, each rule with its source, as pure functions over a ``Profile`` (no FUSE, no
threads), used by the host model, the config space and the profile loader:

- ACS at boot: with an IOMMU active the kernel sets Source Validation, P2P Request Redirect,
  P2P Completion Redirect and Upstream Forwarding on every port that implements ACS
  (drivers/pci/pci.c ``pci_std_enable_acs()``, called from ``pci_enable_acs()`` when an IOMMU
  driver asked for it with ``pci_request_acs()``).
- IOMMU grouping from ACS: a device gets its own group only if every port on its path up to the
  root bus has those four bits on (drivers/iommu/iommu.c ``pci_device_group()`` with
  ``REQ_ACS_FLAGS`` and ``pci_acs_path_enabled()``); functions of a multi-function device without
  ACS share a group (``get_pci_function_alias_group()``).
- P2P routing: with Request/Completion Redirect on the downstream ports of a switch, peer
  requests go up to the root complex and back instead of turning inside the switch (PCIe Base
  Spec 6.12 "Access Control Services"; NCCL "Troubleshooting: PCI Access Control Services").

See docs/LAB-SOURCES.md for the table of behaviours and their sources.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpulab.profiles.types import ACS_BITS, PciFunction, Profile

__all__ = [
    "ACS_CAP_DEFAULT",
    "REQ_ACS_FLAGS",
    "P2PRoute",
    "acs_cap",
    "boot_acs_ctl",
    "kernel_group_partition",
    "p2p_route",
    "port_type",
]

# Bits a port implements when the profile does not say: SV TB RR CR UF DT (0x5f), as the
# Broadcom/PLX and root ports of the seed machines report in `lspci -vvv` ACSCap.
ACS_CAP_DEFAULT = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "DirectTrans")
# drivers/iommu/iommu.c: #define REQ_ACS_FLAGS (PCI_ACS_SV | PCI_ACS_RR | PCI_ACS_CR | PCI_ACS_UF)
REQ_ACS_FLAGS = ("SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd")


def port_type(profile: Profile, bdf: str) -> int:
    """Return the PCIe device/port type: 0 endpoint, 4 root port, 5 upstream, 6 downstream."""
    f = profile.function(bdf)
    if not f.klass.startswith("0x0604"):
        return 0
    if f.parent is None:
        return 4
    if any(k.klass.startswith("0x0604") for k in profile.pci if k.parent == bdf):
        return 5
    return 6


def acs_cap(profile: Profile, f: PciFunction) -> tuple[str, ...]:
    """Return the ACS bits a function implements (empty: no ACS extended capability)."""
    if f.acs_cap is not None:
        return f.acs_cap
    if port_type(profile, f.bdf) in (4, 6) or f.acs:
        return ACS_CAP_DEFAULT
    return ()


def boot_acs_ctl(profile: Profile, f: PciFunction) -> tuple[str, ...]:
    """Return the ACS control bits a function has after boot.

    The profile's ``acs`` wins (a BIOS or a ``pci=config_acs=`` setting). Otherwise, when the
    profile says the kernel enables ACS (``kernel_enables_acs``, true on a real host with the
    IOMMU on), drivers/pci/pci.c pci_std_enable_acs(): ``caps->ctrl |= caps->cap & (SV|RR|CR|UF)``
    (Translation Blocking only for external-facing or untrusted ports, which the lab has none of).
    """
    cap = acs_cap(profile, f)
    if f.acs is not None:
        return f.acs
    if profile.kernel_enables_acs:
        return tuple(b for b in ACS_BITS if b in cap and b in REQ_ACS_FLAGS)
    return ()


def _acs_enabled(profile: Profile, f: PciFunction, ctl: Callable[[str], tuple[str, ...]]) -> bool:
    """drivers/pci/pci.c pci_acs_enabled(): downstream and root ports need the flags; upstream
    ports and endpoints only when they are part of a multi-function device. pci_acs_flags_enabled():
    no ACS capability is "not enabled"; a flag the port does not implement counts as hard-wired on
    (``acs_flags &= (cap | PCI_ACS_EC)``)."""
    pt = port_type(profile, f.bdf)
    multi = sum(1 for g in profile.pci if g.bdf[:-1] == f.bdf[:-1]) > 1
    if pt in (4, 6) or (multi and pt in (0, 5)):
        cap = acs_cap(profile, f)
        if not cap:
            return False
        return set(REQ_ACS_FLAGS) & set(cap) <= set(ctl(f.bdf))
    return True


def _path_enabled(profile: Profile, bdf: str, ctl: Callable[[str], tuple[str, ...]]) -> bool:
    """drivers/pci/pci.c pci_acs_path_enabled(start, NULL, flags): every device up to the root bus."""
    cur: str | None = bdf
    while cur is not None:
        f = profile.function(cur)
        if not _acs_enabled(profile, f, ctl):
            return False
        cur = f.parent
    return True


def kernel_group_partition(
    profile: Profile, ctl: Callable[[str], tuple[str, ...]] | None = None
) -> list[set[str]]:
    """Return the sets of functions the kernel puts in one IOMMU group, given ACS control bits.

    Follows drivers/iommu/iommu.c pci_device_group(): walk up from the device; stop at the first
    bridge whose path to the root has ACS (REQ_ACS_FLAGS) on; below that, the device joins the
    group of the bridge it stopped under. Functions of one multi-function device without ACS join
    each other (get_pci_function_alias_group()). Only functions with an ``iommu_group`` count.
    """
    look: Callable[[str], tuple[str, ...]] = ctl or (lambda b: boot_acs_ctl(profile, profile.function(b)))
    parent: dict[str, str] = {f.bdf: f.bdf for f in profile.pci if f.iommu_group is not None}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        if a in parent and b in parent:
            parent[find(a)] = find(b)

    for f in profile.pci:
        if f.iommu_group is None:
            continue
        up = f.parent
        while up is not None:
            if _path_enabled(profile, up, look):
                break
            union(f.bdf, up)
            up = profile.function(up).parent
        siblings = [g for g in profile.pci if g.bdf[:-1] == f.bdf[:-1] and g.bdf != f.bdf]
        if siblings and not _acs_enabled(profile, f, look):
            for g in siblings:
                union(f.bdf, g.bdf)
    out: dict[str, set[str]] = {}
    for b in parent:
        out.setdefault(find(b), set()).add(b)
    return sorted(out.values(), key=lambda s: sorted(s)[0])


def check_groups(profile: Profile) -> str:
    """Return "" when the profile's ``iommu_group`` numbers match what the kernel would build from
    its ACS bits at boot, else one line naming the first function that differs."""
    want = kernel_group_partition(profile)
    have: dict[int, set[str]] = {g: set(m) for g, m in profile.groups().items()}
    by_fn = {b: s for s in want for b in s}
    for g, members in sorted(have.items()):
        for b in sorted(members):
            if by_fn[b] != members:
                return (
                    f"iommu group {g} holds {', '.join(sorted(members))} but with the ACS bits at boot "
                    f"the kernel groups {b} with {', '.join(sorted(by_fn[b]))}"
                )
    return ""


@dataclass(frozen=True)
class P2PRoute:
    """How peer traffic between two GPUs travels: ``kind`` and one-direction GB/s."""

    kind: str  # nvlink | switch | root-complex | cross-socket
    gbps: float
    redirected: bool  # a switch pair sent up to the root complex by ACS redirect


def _ancestors(profile: Profile, bdf: str) -> list[str]:
    out: list[str] = []
    cur = profile.function(bdf).parent
    while cur is not None and cur not in out:
        out.append(cur)
        cur = profile.function(cur).parent
    return out


def p2p_route(
    profile: Profile, a: str, b: str, ctl: Callable[[str], tuple[str, ...]] | None = None
) -> P2PRoute | None:
    """Return the route peer traffic between GPUs ``a`` and ``b`` takes, or None without a link model.

    Two GPUs under one switch turn inside it unless a downstream port on either side has ACS
    ReqRedir or CmpltRedir on: then the switch forwards the request upstream and the root complex
    routes it back (``redirected``), at the profile's ``route_gbps["root-complex"]`` if given,
    else the pair's own figure. Pairs under different root ports always cross the root complex,
    pairs on different NUMA nodes cross the socket interconnect.
    """
    lk = profile.link(a, b)
    if lk is None:
        return None
    if lk.type == "nvlink":
        return P2PRoute("nvlink", lk.gbps, False)
    look: Callable[[str], tuple[str, ...]] = ctl or (lambda x: boot_acs_ctl(profile, profile.function(x)))
    up_a, up_b = _ancestors(profile, a), _ancestors(profile, b)
    common = [x for x in up_a if x in up_b]
    rates: Mapping[str, object] = profile.raw.get("route_gbps") or {}
    if common and port_type(profile, common[0]) == 5:
        below = [x for x in up_a[: up_a.index(common[0])] + up_b[: up_b.index(common[0])]]
        if any(bit in look(x) for x in below for bit in ("ReqRedir", "CmpltRedir")):
            rc = rates.get("root-complex", lk.gbps)
            return P2PRoute("root-complex", float(rc) if isinstance(rc, (int, float)) else lk.gbps, True)
        return P2PRoute("switch", lk.gbps, False)
    fa, fb = profile.function(a), profile.function(b)
    kind = "cross-socket" if fa.numa_node != fb.numa_node else "root-complex"
    return P2PRoute(kind, lk.gbps, False)

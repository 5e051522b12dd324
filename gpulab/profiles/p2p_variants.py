"""Variants of the lab's Intel Proxmox machine (`proxmox-rtx6000`) for the ACS topologies real hosts show.

``rtx6000_root_port_without_acs(vm_gpu=...)``: the same host with the kernel enabling ACS at boot
(``kernel_enables_acs``: drivers/pci/pci.c ``pci_std_enable_acs()`` sets SV RR CR UF on every port
that implements them while an IOMMU is active), except that root port ``0000:37:01.0`` has no ACS
capability at all. Root ports without ACS are common: "far too many topologies do not support
ACS ... Even the latest chipsets from Intel are only sporadically supporting ACS" (Alex
Williamson, the pcie_acs_override patch, LKML 2013-05-30, as the kernel's ACS quirk table in
drivers/pci/quirks.c also shows). drivers/iommu/iommu.c ``pci_device_group()`` then walks up from
each device below that port, finds no ACS-enabled path and puts the whole subtree in the root
port's group: the port, the switch below it, GPUs 2 and 3 and their audio functions. With
``vm_gpu`` that GPU and its audio function are on vfio-pci for a VM (Proxmox binds a VM's
devices with driver_override), so a GPU on nvidia shares its group with a VM's device; the
service then uses the other three GPUs.

``rtx6000_acs_redirect_routed()``: the same host with the kernel enabling ACS at boot on every
port, so the switch ports above each GPU pair redirect their peer requests to the root complex,
and a root complex that routes them back down (``rc_routes_redirected_p2p``): peer copies pass,
while NCCL collectives over those hops hang, as operators of AMD hosts report
(noonghunna/club-3090 PR #902; vllm-project/vllm#51513, root ports ``ReqRedir+ CmpltRedir+``).

The profile loader checks the group numbers against what the kernel builds from the ACS bits
(``gpulab.kernel.acs.check_groups``), so the variant cannot claim an isolation its ports lack.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from gpulab.profiles.load import PROFILE_DIR, load_profile
from gpulab.profiles.types import Profile

__all__ = ["NO_ACS_PORT", "SHARED_GROUP", "rtx6000_acs_redirect_routed", "rtx6000_root_port_without_acs"]

BASE = "proxmox-rtx6000"
NO_ACS_PORT = "0000:37:01.0"
SHARED_GROUP = 14  # the root port's group, which everything below it joins


def _below(pci: list[dict[str, Any]], root: str) -> set[str]:
    parent = {f["bdf"]: f.get("parent") for f in pci}
    out = set()
    for bdf in parent:
        cur: str | None = bdf
        while cur is not None:
            if cur == root:
                out.add(bdf)
                break
            cur = parent.get(cur)
    return out


def rtx6000_root_port_without_acs(vm_gpu: str | None = "0000:3b:00.0", kernel: str | None = None) -> Profile:
    """The Intel Proxmox host with ACS enabled by the kernel and no ACS on root port 0000:37:01.0.

    ``vm_gpu``: a GPU below that port handed to a VM on vfio-pci (None: all four on nvidia).
    ``kernel``: another kernel release (the era of the sysfs rules).
    """
    data = yaml.safe_load((PROFILE_DIR / f"{BASE}.yaml").read_text())
    pci = copy.deepcopy(data["pci"])
    moved = _below(pci, NO_ACS_PORT)
    for f in pci:
        if f["bdf"] == NO_ACS_PORT:
            f["acs_cap"] = []
        if f["bdf"] in moved:
            f["iommu_group"] = SHARED_GROUP
        if vm_gpu is not None and f["bdf"][:-1] == vm_gpu[:-1]:
            f["driver"] = "vfio-pci"
    log = []
    for line in data["kernel_log"]:
        msg = str(line["msg"])
        bdf = msg[4:16] if msg.startswith("pci ") else ""
        if bdf in moved and "Adding to iommu group" in msg:
            msg = f"pci {bdf}: Adding to iommu group {SHARED_GROUP}"
        log.append({"t": line["t"], "msg": msg})
    services = copy.deepcopy(data["services"])
    for s in services:
        if vm_gpu is not None and s.get("kind") == "sglang":
            s["gpus"] = [b for b in s["gpus"] if b != vm_gpu]
    overrides: dict[str, Any] = {
        "name": "rtx6000-rp-noacs" + ("-vm" if vm_gpu else ""),
        "kernel_enables_acs": True,
        "pci": pci,
        "kernel_log": log,
        "services": services,
    }
    if kernel:
        overrides["kernel"] = kernel
    return load_profile(BASE, overrides)


def rtx6000_acs_redirect_routed() -> Profile:
    """The Intel Proxmox host with ACS redirect on its switch ports, routed back by the root complex."""
    return load_profile(
        BASE,
        {"name": "rtx6000-acs-routed", "kernel_enables_acs": True, "rc_routes_redirected_p2p": True},
    )

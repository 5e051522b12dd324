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

One variant per cause of slow or broken P2P besides the IOMMU (modules/p2p_causes.py; each
behaviour is cited in docs/LAB-SOURCES.md):

``rtx6000_small_bar1()``: Resizable BAR off, BAR1 256 MiB on every in-scope GPU (sysfs
``resource`` region 1).
``rtx6000_hmm_on()``: nvidia_uvm loaded with ``uvm_disable_hmm=N`` and NCCL's P2P collectives
hanging while it is (``hmm_hangs_p2p``: the lab's all_reduce_perf).
``rtx6000_port_pm()``: the ports above the in-scope GPUs with runtime PM ``auto`` (the kernel
command line lacks ``pcie_port_pm=off``); a test adds the AER history (faults.json
``surprise_down``).
``rtx6000_cross_socket()``: GPUs 9a:00.0 and 9b:00.0 (NUMA node 1, the other socket) on nvidia
too, so the in-scope pairs include cross-socket ones with their lower link model (30 GB/s).
``rtx6000_all_causes()``: all of them at once on the seed's host.

The profile loader checks the group numbers against what the kernel builds from the ACS bits
(``gpulab.kernel.acs.check_groups``), so the variant cannot claim an isolation its ports lack.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from gpulab.profiles.load import PROFILE_DIR, load_profile
from gpulab.profiles.types import Profile

__all__ = [
    "IN_SCOPE_PORTS",
    "NO_ACS_PORT",
    "SHARED_GROUP",
    "rtx6000_acs_redirect_routed",
    "rtx6000_all_causes",
    "rtx6000_cross_socket",
    "rtx6000_hmm_on",
    "rtx6000_port_pm",
    "rtx6000_root_port_without_acs",
    "rtx6000_small_bar1",
]

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


IN_SCOPE = ("0000:17:00.0", "0000:18:00.0", "0000:3a:00.0", "0000:3b:00.0")
# the bridges above the four in-scope GPUs: root ports, switch up- and downstream ports
IN_SCOPE_PORTS = (
    "0000:14:01.0", "0000:15:00.0", "0000:16:00.0", "0000:16:01.0",
    "0000:37:01.0", "0000:38:00.0", "0000:39:00.0", "0000:39:01.0",
)  # fmt: skip
CROSS = ("0000:9a:00", "0000:9b:00")  # GPUs 4 and 5 (NUMA node 1) taken from the VM


def _small_bar1() -> dict[str, Any]:
    return {"bar1_mib": dict.fromkeys(IN_SCOPE, 256)}


def _hmm_on() -> dict[str, Any]:
    return {"module_params": {"nvidia_uvm": {"uvm_disable_hmm": False}}, "hmm_hangs_p2p": True}


def _port_pm() -> dict[str, Any]:
    return {"port_power_control": dict.fromkeys(IN_SCOPE_PORTS, "auto")}


def _cross_socket(data: dict[str, Any]) -> dict[str, Any]:
    pci = copy.deepcopy(data["pci"])
    for f in pci:
        if f["bdf"][:-2] in CROSS:
            f["driver"] = "nvidia" if f["bdf"].endswith(".0") else "snd_hda_intel"
    services = copy.deepcopy(data["services"])
    for sv in services:
        if sv.get("kind") == "sglang":
            sv["gpus"] = [*sv["gpus"], *(c + ".0" for c in CROSS)]
    return {"pci": pci, "services": services}


def rtx6000_small_bar1() -> Profile:
    """The seed's host with Resizable BAR off: BAR1 256 MiB on the in-scope GPUs (96 GiB of memory)."""
    return load_profile(BASE, {"name": "rtx6000-small-bar1", **_small_bar1()})


def rtx6000_hmm_on() -> Profile:
    """The seed's host with nvidia_uvm loaded with HMM (uvm_disable_hmm=N): P2P collectives hang."""
    return load_profile(BASE, {"name": "rtx6000-hmm-on", **_hmm_on()})


def rtx6000_port_pm() -> Profile:
    """The seed's host with runtime PM on (auto) at every port above the in-scope GPUs."""
    return load_profile(BASE, {"name": "rtx6000-port-pm", **_port_pm()})


def rtx6000_cross_socket() -> Profile:
    """The seed's host with GPUs 9a:00.0 and 9b:00.0 (the other socket) on nvidia: cross-socket pairs."""
    data = yaml.safe_load((PROFILE_DIR / f"{BASE}.yaml").read_text())
    return load_profile(BASE, {"name": "rtx6000-cross-socket", **_cross_socket(data)})


def rtx6000_all_causes() -> Profile:
    """The seed's host with every cause at once: IOMMU translated, small BAR1, HMM on, port PM on
    (the collective does not hang here: the HMM hang is ``rtx6000_hmm_on``'s, so that a repair
    run can show the rest converge)."""
    over = {**_small_bar1(), **_hmm_on(), **_port_pm(), "hmm_hangs_p2p": False}
    return load_profile(BASE, {"name": "rtx6000-all-causes", **over})

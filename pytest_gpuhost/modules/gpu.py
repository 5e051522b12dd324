"""NVIDIA GPUs of a target: PCI function, driver, IOMMU group and its members, minor, holders.

`inventory(target)` is what the plugin's `gpus` fixture returns. Everything comes from the
agent's facts in one round trip (`gpus`, `gpu_holders`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.modules.iommu import IommuGroup
from pytest_gpuhost.modules.pci import PciFunction

__all__ = [
    "MODULE_FILES",
    "GpuInfo",
    "Holder",
    "from_facts",
    "inventory",
    "kernel_holders",
    "modeset_removed_on_unbind",
    "open_counts",
    "parse_holders",
]

MODESET = "/sys/module/nvidia_drm/parameters/modeset"
FBDEV = "/sys/module/nvidia_drm/parameters/fbdev"
DRM_REFCNT = "/sys/module/nvidia_drm/refcnt"
UVM_REFCNT = "/sys/module/nvidia_uvm/refcnt"
NV_VERSION = "/sys/module/nvidia/version"  # MODULE_VERSION(NV_VERSION_STRING), kernel-open/nvidia/nv.c
MODULE_FILES = (MODESET, FBDEV, DRM_REFCNT, UVM_REFCNT, NV_VERSION)
# The first releases whose nv_pci_remove() calls nvidia_modeset_remove() before it waits for the
# usage count (open-gpu-kernel-modules kernel-open/nvidia/nv-pci.c, tags 580.105.08 and, on the
# separate 580.94 branch, 580.94.06; absent from 580.95.05 and every 575/570 tag).
MODESET_REMOVE_FROM = (580, 105, 8)
MODESET_REMOVE_BRANCHES = {(580, 94): (580, 94, 6)}


@dataclass
class Holder:
    """A process with GPU device files open."""

    pid: int
    comm: str
    cmdline: str
    files: list[str] = field(default_factory=list)
    cgroup: str = ""
    fds: dict[str, int] = field(default_factory=dict)  # path -> descriptors naming it

    def describe(self) -> str:
        """Return "pid 1234 (python3) holds /dev/nvidia0: CMDLINE"."""
        return f"pid {self.pid} ({self.comm}) holds {', '.join(self.files)}: {self.cmdline[:200]}"


@dataclass
class GpuInfo:
    """One NVIDIA GPU function with what the P2P procedure needs to know about it."""

    bdf: str
    function: PciFunction
    group: IommuGroup | None
    minor: int | None = None
    holders: list[Holder] = field(default_factory=list)

    @property
    def driver(self) -> str | None:
        """The driver bound to the GPU function (None when unbound)."""
        return self.function.driver

    @property
    def iommu_group(self) -> int | None:
        """The IOMMU group number."""
        return self.function.iommu_group

    @property
    def group_type(self) -> str | None:
        """The IOMMU group's type (DMA, DMA-FQ, identity, ...)."""
        return self.group.type if self.group else None

    @property
    def on_vfio(self) -> bool:
        """True when the GPU (or anything in its group) belongs to a VM through vfio-pci."""
        return self.driver == "vfio-pci" or bool(self.group and self.group.has_vfio)

    @property
    def device_file(self) -> str | None:
        """/dev/nvidiaN for this GPU, when it is on nvidia and its minor is known."""
        return None if self.minor is None else f"/dev/nvidia{self.minor}"


def parse_holders(raw: Any) -> list[Holder]:
    """Holders from the agent's `gpu_holders` fact (empty when it failed)."""
    if not isinstance(raw, list):
        return []
    return [
        Holder(
            int(h["pid"]),
            str(h.get("comm") or ""),
            str(h.get("cmdline") or ""),
            list(h.get("files") or []),
            str(h.get("cgroup") or ""),
            {str(k): int(v) for k, v in (h.get("fds") or {}).items()},
        )
        for h in raw
    ]


def from_facts(gpus_fact: Any, holders_fact: Any = None) -> list[GpuInfo]:
    """Build GpuInfo objects from the agent's `gpus` and `gpu_holders` facts."""
    if isinstance(gpus_fact, dict) and "error" in gpus_fact:
        raise RuntimeError(f"gpus fact failed on the target: {gpus_fact['error']}")
    holders = parse_holders(holders_fact)
    out: list[GpuInfo] = []
    for entry in gpus_fact or []:
        fn = PciFunction.from_fact(entry)
        group = None
        if fn.iommu_group is not None:
            members = [PciFunction.from_fact(m) for m in entry.get("group_members") or [entry]]
            group = IommuGroup(fn.iommu_group, entry.get("group_type"), members)
        minor = entry.get("minor")
        mine = [h for h in holders if minor is not None and f"/dev/nvidia{minor}" in h.files]
        out.append(GpuInfo(fn.bdf, fn, group, minor, mine))
    return out


def inventory(target: Any) -> list[GpuInfo]:
    """Return the target's NVIDIA GPUs, read in one round trip."""
    facts = target.conn.facts("gpus", "gpu_holders")
    return from_facts(facts.get("gpus"), facts.get("gpu_holders"))


def _count(text: str | None) -> int:
    try:
        return int((text or "").strip() or 0)
    except ValueError:
        return 0


def open_counts(holders: list[Holder]) -> dict[str, int]:
    """How many descriptors name each device file, across processes (one per file without the agent's fd count).

    A descriptor is at most one open file (dup(2) and fork(2) share one), so twice this count bounds
    the references the processes hold on the file's module from above.
    """
    out: dict[str, int] = {}
    for h in holders:
        for f in set(h.files):
            out[f] = out.get(f, 0) + max(1, h.fds.get(f, 1))
    return out


def modeset_removed_on_unbind(version: str | None) -> bool | None:
    """Say whether this driver's unbind tears nvidia-modeset down before it waits; None when unknown.

    From 580.105.08 (and 580.94.06 on the 580.94 branch) nv_pci_remove() calls
    nvidia_modeset_remove(nv->gpu_id) first (kernel-open/nvidia/nv-pci.c; nv-modeset-interface.c:
    the callback's remove, nvkms_remove() in kernel-open/nvidia-modeset/nvidia-modeset-linux.c ->
    nvKmsKapiRemove() -> nvidia-drm's nv_drm_remove(), kernel-open/nvidia-drm/nvidia-drm-drv.c,
    which unplugs and frees the DRM device and with it the NVKMS device that opened the GPU).
    Read in the stored tags of NVIDIA/open-gpu-kernel-modules: present in 580.105.08, 580.119.02,
    580.126.x, 580.142, 580.94.06-580.94.18, 590.x and 595.x; absent in 580.95.05, 580.94.03 and
    older. Releases not published there (between 580.95.05 and 580.105.08) are taken as without it.
    """
    parts = re.findall(r"\d+", (version or "").strip())
    if len(parts) < 2:
        return None
    v = tuple(int(p) for p in parts[:3])
    branch = MODESET_REMOVE_BRANCHES.get((v[0], v[1]))
    return v >= branch if branch else v >= MODESET_REMOVE_FROM


def _flag(text: str | None) -> bool:
    """A bool module parameter as /sys/module/M/parameters/P prints it (Y/N, or 1/0)."""
    return (text or "").strip() in ("Y", "1")


def kernel_holders(files: dict[str, str | None], held: set[str] | dict[str, int]) -> list[str]:
    """Kernel-side users of the GPUs that no /proc/*/fd scan shows; each makes an nvidia unbind wait forever.

    `files` maps MODULE_FILES to their text (None when absent: module not loaded); `held` is every
    device file some process has open, or (better) how many processes hold each (`open_counts`).
    nv_pci_remove (open-gpu-kernel-modules kernel-open/nvidia/nv-pci.c) waits, holding the device
    lock, until the GPU's usage count drops.

    nvidia-drm with modeset=Y holds every GPU it registered at load without an open file and
    without a reference on its own module: nv_drm_register_drm_device() -> nv_drm_dev_load()
    (kernel-open/nvidia-drm/nvidia-drm-drv.c; under DRIVER_MODESET, i.e. modeset=Y) ->
    nvKms->allocateDevice() -> nvkms_open_gpu() (src/nvidia-modeset/kapi/src/nvkms-kapi.c, "Raise
    the reference count of gpu") -> nvidia_dev_get() -> nv_open_device() (kernel-open/nvidia/nv.c),
    the usage count the unbind waits on. With fbdev=Y it also takes NVKMS modeset ownership for its
    framebuffer console there; whether that console's DRM client holds a module reference depends
    on the kernel's drm_client code, so nvidia_drm's refcnt may read 0 either way and is not used.
    Whether the unbind then waits is the driver's: see `modeset_removed_on_unbind`. An unknown
    driver version (`/sys/module/nvidia/version` unreadable) counts as one that waits: a wrong
    "no" leaves an unbind blocked, holding the device lock, until reboot.

    Each open file of a module's character device holds two references on the module
    (chrdev_open() in fs/char_dev.c takes cdev_get() and fops_get()), and since driver 535.43.02
    a CUDA context opens /dev/nvidia-uvm twice (UVM_MM_INITIALIZE, open-gpu-kernel-modules
    kernel-open/nvidia-uvm/uvm_ioctl.h). With descriptor counts (`open_counts`), a uvm refcnt above
    two per descriptor is the kernel's for certain (a descriptor is at most one open file, so a
    healthy CUDA host is never refused); a bare set of files cannot tell, and only a refcnt with no
    process holding /dev/nvidia-uvm is reported. nvidia-uvm retains GPUs without an open file too
    (github.com/NVIDIA/open-gpu-kernel-modules/issues/1119 and /1374).
    """
    counts = held if isinstance(held, dict) else {f: 1 for f in held}
    out = []
    if _flag(files.get(MODESET)):
        version = (files.get(NV_VERSION) or "").strip()
        torn = modeset_removed_on_unbind(version)
        if torn is not True:
            fbdev = "fbdev=Y: its framebuffer console too" if _flag(files.get(FBDEV)) else "fbdev=N"
            drv = (
                f"driver {version} predates 580.105.08, whose unbind calls nvidia_modeset_remove() first"
                if torn is False
                else f"driver version unknown ({NV_VERSION} unreadable): before 580.105.08 the unbind waits"
            )
            out.append(
                f"nvidia_drm holds each GPU it registered through nvkms_open_gpu() (modeset=Y, {fbdev};"
                f" refcnt {_count(files.get(DRM_REFCNT))} does not count it); {drv}"
            )
    uvm = _count(files.get(UVM_REFCNT))
    fds = counts.get("/dev/nvidia-uvm", 0)
    if isinstance(held, dict) and uvm > 2 * fds:
        out.append(
            f"nvidia_uvm is in use by the kernel (refcnt {uvm}, {fds} descriptor(s) of /dev/nvidia-uvm hold"
            f" at most {2 * fds}: two references per open file)"
        )
    elif not isinstance(held, dict) and uvm > 0 and not fds:
        out.append(f"nvidia_uvm is in use by the kernel (refcnt {uvm}, no process has /dev/nvidia-uvm open)")
    return out

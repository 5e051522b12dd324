"""The dataclasses a validated lab profile is made of (built by ``gpulab.profiles.load.parse_profile``)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The ACS capability bits a profile may name (PCIe Base Spec 7.7.8, include/uapi/linux/pci_regs.h PCI_ACS_*).
ACS_BITS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans")

__all__ = [
    "Container",
    "FileTree",
    "Gpu",
    "GpuHealth",
    "GpuLink",
    "IommuInfo",
    "KernelHolder",
    "KernelLogLine",
    "LinkState",
    "NodeShape",
    "PciFunction",
    "Profile",
    "Service",
]

KERNEL_RE = re.compile(r"^(\d+)\.(\d+)")


@dataclass(frozen=True)
class LinkState:
    """PCIe link of a function, as sysfs spells it (``32.0 GT/s PCIe``, width 16)."""

    speed: str
    width: int
    max_speed: str
    max_width: int
    #: where the GPU's link trains down to while it idles (no process holds it: P8), as real GPUs'
    #: links do (nvidia-smi --help-query-gpu: "may be reduced when the GPU is not in use");
    #: None: the link keeps `speed` whatever the GPU does
    idle_speed: str | None = None


@dataclass(frozen=True)
class PciFunction:
    """One PCI function the lab's ``/sys/bus/pci`` shows."""

    bdf: str
    vendor: str
    device: str
    klass: str
    driver: str | None
    iommu_group: int | None
    numa_node: int
    parent: str | None
    link: LinkState | None
    subsystem_vendor: str
    subsystem_device: str
    acs: tuple[str, ...] | None = None
    acs_cap: tuple[str, ...] | None = None

    @property
    def is_gpu(self) -> bool:
        """Say whether this is a display-class function (VGA or 3D controller)."""
        return self.klass.startswith("0x0300") or self.klass.startswith("0x0302")


@dataclass(frozen=True)
class IommuInfo:
    """The host's IOMMU: ``intel`` (VT-d) or ``amd`` (AMD-Vi), and whether the AMD IOMMU runs SEV-SNP.

    ``snp_backport``: the kernel is a distribution kernel older than 6.9 that carries the SNP host
    support mainline got in 6.9 (a backport); without it such a kernel never enables SNP on the IOMMU.
    """

    vendor: str = "intel"
    snp: bool = False
    snp_backport: bool = False


@dataclass(frozen=True)
class KernelHolder:
    """A kernel module that holds a GPU's usage count at boot without an open file."""

    bdf: str
    module: str


@dataclass(frozen=True)
class GpuHealth:
    """Health figures nvidia-smi reports for one GPU."""

    temperature: int = 35
    ecc_uncorrected: int = 0
    ecc_corrected: int = 0
    retired_pages_pending: int = 0
    remapped_rows_failure: int = 0
    throttle_reasons: str = "0x0000000000000000"
    power_draw: float = 60.0
    nvlinks: tuple[float, ...] = ()


@dataclass(frozen=True)
class Gpu:
    """One GPU: the function at ``bdf`` and what the driver reports about it."""

    bdf: str
    minor: int
    model: str
    memory_mib: int
    uuid: str
    serial: str
    power_limit: float
    health: GpuHealth


@dataclass(frozen=True)
class GpuLink:
    """The path between two GPUs: its type and one-direction bandwidth in GB/s."""

    a: str
    b: str
    type: str
    gbps: float


@dataclass(frozen=True)
class KernelLogLine:
    """One line of the boot kernel log, ``t`` seconds after boot."""

    t: float
    msg: str


@dataclass(frozen=True)
class Container:
    """A container inside the host (Proxmox ``pct`` or plain ``lxc``)."""

    id: int
    kind: str
    name: str
    hostname: str


@dataclass(frozen=True)
class Service:
    """A process the host or one of its containers runs."""

    name: str
    where: str
    kind: str
    manager: str
    argv: tuple[str, ...]
    gpus: tuple[str, ...]
    port: int | None
    ignore_sigterm: str
    unit: Mapping[str, Any]
    enabled: bool
    log_file: str | None
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment when started by hand

    @property
    def container_id(self) -> int | None:
        """Return the container's id for ``where: container:ID``, None on the host."""
        if self.where.startswith("container:"):
            return int(self.where.split(":", 1)[1])
        return None


@dataclass(frozen=True)
class FileTree:
    """A tree the lab creates on the host with a generator from ``gpulab.host.datatrees``."""

    root: str
    generator: str


@dataclass(frozen=True)
class NodeShape:
    """What kind of machine the host is, beyond its hardware (docs/LAB-SOURCES.md, "Node shapes").

    The default is the lab's usual host: systemd as PID 1, a readable kernel log, every GPU the
    bus has, the NVIDIA driver loaded. A rented GPU container is `init: sleep` (PID 1 is `sleep
    infinity`, sshd started before it), `container: docker` (`/.dockerenv`), no systemctl or
    journalctl, `kernel_log: denied` (dmesg fails with EPERM), a read-only /sys and the GPUs in
    `visible_gpus` only (their /dev/nvidiaN; sysfs still shows every function). `nvidia_driver:
    false` is a host without the driver: no nvidia-smi, no /dev/nvidia*, no nvidia module.
    `init: tini` and `init: supervisord` are the same container under those entry points (PID 1
    reaps the orphans reparented to it; supervisord runs sshd as its program).
    """

    init: str = "systemd"
    container: str | None = None
    kernel_log: str = "readable"
    visible_gpus: tuple[str, ...] | None = None
    nvidia_driver: bool = True

    @property
    def systemd(self) -> bool:
        """Say whether systemd is PID 1 (and systemctl/journalctl are installed)."""
        return self.init == "systemd"


@dataclass(frozen=True)
class Profile:
    """A validated lab host profile; ``raw`` is the plain dict (what ``profile.json`` holds)."""

    name: str
    hostname: str
    kernel: str
    cmdline: str
    default_domain: str
    driver_version: str
    cuda_version: str
    pci: tuple[PciFunction, ...]
    gpus: tuple[Gpu, ...]
    links: tuple[GpuLink, ...]
    link_default: GpuLink | None
    kernel_log: tuple[KernelLogLine, ...]
    containers: tuple[Container, ...]
    services: tuple[Service, ...]
    files: tuple[FileTree, ...]
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)
    iommu: IommuInfo = field(default_factory=IommuInfo)
    kernel_enables_acs: bool = False
    #: the root complex routes peer requests that ACS redirected to it back down (AMD EPYC does):
    #: copies between GPUs behind a redirecting bridge pass, while NCCL collectives over such a
    #: hop hang (noonghunna/club-3090 PR #902; vllm-project/vllm#51513: root ports ReqRedir+
    #: CmpltRedir+, NCCL hangs at TP=2). gpulab_tools.Host.p2p_ok / redirected read it.
    rc_routes_redirected_p2p: bool = False
    vfio_claimed: bool = True
    kernel_holders: tuple[KernelHolder, ...] = ()
    module_params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    gsp_boot_s: float = 0.0
    #: what the node's python3 is (gpulab/host/pythons.py SHAPES): system, cpython-3.6, minimal, ...
    node_python: str = "system"
    node: NodeShape = field(default_factory=NodeShape)

    @property
    def kernel_version(self) -> tuple[int, int]:
        """Return (major, minor) of the kernel release."""
        m = KERNEL_RE.match(self.kernel)
        assert m is not None  # validated on load
        return int(m.group(1)), int(m.group(2))

    @property
    def type_era(self) -> str:
        """Return ``"eperm"`` (6.4+), ``"ebusy"`` (5.11..6.3), ``"readonly"`` (5.2..5.10) or ``"none"``.

        5.2 added ``type`` as a 0444 attribute without a store (drivers/iommu/iommu.c:
        ``IOMMU_GROUP_ATTR(type, 0444, iommu_group_show_type, NULL)``); 5.11 made it writable
        (commit 08a27c1c3ecf "iommu: Add support to change default domain of an iommu group").
        """
        v = self.kernel_version
        if v >= (6, 4):
            return "eperm"
        if v >= (5, 11):
            return "ebusy"
        if v >= (5, 2):
            return "readonly"
        return "none"

    @property
    def snp_kernel(self) -> bool:
        """Say whether this kernel can enable SEV-SNP on the AMD IOMMU at all.

        Mainline from 6.9: the SNP host setup of the x86/sev branch pulled as x86_sev_for_v6.9_rc1
        (commits 216d106c7ff7 "x86/sev: Add SEV-SNP host initialization support" and 04d65a9dbb33
        "iommu/amd: Don't rely on external callers to enable IOMMU SNP support", tip, January 2024:
        "Currently, the expectation is that the kernel will call amd_iommu_snp_enable() ... to set
        the amd_iommu_snp_en flag"; from then the IOMMU's own init does it). Before 6.9
        amd_iommu_snp_enable() had no caller in mainline (the SNP host patches were out of tree), so ``amd_iommu_snp_en`` stays false and "IOMMU SNP support enabled" is never
        printed. A distribution kernel may carry the backport: ``iommu.snp_backport``.
        """
        return self.kernel_version >= (6, 9) or self.iommu.snp_backport

    @property
    def snp_enabled(self) -> bool:
        """Say whether the AMD IOMMU runs with SEV-SNP (``amd_iommu_snp_en``).

        Needs a kernel with SNP host support (``snp_kernel``). ``iommu=pt`` turns it off:
        drivers/iommu/amd/init.c iommu_snp_enable() refuses SNP when
        ``iommu_default_passthrough()`` ("SNP: IOMMU disabled or configured in passthrough mode,
        SNP cannot be supported.").
        """
        return (
            self.iommu.vendor == "amd"
            and self.iommu.snp
            and self.snp_kernel
            and self.default_domain != "identity"
        )

    @property
    def snp_identity(self) -> str:
        """Return what writing ``identity`` to a group's ``type`` does on this SNP kernel.

        The AMD driver refuses to allocate an identity domain under SNP (commit 8388f7df936b,
        drivers/iommu/amd/iommu.c amd_iommu_domain_alloc() returns NULL); what the core makes of
        that NULL depends on the series. ``"fallback"``: 5.11 to 6.4, iommu_group_store_type() ->
        iommu_change_dev_def_domain() -> iommu_group_alloc_default_domain(), which on a NULL
        domain of another type than DMA allocates ``IOMMU_DOMAIN_DMA`` instead and only warns
        ("Failed to allocate default IOMMU domain of type %u for group %s - Falling back to
        IOMMU_DOMAIN_DMA"): the write returns success and the type reads back ``DMA``; only a
        backport-carrying distribution kernel has SNP on in this range (``snp_kernel``).
        ``"ENODEV"``: 6.5-6.10, iommu_setup_default_domain() turns the NULL domain into -ENODEV
        (6.6/6.7 read; mainline has SNP on only from 6.9). ``"ENOMEM"``: once the core passes
        allocation errors through as ERR_PTR, the same refusal reads "Cannot allocate memory"
        (quoted in commit ba17de98545d); the lab starts that at 6.11, a boundary NOT verified
        against the tree. ``"accept"``: 6.13 (commit 4402f2627d30 "iommu/amd: Implement global
        identity domain") hands out a static identity domain that skips the SNP check; the write
        succeeds and DMA then fails with ILLEGAL_DEV_TABLE_ENTRY. ``"EINVAL"``: commit
        ba17de98545d "iommu/amd: Block identity domain when SNP enabled" (7.0, stable 6.19.y)
        refuses the attach. ``profile.raw["snp_identity"]`` overrides (a distribution kernel
        may carry the fix, or not). Empty when SNP is off.
        """
        if not self.snp_enabled:
            return ""
        forced = self.raw.get("snp_identity")
        if isinstance(forced, str) and forced:
            return forced
        v = self.kernel_version
        if v >= (7, 0):
            return "EINVAL"
        if v >= (6, 13):
            return "accept"
        if v >= (6, 11):
            return "ENOMEM"
        if v >= (6, 5):
            return "ENODEV"
        return "fallback"

    @property
    def nvkms_holds_gpus(self) -> bool:
        """Say whether nvidia-drm's KMS holds every GPU bound to nvidia at boot so that its unbind waits.

        modeset=Y: nv_drm_dev_load() (kernel-open/nvidia-drm/nvidia-drm-drv.c) allocates an NVKMS
        device per GPU, whose nvkms_open_gpu() (src/nvidia-modeset/kapi/src/nvkms-kapi.c) raises the
        GPU's usage count through nvidia_dev_get() -> nv_open_device() and takes no reference on
        the nvidia_drm module. Before 580.105.08 (580.94.06 on the 580.94 branch) nv_pci_remove()
        (kernel-open/nvidia/nv-pci.c) has no nvidia_modeset_remove() call and waits for that count
        forever; from then on the unbind tears the DRM device down first. Read in the stored tags of
        NVIDIA/open-gpu-kernel-modules (580.95.05 without, 580.105.08 with).
        """
        if self.module_params.get("nvidia_drm", {}).get("modeset") != "Y":
            return False
        v = tuple(int(x) for x in re.findall(r"\d+", self.driver_version)[:3])
        return v < ((580, 94, 6) if v[:2] == (580, 94) else (580, 105, 8))

    def function(self, bdf: str) -> PciFunction:
        """Return the PCI function at ``bdf`` (KeyError when the profile has none)."""
        for f in self.pci:
            if f.bdf == bdf:
                return f
        raise KeyError(bdf)

    def gpu(self, bdf: str) -> Gpu:
        """Return the GPU at ``bdf`` (KeyError when it is not a GPU)."""
        for g in self.gpus:
            if g.bdf == bdf:
                return g
        raise KeyError(bdf)

    def link(self, a: str, b: str) -> GpuLink | None:
        """Return the link model between two GPUs (either order), or the default."""
        for lk in self.links:
            if {lk.a, lk.b} == {a, b}:
                return lk
        if self.link_default is not None:
            return GpuLink(a, b, self.link_default.type, self.link_default.gbps)
        return None

    def groups(self) -> dict[int, list[str]]:
        """Return IOMMU group number -> BDFs of its members, in profile order."""
        out: dict[int, list[str]] = {}
        for f in self.pci:
            if f.iommu_group is not None:
                out.setdefault(f.iommu_group, []).append(f.bdf)
        return out

    def to_json(self) -> str:
        """Return the profile as JSON (what lab hosts read from ``profile.json``)."""
        return json.dumps(self.raw, indent=2, sort_keys=False)

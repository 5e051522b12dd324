"""IOMMU groups: their type (DMA, DMA-FQ, identity, ...) and how to change it, per kernel era.

Facts (docs/FACTS.md, docs/LAB-SOURCES.md): `/sys/kernel/iommu_groups/N/type` exists since 5.2,
read-only (0444, no store) until 5.10: opening it for writing fails with EACCES even for root
(fs/kernfs/file.c kernfs_fop_open()); writable from 5.11 (commit 08a27c1c3ecf). From 6.4 a write
gives EPERM while `group->owner_cnt` is non-zero: a member is bound to a driver that uses the
kernel DMA API, or a user (a VM through vfio) claimed the group; drivers with
`driver_managed_dma` (vfio-pci, pci-stub, pcieport) do not count, so they stay bound, and
multi-device groups may change. From 5.11 to 6.3 a bound device gives EBUSY and a group of more
than one device gives EINVAL whatever is bound. Every write is judged by its read-back: until 6.4
a refused identity domain falls back to DMA and the write still succeeds (`set_type`).
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules.pci import PciFunction

__all__ = [
    "DRIVER_MANAGED_DMA",
    "GROUPS",
    "IommuError",
    "IommuGroup",
    "SNP_PARAM",
    "SnpFacts",
    "TypeReadBack",
    "blocks_type_change",
    "kernel_version",
    "snp_facts",
    "snp_refusal",
    "set_type",
    "type_command",
    "type_path",
]

GROUPS = "/sys/kernel/iommu_groups"
WRITABLE = ("DMA", "DMA-FQ", "identity", "auto")
# Drivers that set .driver_managed_dma: really_probe() -> dma_configure() never calls
# iommu_device_use_default_domain() for them, so from 6.4 they do not raise group->owner_cnt
# (commits 70693f470848 vfio, 18c7a349d072 pci-stub, c7d469849747 pcieport; docs/LAB-SOURCES.md).
DRIVER_MANAGED_DMA = ("vfio-pci", "pci-stub", "pcieport")
SNP_PARAM = "/sys/module/kvm_amd/parameters/sev_snp"  # KVM SNP host support (6.11+): Y when SNP is up
SNP_LINE = "AMD-Vi: IOMMU SNP support enabled"  # printed by iommu_snp_enable() whenever amd_iommu_snp_en


class _Conn(Protocol):
    name: str

    def write_file(
        self, path: str, data: str | bytes, *, timeout: float | None = None, mode: str = "w"
    ) -> Any: ...

    def call(self, op: str, **params: Any) -> Any: ...


class IommuError(GpuhostError, OSError):
    """Changing a group's type failed; str() says why and what to do."""

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


class TypeReadBack(IommuError):
    """The type write returned success but the group reads another type (`now`): the group changed."""

    def __init__(self, message: str, now: str) -> None:
        super().__init__(errno.EIO, message)
        self.now = now


def kernel_version(release: str) -> tuple[int, int]:
    """Return (major, minor) of a kernel release string such as "6.8.12-4-pve"."""
    m = re.match(r"^(\d+)\.(\d+)", release or "")
    if not m:
        raise ValueError(f"not a kernel release: {release!r}")
    return int(m.group(1)), int(m.group(2))


@dataclass
class IommuGroup:
    """One IOMMU group: its number, type and member functions."""

    number: int
    type: str | None
    members: list[PciFunction] = field(default_factory=list)

    @property
    def bound(self) -> list[PciFunction]:
        """Members that have a driver."""
        return [m for m in self.members if m.driver]

    @property
    def has_vfio(self) -> bool:
        """True when any member is on vfio-pci (the group belongs to a VM: never touch it)."""
        return any(m.driver == "vfio-pci" for m in self.members)


def type_path(group: int) -> str:
    """Return the sysfs path of a group's type file."""
    return f"{GROUPS}/{int(group)}/type"


def type_command(group: int, value: str) -> str:
    """Return the exact write `set_type` performs, as an operator would type it."""
    if value not in WRITABLE:
        raise ValueError(f"not a writable IOMMU group type: {value!r} (one of {', '.join(WRITABLE)})")
    return f"echo {value} > {type_path(group)}"


def blocks_type_change(driver: str | None, kernel: str) -> bool:
    """True when a member bound to `driver` makes a type write fail (6.4+: only DMA-API drivers count)."""
    if not driver:
        return False
    try:
        era = kernel_version(kernel)
    except ValueError:
        return True
    return era < (6, 4) or driver not in DRIVER_MANAGED_DMA


def _explain(group: IommuGroup, value: str, code: int, kernel: str) -> str:
    try:
        era = kernel_version(kernel)
    except ValueError:
        era = (6, 4)
    bound = ", ".join(f"{m.bdf} ({m.driver})" for m in group.bound) or "none seen"
    if code == errno.EPERM and era >= (6, 4):
        counted = [m for m in group.bound if m.driver not in DRIVER_MANAGED_DMA]
        vfio = [m.bdf for m in group.bound if m.driver == "vfio-pci"]
        if counted:
            why = "bound to a driver that uses the kernel DMA API: " + ", ".join(
                f"{m.bdf} ({m.driver})" for m in counted
            )
            todo = "unbind those functions first"
        elif vfio:
            why = f"no DMA-API driver is bound, so a user claimed the group: a VM holds {', '.join(vfio)} through vfio"
            todo = "this group belongs to the VM: leave it alone"
        else:
            why = f"nothing counted was seen bound (bound: {bound}): another user claimed the group (vfio, iommufd)"
            todo = "find the process holding /dev/vfio/" + str(group.number)
        return (
            f"EPERM: kernel {kernel} (6.4+) refuses while group->owner_cnt is not zero: {why} "
            f"(vfio-pci, pci-stub and pcieport never count: they manage DMA themselves); {todo}"
        )
    if code == errno.EPERM:
        return f"EPERM: a device of the group is still bound to a driver (kernel {kernel} refuses while bound): bound: {bound}"
    if code == errno.EBUSY:
        return f"EBUSY: device still bound to a driver (kernel {kernel}): bound: {bound}"
    if code == errno.EINVAL:
        if era < (6, 4) and len(group.members) > 1:
            return (
                f"EINVAL: kernel {kernel} (before 6.4) cannot change the type of a group with "
                f"{len(group.members)} devices; boot with iommu=pt, or run kernel 6.4 or later"
            )
        return f"EINVAL: the kernel does not accept {value!r} for this group"
    if code in (errno.ENODEV, errno.ENOMEM):
        return (
            f"{errno.errorcode[code]}: the IOMMU driver refused an identity domain for the group (kernel {kernel}; "
            "an AMD IOMMU with SEV-SNP refuses it this way)"
        )
    if code == errno.EACCES and (5, 2) <= era < (5, 11):
        return (
            f"EACCES: kernel {kernel} (5.2-5.10) shows the group type read-only (mode 0444, no store: the open "
            "for writing fails for root too); it is writable from 5.11 (commit 08a27c1c3ecf): boot with "
            "iommu=pt, or run kernel 5.11 or later (6.4+ for a GPU with its audio function)"
        )
    if code == errno.EACCES:
        return "EACCES: needs CAP_SYS_ADMIN and CAP_SYS_RAWIO: run as root (or --sudo)"
    if code == errno.ENOENT:
        return f"ENOENT: no {type_path(group.number)} (kernel {kernel} is older than 5.2 or the IOMMU is off)"
    return f"{errno.errorcode.get(code, str(code))}: write refused"


def set_type(conn: _Conn, group: IommuGroup, value: str, *, kernel: str, timeout: float = 10.0) -> str:
    """Write `value` to the group's type and read it back; return what the kernel reports.

    Raises IommuError with the kernel era's meaning of the errno, and TypeReadBack when the write
    returned success but the group reads another type: 5.11 to 6.4 answer a refused identity domain
    with a DMA one and no error (drivers/iommu/iommu.c iommu_change_dev_def_domain() ->
    iommu_group_alloc_default_domain(): "Falling back to IOMMU_DOMAIN_DMA"), so only the read-back
    tells. The group then has changed (DMA-FQ -> DMA): the caller puts its type back.
    """
    path = type_path(group.number)
    shown = type_command(group.number, value)  # validates value
    result = conn.write_file(path, value, timeout=timeout)
    if not result.ok:
        if result.timed_out:
            raise IommuError(
                errno.ETIMEDOUT,
                f"{conn.name}: group {group.number}: the type write did not return in {timeout:g} s",
            )
        code = result.errno or 0
        raise IommuError(
            code, f"{conn.name}: group {group.number}: {shown}: {_explain(group, value, code, kernel)}"
        )
    # a small read: bound the reply tightly so that a link lost right after the write shows fast
    entry = conn.call("read_files", paths=[path], reply_timeout=timeout).get(path) or {}
    if "data" not in entry:
        raise IommuError(
            entry.get("errno") or 0,
            f"{conn.name}: group {group.number}: read back {path}: {entry.get('error')}",
        )
    now = str(entry["data"]).strip()
    if now != value and not (value == "auto" and now):
        raise TypeReadBack(
            f"{conn.name}: group {group.number}: {shown} returned success but the group reads {now!r}, "
            f"not {value!r}: {_read_back_why(value, now, kernel)}",
            now,
        )
    return now


def _read_back_why(value: str, now: str, kernel: str) -> str:
    """Why a type write that succeeded reads back another type, for the message."""
    try:
        era = kernel_version(kernel)
    except ValueError:
        era = (0, 0)
    if value == "identity" and now == "DMA" and (5, 11) <= era < (6, 5):
        return (
            f"kernel {kernel} (5.11-6.4) fell back to a DMA domain without an error: the IOMMU driver "
            "refused an identity domain and iommu_group_alloc_default_domain() allocated IOMMU_DOMAIN_DMA "
            "instead (dmesg: 'Failed to allocate default IOMMU domain of type 4 ... Falling back to "
            "IOMMU_DOMAIN_DMA'; an AMD IOMMU with SEV-SNP refuses identity this way); the group is not identity"
        )
    return f"the kernel did not apply it (kernel {kernel}); the group is not {value}"


@dataclass
class SnpFacts:
    """What a host shows about SEV-SNP on its IOMMU (from step 1's facts)."""

    vendor: str | None  # "amd" / "intel" when the kernel log or sysfs says, else None
    snp: bool  # the AMD IOMMU runs with SNP (amd_iommu_snp_en)
    evidence: list[str] = field(default_factory=list)  # what was read, for the message
    unknown: str | None = None  # why SNP could not be decided (kernel log unreadable), else None


def _cmdline_pt(cmdline: str) -> bool:
    """`iommu=pt` only: `amd_iommu=pt` is no option of the AMD driver (parse_amd_iommu_options() in
    drivers/iommu/amd/init.c prints "AMD-Vi: Unknown option - 'pt'" and passthrough stays off)."""
    return "iommu=pt" in (cmdline or "").split()


def snp_facts(
    cmdline: str, kernel_log: str | None, sev_snp: str | None, iommu_classes: list[str]
) -> SnpFacts:
    """Decide from the kernel log, /proc/cmdline, kvm_amd's sev_snp and /sys/class/iommu whether SNP is on.

    `kernel_log` is None when it could not be read (dmesg needs root or kernel.dmesg_restrict=0).
    `iommu=pt` turns SNP off (drivers/iommu/amd/init.c iommu_snp_enable(): "SNP: IOMMU disabled
    or configured in passthrough mode, SNP cannot be supported"), so a host booted with it is not SNP,
    unless its kernel log or kvm_amd says SNP is on (the host's word wins: a wrong "off" would let
    an identity write through and lose the GPU). `amd_iommu=pt` is not an option and counts for nothing.
    """
    names = [c.rsplit("/", 1)[-1] for c in iommu_classes]
    vendor = None
    if any(n.startswith("ivhd") for n in names) or (kernel_log and "AMD-Vi:" in kernel_log):
        vendor = "amd"
    elif any(n.startswith("dmar") for n in names) or (kernel_log and "DMAR:" in kernel_log):
        vendor = "intel"
    ev = []
    if kernel_log and SNP_LINE in kernel_log:
        ev.append(f"kernel log: '{SNP_LINE}.'")
    param = (sev_snp or "").strip()
    if param in ("Y", "1"):
        vendor = vendor or "amd"
        ev.append(f"{SNP_PARAM} = {param}")
    if _cmdline_pt(cmdline) and not ev:  # the kernel's own word wins over what the command line asked
        return SnpFacts(vendor, False, ["/proc/cmdline has iommu=pt (SNP off)"])
    unknown = None
    if not ev and kernel_log is None and vendor != "intel":
        unknown = "the kernel log could not be read and kvm_amd shows no sev_snp: SEV-SNP on the IOMMU not ruled out"
    return SnpFacts(vendor, bool(ev), ev, unknown)


def _snp_outcome(kernel: str) -> str:
    """What `echo identity > type` does on an SNP-enabled AMD IOMMU in this kernel series (docs/LAB-SOURCES.md)."""
    try:
        v = kernel_version(kernel)
    except ValueError:
        return "the write is refused or, on 6.13-6.19, accepted and the GPU's DMA then fails"
    if v >= (7, 0):
        return "the write fails with EINVAL (commit ba17de98545d blocks identity domains under SNP)"
    if v >= (6, 13):
        return (
            "the write is accepted (6.13's global identity domain, commit 4402f2627d30, skips the SNP check) "
            "and the GPU's DMA then fails with ILLEGAL_DEV_TABLE_ENTRY: the GPU would be lost until reboot"
        )
    if v >= (6, 11):
        return "the write fails with ENOMEM (the identity domain allocation is refused)"
    if v >= (6, 5):
        old = (
            ""
            if v >= (6, 9)
            else " (SNP on a kernel before 6.9 is a distribution backport: this host's log says SNP)"
        )
        return "the write fails with ENODEV (amd_iommu_domain_alloc() returns no identity domain)" + old
    return (
        "the write returns success but the kernel falls back to a DMA domain (5.11-6.4: "
        "iommu_group_alloc_default_domain() 'Falling back to IOMMU_DOMAIN_DMA'), so the group reads DMA, "
        "not identity (SNP on a kernel before 6.9 is a distribution backport: this host's log says SNP)"
    )


def snp_refusal(facts: SnpFacts, kernel: str, groups: list[int]) -> str | None:
    """The reason to refuse a change to identity on an SNP host, with the operator's options; None otherwise."""
    if not facts.snp or not groups:
        return None
    nums = ", ".join(str(n) for n in groups)
    return (
        f"SEV-SNP is enabled on this host's AMD IOMMU ({'; '.join(facts.evidence)}): the kernel does not allow "
        f"identity (passthrough) domains on an SNP-enabled IOMMU ('DTE[Mode]=0 is prohibited on SNP-enabled "
        f"system', drivers/iommu/amd/iommu.c), so P2P cannot be restored by IOMMU group type here "
        f"(groups {nums}). On kernel {kernel or 'unknown'} {_snp_outcome(kernel)}. Nothing was changed. "
        "Options: (1) keep the SNP VM and move the inference GPUs to a host without SEV-SNP (costs a host move); "
        "(2) accept NCCL's SHM transport on this host (host-staged copies: lower all-reduce bandwidth, "
        "no change to the host); (3) turn SNP off for the whole host: disable SEV-SNP in the BIOS, or boot with "
        "iommu=pt (iommu_snp_enable() in drivers/iommu/amd/init.c then refuses SNP host-wide): every SEV-SNP "
        "VM on this host stops working, so neither is a fix for a host that must keep its SNP VM"
    )

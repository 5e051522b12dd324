"""The state of one lab host's PCI bus and IOMMU groups, with the kernel's rules for changing it.

``HostModel`` is what the FUSE daemon (``gpulab.kernel.sysfs``) serves. It knows which driver each
function is bound to, each function's ``driver_override``, each IOMMU group's domain type, the
nvidia minor numbers, legacy persistence mode and the nvidia driver's own state (kernel-side
holders, GSP firmware start, module use counts), and it applies the errno rules of
``drivers/base/bus.c`` and ``drivers/iommu/iommu.c`` for the profile's kernel era (see
``docs/FACTS.md`` and ``docs/LAB-SOURCES.md``). An nvidia unbind waits, like the driver's
nv_pci_remove(), until the GPU's usage count is zero: no process holds its ``/dev/nvidiaN`` and
no kernel module (nvidia-uvm, nvidia-modeset, nvidia-drm) holds it; nvidia-drm with modeset=Y
holds every GPU it found at load on drivers before 580.105.08 (``Profile.nvkms_holds_gpus``). Legacy persistence mode does
not hold it: nv_pci_remove() tears it down (rm_disable_gpu_state_persistence()). Every write is
appended to ``STATE/record.jsonl``; kernel messages go to ``STATE/kmsg`` (the lab's dmesg).
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpulab.kernel.configspace import ConfigSpace
from gpulab.kernel.kernelio import SysfsError, find_holders, open_file_counts
from gpulab.profiles.load import KERNEL_HOLDER_MODULES
from gpulab.profiles.types import PciFunction, Profile

__all__ = ["HostModel", "SysfsError", "find_holders", "DOMAIN_WRITE_VALUES"]

DOMAIN_WRITE_VALUES = ("DMA", "DMA-FQ", "identity", "auto")
POLL_S = 0.05

# Drivers the lab knows, and which functions each matches without a dynamic id or override.
_MATCHERS: dict[str, Callable[[PciFunction], bool]] = {
    "nvidia": lambda f: f.vendor == "0x10de" and f.klass[:6] in ("0x0300", "0x0302"),
    "snd_hda_intel": lambda f: f.klass[:6] == "0x0403",
    "pcieport": lambda f: f.klass[:6] == "0x0604",
    "vfio-pci": lambda f: False,  # only through new_id or driver_override
}
# Probe order: vfio-pci is loaded first (initramfs softdep), so its ids= win over nvidia.
_PROBE_ORDER = ("vfio-pci", "pcieport", "snd_hda_intel", "nvidia")
# Drivers with .driver_managed_dma = true never call iommu_device_use_default_domain(), so from
# 6.4 they do not count in group->owner_cnt (drivers/base/dd.c really_probe() -> dma_configure();
# drivers/vfio/pci/vfio_pci.c, drivers/pci/pci-stub.c, drivers/pci/pcie/portdrv.c).
DRIVER_MANAGED_DMA = frozenset({"vfio-pci", "pci-stub", "pcieport"})


@dataclass
class _Boot:
    driver: dict[str, str | None]
    override: dict[str, str | None]
    gtype: dict[int, str]
    minor: dict[str, int]


class HostModel:
    """PCI/IOMMU state of one lab host and the kernel rules for changing it."""

    def __init__(
        self,
        profile: Profile,
        state_dir: str | os.PathLike[str] | None = None,
        devdir: str | os.PathLike[str] | None = None,
        proc: str = "/proc",
    ) -> None:
        self.profile = profile
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.devdir = Path(devdir) if devdir is not None else None
        self.proc = proc
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.functions = {f.bdf: f for f in profile.pci}
        self.gpu_bdfs = [g.bdf for g in profile.gpus]
        names = {f.driver for f in profile.pci if f.driver} | {"nvidia", "vfio-pci"}
        self.drivers = sorted(names)
        self._dev_locks = {b: threading.Lock() for b in self.functions}
        self.cfg = ConfigSpace(profile, self.lock)  # lspci/setpci's view, ACS control
        self.boot = _Boot(
            driver={f.bdf: f.driver for f in profile.pci},
            # Proxmox binds a VM's devices by setting driver_override before the VM starts.
            override={f.bdf: ("vfio-pci" if f.driver == "vfio-pci" else None) for f in profile.pci},
            gtype={g: profile.default_domain for g in profile.groups()},
            minor={g.bdf: g.minor for g in profile.gpus if self._boot_driver(g.bdf) == "nvidia"},
        )
        self.reset()

    def _boot_driver(self, bdf: str) -> str | None:
        return self.profile.function(bdf).driver

    # ----------------------------------------------------------------- state

    def reset(self) -> None:
        """Put every function, group and GPU back to the profile's boot state.

        A pending nvidia unbind gives up with EINTR (the host "rebooted" under it).
        """
        with self.lock:
            self.generation = getattr(self, "generation", 0) + 1
            self.driver: dict[str, str | None] = dict(self.boot.driver)
            self.override: dict[str, str | None] = dict(self.boot.override)
            self.gtype: dict[int, str] = dict(self.boot.gtype)
            self.minor: dict[str, int] = dict(self.boot.minor)
            self.persistence: dict[str, int] = {b: 0 for b in self.gpu_bdfs}
            self.kholders: dict[str, list[str]] = {b: [] for b in self.gpu_bdfs}
            # nvidia-drm (modeset=Y) registered a DRM device for each GPU on nvidia when it loaded:
            # its nvkms_open_gpu() holds the usage count; a GPU bound later gets none (before
            # 580.105.08 there is no nvidia_modeset_probe() on bind). Profile.nvkms_holds_gpus.
            self.nvkms: set[str] = (
                {b for b in self.gpu_bdfs if self.driver.get(b) == "nvidia"}
                if self.profile.nvkms_holds_gpus
                else set()
            )
            for kh in self.profile.kernel_holders:
                if self.driver.get(kh.bdf) == "nvidia":
                    self.kholders[kh.bdf].append(kh.module)
            # GPUs bound at boot were opened by nvidia-persistenced: their firmware runs.
            self.gsp_ready: dict[str, bool] = {b: self.driver.get(b) == "nvidia" for b in self.gpu_bdfs}
            self.dma_broken: set[int] = set()
            self.dyn_ids: dict[str, list[tuple[str, str]]] = {d: [] for d in self.drivers}
            self.cfg.reset()

    # ----------------------------------------------------------------- reading

    def snapshot(self) -> dict[str, object]:
        """Return the current state as plain data (served as ``ctl/state.json``)."""
        with self.lock:
            return {
                "kernel": self.profile.kernel,
                "drivers": dict(self.driver),
                "driver_override": dict(self.override),
                "iommu_groups": {str(g): t for g, t in self.gtype.items()},
                "minors": dict(self.minor),
                "persistence": dict(self.persistence),
                "kernel_holders": {b: list(v) for b, v in self.kholders.items() if v},
                "nvkms_open": sorted(self.nvkms),
                "gsp_ready": dict(self.gsp_ready),
                "dma_broken_groups": sorted(self.dma_broken),
            }

    def group_of(self, bdf: str) -> int | None:
        """Return the IOMMU group number of a function."""
        return self.functions[bdf].iommu_group

    def group_members(self, group: int) -> list[str]:
        """Return the BDFs in an IOMMU group."""
        return [b for b, f in self.functions.items() if f.iommu_group == group]

    def bound(self, driver: str) -> list[str]:
        """Return the BDFs bound to a driver."""
        with self.lock:
            return [b for b, d in self.driver.items() if d == driver]

    def dev_path(self, bdf: str) -> Path | None:
        """Return ``DEVDIR/nvidiaN`` for a GPU bound to nvidia, else None."""
        m = self.minor.get(bdf)
        if m is None or self.devdir is None:
            return None
        return self.devdir / f"nvidia{m}"

    def holders(self, bdf: str) -> list[int]:
        """Return PIDs holding the GPU's ``/dev/nvidiaN`` open."""
        p = self.dev_path(bdf)
        if p is None:
            return []
        return find_holders([p], self.proc).get(str(p), [])

    # ----------------------------------------------------------------- record

    def record(self, path: str, value: str, err: int, pid: int | None = None, **extra: object) -> None:
        """Append one line to ``STATE/record.jsonl`` (a single O_APPEND write, so lines never mix)."""
        if self.state_dir is None:
            return
        line: dict[str, object] = {
            "t": round(time.time(), 6),
            "kind": "sysfs",
            "path": path,
            "value": value,
            "errno": err,
            "result": "ok" if err == 0 else errno.errorcode.get(err, str(err)),
        }
        if pid is not None:
            line["pid"] = pid
        line.update(extra)
        data = (json.dumps(line) + "\n").encode()
        fd = os.open(self.state_dir / "record.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    # ----------------------------------------------------------------- matching

    def matches(self, driver: str, bdf: str) -> bool:
        """Say whether ``driver`` would accept the function (pci_match_device with driver_override)."""
        f = self.functions[bdf]
        ov = self.override.get(bdf)
        if ov:
            return ov == driver
        ids = (f.vendor[2:], f.device[2:])
        if ids in self.dyn_ids.get(driver, []):
            return True
        m = _MATCHERS.get(driver)
        return bool(m and m(f))

    def _attach(self, driver: str, bdf: str) -> None:
        self.driver[bdf] = driver
        if driver == "nvidia" and bdf in self.gpu_bdfs:
            self.gsp_ready[bdf] = False
            used = set(self.minor.values())
            n = 0
            while n in used:
                n += 1
            self.minor[bdf] = n

    def _detach(self, bdf: str) -> None:
        self.driver[bdf] = None
        self.minor.pop(bdf, None)
        # nv_pci_remove(): rm_disable_gpu_state_persistence() and nv_shutdown_adapter()
        if bdf in self.persistence:
            self.persistence[bdf] = 0
            self.gsp_ready[bdf] = False

    # ----------------------------------------------------------------- writes

    def bind(self, driver: str, bdf: str) -> None:
        """``echo BDF > drivers/DRIVER/bind``: ENODEV unknown/non-matching, EBUSY already bound."""
        with self.lock:
            if bdf not in self.functions or not self.matches(driver, bdf):
                raise SysfsError(errno.ENODEV)
            if self.driver[bdf] is not None:
                raise SysfsError(errno.EBUSY)
            self._attach(driver, bdf)

    def check_unbind(self, driver: str, bdf: str) -> None:
        """Raise ENODEV unless the function is bound to ``driver`` (what unbind checks first)."""
        with self.lock:
            if bdf not in self.functions or self.driver[bdf] != driver:
                raise SysfsError(errno.ENODEV)

    def unbind(self, driver: str, bdf: str, on_wait: Callable[[], None] | None = None) -> float:
        """``echo BDF > drivers/DRIVER/unbind``; returns seconds it blocked.

        ENODEV when the function is not bound to DRIVER. For nvidia it waits (polling every 50 ms,
        without a bound, like the driver's 500 ms os_delay() loop) until no process and no kernel
        module holds the GPU; ``on_wait`` is called once when it starts waiting. Legacy
        persistence does not hold it (cleared on detach).
        """
        if bdf not in self.functions:
            raise SysfsError(errno.ENODEV)
        start = time.monotonic()
        with self._dev_locks[bdf]:
            with self.lock:
                if self.driver[bdf] != driver:
                    raise SysfsError(errno.ENODEV)
            if driver == "nvidia" and bdf in self.gpu_bdfs:
                told = False
                gen = self.generation
                while True:
                    # Scan /proc outside the lock: it takes milliseconds and reads must not wait.
                    held = bool(self.holders(bdf))
                    with self.lock:
                        if not held and not self.kholders.get(bdf) and bdf not in self.nvkms:
                            self._detach(bdf)
                            break
                    if not told:
                        # kernel-open/nvidia/nv-pci.c nv_pci_remove_helper()
                        self.kmsg(f"NVRM: Attempting to remove device {bdf} with non-zero usage count!")
                        if on_wait is not None:
                            on_wait()
                        told = True
                    if self.stopping.wait(POLL_S) or self.generation != gen:
                        raise SysfsError(errno.EINTR)
            else:
                with self.lock:
                    self._detach(bdf)
        return time.monotonic() - start

    def set_override(self, bdf: str, value: str) -> None:
        """Write ``driver_override``: a driver name, or empty to clear."""
        with self.lock:
            self.override[bdf] = value or None

    def probe(self, bdf: str) -> None:
        """``echo BDF > drivers_probe``: bind the first matching driver if unbound (none is fine)."""
        with self.lock:
            if bdf not in self.functions:
                raise SysfsError(errno.ENODEV)
            if self.driver[bdf] is not None:
                return
            ov = self.override.get(bdf)
            if ov:
                if ov in self.drivers:
                    self._attach(ov, bdf)
                return
            for d in _PROBE_ORDER:
                if d in self.drivers and self.matches(d, bdf):
                    self._attach(d, bdf)
                    return

    def new_id(self, driver: str, value: str) -> None:
        """``echo "10de 2bb5" > drivers/DRIVER/new_id``: add a dynamic id and probe unbound matches."""
        parts = value.split()
        if len(parts) < 2 or not all(_is_hex(p) for p in parts[:2]):
            raise SysfsError(errno.EINVAL)
        ids = (f"{int(parts[0], 16):04x}", f"{int(parts[1], 16):04x}")
        with self.lock:
            if ids in self.dyn_ids[driver]:
                raise SysfsError(errno.EEXIST)
            self.dyn_ids[driver].append(ids)
            for bdf in self.functions:
                if self.driver[bdf] is None and self.matches(driver, bdf):
                    self._attach(driver, bdf)

    def remove_id(self, driver: str, value: str) -> None:
        """``echo "10de 2bb5" > drivers/DRIVER/remove_id``: ENODEV when not present."""
        parts = value.split()
        if len(parts) < 2 or not all(_is_hex(p) for p in parts[:2]):
            raise SysfsError(errno.EINVAL)
        ids = (f"{int(parts[0], 16):04x}", f"{int(parts[1], 16):04x}")
        with self.lock:
            if ids not in self.dyn_ids[driver]:
                raise SysfsError(errno.ENODEV)
            self.dyn_ids[driver].remove(ids)

    def set_group_type(self, group: int, value: str) -> None:
        """Write ``iommu_groups/N/type`` with the kernel era's rules (see module docstring).

        6.4+: iommu_group_store_type() refuses with EPERM while ``group->owner_cnt`` is non-zero:
        a driver that uses the kernel DMA API is bound (not one in DRIVER_MANAGED_DMA), or a user
        claimed the group (a running VM holds its vfio group: iommu_group_claim_dma_owner()). On
        an SNP-enabled AMD IOMMU an identity request then fails or is accepted per
        ``Profile.snp_identity``; an accepted one breaks the group's DMA.
        """
        era = self.profile.type_era
        if era in ("none", "readonly"):
            # kernfs_fop_open(): a 0444 attribute without store opened for write is EACCES
            raise SysfsError(errno.EACCES)
        if value not in DOMAIN_WRITE_VALUES:
            raise SysfsError(errno.EINVAL)
        if value == "DMA-FQ" and self.profile.kernel_version < (5, 15):
            raise SysfsError(errno.EINVAL)
        with self.lock:
            cur = self.gtype[group]
            members = self.group_members(group)
            bound = any(self.driver[b] is not None for b in members)
            new = self.profile.default_domain if value == "auto" else value
            if era == "eperm":
                # 6.4+: a flush queue can be brought up under a bound driver; anything else
                # needs group->owner_cnt == 0.
                if value == "DMA-FQ" and cur == "DMA":
                    self.gtype[group] = "DMA-FQ"
                    return
                if self.owner_cnt(group):
                    raise SysfsError(errno.EPERM)
                if new == "identity" and self.profile.snp_enabled:
                    new = self._snp_identity(group)
                self.gtype[group] = new
                return
            # 5.11 .. 6.3
            if len(members) != 1:
                raise SysfsError(errno.EINVAL, "Group has more than one device")
            if bound and not (value == "DMA-FQ" and cur == "DMA"):
                raise SysfsError(errno.EBUSY, "Device is still bound to driver")
            if new == "identity" and self.profile.snp_enabled:
                new = self._snp_identity(group)
            self.gtype[group] = new

    def owner_cnt(self, group: int) -> int:
        """Return the group's ``owner_cnt`` (6.4+): DMA-API drivers bound plus a claiming VM."""
        with self.lock:
            n = 0
            for b in self.group_members(group):
                d = self.driver[b]
                if d is None:
                    continue
                if d not in DRIVER_MANAGED_DMA:
                    n += 1
                elif d == "vfio-pci" and self.profile.vfio_claimed:
                    n += 1
            return n

    def _snp_identity(self, group: int) -> str:
        """Apply the SNP rule for an identity request on ``group``; return the type the group gets.

        Called with the lock held; raises the errno of a refusal.
        """
        how = self.profile.snp_identity
        if how == "accept":
            # 6.13 .. 7.0: the static identity domain attaches; DTE[Mode]=0 is then refused by
            # the SNP IOMMU on the first DMA (commit ba17de98545d's log).
            self.dma_broken.add(group)
            return "identity"
        if how == "fallback":
            # 5.11 .. 6.4: iommu_group_alloc_default_domain() allocates IOMMU_DOMAIN_DMA when the
            # driver returns no domain of the requested type, warns, and the write succeeds. The
            # type is IOMMU_DOMAIN_IDENTITY (__IOMMU_DOMAIN_PT, 4); a PCI group has no name.
            self.kmsg(
                "iommu: Failed to allocate default IOMMU domain of type 4 for group (null) - "
                "Falling back to IOMMU_DOMAIN_DMA"
            )
            return "DMA"
        raise SysfsError({"ENOMEM": errno.ENOMEM, "EINVAL": errno.EINVAL}.get(how, errno.ENODEV))

    def set_persistence(self, bdf: str, value: str) -> None:
        """Write ``ctl/persistence/BDF`` (legacy persistence mode): 0 or 1; EINVAL else."""
        if value not in ("0", "1"):
            raise SysfsError(errno.EINVAL)
        with self.lock:
            if self.driver.get(bdf) != "nvidia":
                raise SysfsError(errno.ENODEV)
            self.persistence[bdf] = int(value)

    # ----------------------------------------------------------------- the nvidia driver

    def kmsg(self, msg: str) -> None:
        """Append a kernel message to ``STATE/kmsg`` (printed by the lab's dmesg)."""
        if self.state_dir is None:
            return
        data = (json.dumps({"epoch": round(time.time(), 6), "msg": msg}) + "\n").encode()
        fd = os.open(self.state_dir / "kmsg", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def set_kernel_holders(self, bdf: str, value: str) -> None:
        """Write ``ctl/kernel_holders/BDF``: ``MODULE`` adds a kernel-side holder, ``-MODULE``
        drops it, empty drops all (a fault option: what nvidia-uvm/-modeset/-drm do, issues
        #1119 and #1374). ENODEV unless the GPU is bound to nvidia; EINVAL for other names."""
        name = value.lstrip("-")
        if name and name not in KERNEL_HOLDER_MODULES:
            raise SysfsError(errno.EINVAL)
        with self.lock:
            if self.driver.get(bdf) != "nvidia":
                raise SysfsError(errno.ENODEV)
            cur = self.kholders[bdf]
            if not value:
                cur.clear()
            elif value.startswith("-"):
                if name in cur:
                    cur.remove(name)
            elif name not in cur:
                cur.append(name)

    def first_open(self, bdf: str) -> float:
        """Open the GPU like a first client does: start its GSP firmware if it is not running.

        nv_open_device() -> nv_start_device() -> rm_init_adapter() boots GSP-RM on the first open
        after a bind (or after the last client left, without persistence); this takes
        ``profile.gsp_boot_s`` seconds. In a group whose identity domain an SNP IOMMU refuses,
        the firmware's DMA faults and the open fails with EIO. Returns the seconds it took.
        """
        with self.lock:
            if self.driver.get(bdf) != "nvidia":
                raise SysfsError(errno.ENODEV)
            if self.gsp_ready[bdf]:
                return 0.0
            group = self.group_of(bdf)
            broken = group in self.dma_broken
        if broken:
            # the event format of drivers/iommu/amd/iommu.c iommu_print_event(), as quoted in
            # commit ba17de98545d; then nv_start_device(): rm_init_adapter() fails and the open
            # returns -EIO with "rm_init_adapter failed, device minor number %d" (kernel-open/
            # nvidia/nv.c; the "NVRM: GPU BDF: " prefix of NV_DEV_PRINTF is from memory)
            self.kmsg(
                f"iommu ivhd0: AMD-Vi: Event logged [ILLEGAL_DEV_TABLE_ENTRY device={bdf[5:]} "
                "pasid=0x00000 address=0x3737b01000 flags=0x0020]"
            )
            minor = self.minor.get(bdf, 0)
            self.kmsg(f"NVRM: GPU {bdf}: rm_init_adapter failed, device minor number {minor}")
            raise SysfsError(errno.EIO)
        start = time.monotonic()
        if self.stopping.wait(self.profile.gsp_boot_s):
            raise SysfsError(errno.EINTR)
        with self.lock:
            if self.driver.get(bdf) == "nvidia":
                self.gsp_ready[bdf] = True
        return time.monotonic() - start

    def module_refcnt(self) -> dict[str, int]:
        """Return the use count of each NVIDIA module (``/sys/module/M/refcnt``, /proc/modules).

        nvidia_uvm: kernel-side retains plus two per open file of ``/dev/nvidia-uvm``; nvidia_drm:
        the holds named ``nvidia_drm`` (profile, ``ctl/kernel_holders``); its KMS hold through
        nvkms_open_gpu() (``HostModel.nvkms``) takes no module reference and counts nowhere;
        nvidia_modeset: nvidia_drm plus its own holds;
        nvidia: its two dependent modules plus two per open file of any ``/dev/nvidiaN``.
        """
        with self.lock:
            held = {
                m: sum(m in v for v in self.kholders.values())
                for m in ("nvidia_uvm", "nvidia_drm", "nvidia_modeset")
            }
            paths = [p for b in self.gpu_bdfs if (p := self.dev_path(b)) is not None]
        uvm = [self.devdir / "nvidia-uvm"] if self.devdir is not None else []
        # two references per open file, as chrdev_open() takes them (cdev_get, fops_get)
        found = open_file_counts([*paths, *uvm], self.proc)
        uvm_users = 2 * found.get(str(uvm[0]), 0) if uvm else 0
        gpu_users = 2 * sum(v for k, v in found.items() if not k.endswith("nvidia-uvm"))
        return {
            "nvidia_uvm": held["nvidia_uvm"] + uvm_users,
            "nvidia_drm": held["nvidia_drm"],
            "nvidia_modeset": 1 + held["nvidia_modeset"],
            "nvidia": 2 + gpu_users,
        }


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True

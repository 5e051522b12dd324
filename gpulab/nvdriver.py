"""NVIDIA driver state of the lab's GPUs: kernel-side holders, firmware start, module use counts.

A mixin of ``gpulab.model.HostModel``. Sources are cited beside each rule and tabled in
docs/LAB-SOURCES.md.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

from gpulab.kernelio import SysfsError, open_file_counts
from gpulab.profile import KERNEL_HOLDER_MODULES, Profile

__all__ = ["NvidiaDriverMixin"]


class NvidiaDriverMixin:
    """Driver-side state; expects the HostModel attributes annotated below."""

    profile: Profile
    lock: threading.RLock
    stopping: threading.Event
    state_dir: Path | None
    devdir: Path | None
    proc: str
    gpu_bdfs: list[str]
    driver: dict[str, str | None]
    kholders: dict[str, list[str]]
    gsp_ready: dict[str, bool]
    dma_broken: set[int]
    minor: dict[str, int]

    def dev_path(self, bdf: str) -> Path | None:  # provided by HostModel
        raise NotImplementedError

    def group_of(self, bdf: str) -> int | None:  # provided by HostModel
        raise NotImplementedError

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

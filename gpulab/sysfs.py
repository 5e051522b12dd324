"""FUSE daemon that serves a lab host's ``/sys/bus/pci``, ``/sys/kernel/iommu_groups`` and ctl files.

Run: ``python -m gpulab.sysfs --profile FILE --state DIR --mount DIR --devdir DIR`` (foreground).
The mount has three subtrees that the lab binds into the host: ``pci/`` over ``/sys/bus/pci``,
``iommu_groups/`` over ``/sys/kernel/iommu_groups`` and ``ctl/`` over ``/var/lib/gpulab/ctl``.
Symlinks are relative like the kernel's and resolve inside the host (``devices/BDF/driver ->
../../../../bus/pci/drivers/nvidia``). Reads always reach the model (``direct_io``); writes raise
the kernel's errno and are recorded with the host path in ``STATE/record.jsonl``.

``ctl/``: ``persistence/BDF`` (legacy persistence mode, 0/1), ``minor/BDF`` (current nvidia minor),
``kernel_holders/BDF`` (kernel modules holding the GPU: write ``nvidia_uvm`` to add, ``-nvidia_uvm``
to drop, empty to clear), ``gsp/BDF`` (1 when the GPU's firmware runs; write ``open`` to open the
GPU as a first client does, which waits for the firmware to boot), ``state.json`` (the whole
model), ``reset`` (write 1: back to the profile's boot state).

Two more subtrees are for the lab to bind over the host's own: ``module/`` over ``/sys/module``
(the NVIDIA modules with ``refcnt``, ``initstate``, ``holders/`` and ``parameters/``, plus any module
of the profile's ``module_params``, e.g. ``kvm_amd/parameters/sev_snp``) and ``proc/modules`` over
``/proc/modules``. GPUs bound to nvidia show ``drm/cardN`` and ``drm/renderD(128+N)`` when
nvidia_drm has ``modeset=Y``, as drm_dev_register() makes them.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import itertools
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mfusepy

from gpulab import realkernel
from gpulab.model import HostModel, SysfsError
from gpulab.profile import ProfileError, default_domain_for, load_profile

__all__ = ["StandaloneMount", "SysfsOps", "main"]

HOST_PREFIX = {
    "pci": "/sys/bus/pci",
    "iommu_groups": "/sys/kernel/iommu_groups",
    "ctl": "/var/lib/gpulab/ctl",
    "module": "/sys/module",
    "proc": "/proc",
}
NVIDIA_MODULES = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm")
# who uses whom, as /sys/module/M/holders/ and /proc/modules list it
MODULE_USERS = {"nvidia": ["nvidia_uvm", "nvidia_modeset"], "nvidia_modeset": ["nvidia_drm"]}
SYS = (
    "../../../.."  # from /sys/bus/pci/devices/BDF, /sys/bus/pci/drivers/X, /sys/kernel/iommu_groups/N/devices
)


@dataclass
class Node:
    """One entry of the tree: a directory, an attribute file or a symlink."""

    kind: str  # dir | file | link
    mode: int = 0o444
    read: Callable[[], str] | None = None
    write: Callable[[str], None] | None = None
    target: str = ""
    children: Callable[[], list[str]] = field(default=lambda: [])
    read_bin: Callable[[], bytes] | None = None
    write_bin: Callable[[bytes, int], None] | None = None


def _ro(fn: Callable[[], str]) -> Node:
    return Node("file", 0o444, read=fn)


def _rw(fn: Callable[[], str], w: Callable[[str], None]) -> Node:
    return Node("file", 0o644, read=fn, write=w)


def _wo(w: Callable[[str], None]) -> Node:
    return Node("file", 0o200, write=w)


def _dir(names: Callable[[], list[str]]) -> Node:
    return Node("dir", 0o755, children=names)


def _link(target: str) -> Node:
    return Node("link", 0o777, target=target)


def _noop(_v: str) -> None:
    return None


def _refuse(_v: str) -> None:
    # removing a device from the bus is not something the lab lets anyone rehearse
    raise SysfsError(errno.EPERM)


class SysfsOps(mfusepy.Operations):
    """mfusepy operations over a HostModel."""

    use_ns = True

    def __init__(self, model: HostModel) -> None:
        self.model = model
        self.t0 = int(time.time() * 1e9)
        self._fuse_ptr: int | None = None
        self._watch: threading.Thread | None = None
        self._tls = threading.local()
        self._fh = itertools.count(1)
        self._pending: dict[int, tuple[str, str, int | None]] = {}
        self._pending_lock = threading.Lock()

    # ------------------------------------------------------------ tree

    def lookup(self, path: str) -> Node:
        """Return the node at ``path`` (as FUSE passes it, starting with /), or raise ENOENT."""
        parts = [p for p in path.split("/") if p]
        node = self._lookup(parts)
        if node is None:
            raise mfusepy.FuseOSError(errno.ENOENT)
        return node

    def _lookup(self, p: list[str]) -> Node | None:
        m = self.model
        if not p:
            return _dir(lambda: ["pci", "iommu_groups", "ctl", "module", "proc"])
        top, rest = p[0], p[1:]
        if top == "pci":
            return self._pci(rest)
        if top == "iommu_groups":
            return self._groups(rest)
        if top == "ctl":
            return self._ctl(rest)
        if top == "module":
            return self._modules(rest)
        if top == "proc":
            if not rest:
                return _dir(lambda: ["modules"])
            if rest == ["modules"]:
                return _ro(lambda: realkernel.proc_modules(m.module_refcnt(), MODULE_USERS))
        return None

    def _module_names(self) -> list[str]:
        return sorted({*NVIDIA_MODULES, *self.model.profile.module_params})

    def _modules(self, p: list[str]) -> Node | None:
        m = self.model
        if not p:
            return _dir(self._module_names)
        name, rest = p[0], p[1:]
        if name not in self._module_names():
            return None
        params = dict(m.profile.module_params.get(name, {}))
        if not rest:
            kids = ["parameters"] if params else []
            if name in NVIDIA_MODULES:
                kids += ["refcnt", "initstate", "holders"]
            return _dir(lambda: kids)
        if len(rest) == 1 and name in NVIDIA_MODULES:
            if rest[0] == "refcnt":
                return _ro(lambda: f"{m.module_refcnt()[name]}\n")
            if rest[0] == "initstate":
                return _ro(lambda: "live\n")
            if rest[0] == "holders":
                return _dir(lambda: list(MODULE_USERS.get(name, [])))
        if rest[0] == "holders" and len(rest) == 2 and rest[1] in MODULE_USERS.get(name, []):
            return _link(f"../../{rest[1]}")
        if rest[0] == "parameters" and params:
            if len(rest) == 1:
                return _dir(lambda: sorted(params))
            if len(rest) == 2 and rest[1] in params:
                val = params[rest[1]]
                return _ro(lambda: val + "\n")
        return None

    def _pci(self, p: list[str]) -> Node | None:
        m = self.model
        if not p:
            return _dir(
                lambda: [
                    "devices",
                    "drivers",
                    "drivers_autoprobe",
                    "drivers_probe",
                    "rescan",
                    "resource_alignment",
                    "slots",
                    "uevent",
                ]
            )
        name, rest = p[0], p[1:]
        if name == "devices":
            if not rest:
                return _dir(lambda: sorted(m.functions))
            if rest[0] not in m.functions:
                return None
            return self._device(rest[0], rest[1:])
        if name == "drivers":
            if not rest:
                return _dir(lambda: list(m.drivers))
            if rest[0] not in m.drivers:
                return None
            return self._driver(rest[0], rest[1:])
        if rest:
            return None
        simple: dict[str, Node] = {
            "drivers_autoprobe": _rw(lambda: "1\n", _noop),
            "drivers_probe": _wo(m.probe),
            "rescan": _wo(_noop),
            "resource_alignment": _rw(lambda: "\n", _noop),
            "slots": _dir(lambda: []),
            "uevent": _wo(_noop),
        }
        return simple.get(name)

    def _device(self, bdf: str, p: list[str]) -> Node | None:
        m = self.model
        f = m.functions[bdf]
        attrs: dict[str, Node] = {
            "vendor": _ro(lambda: f.vendor + "\n"),
            "device": _ro(lambda: f.device + "\n"),
            "subsystem_vendor": _ro(lambda: f.subsystem_vendor + "\n"),
            "subsystem_device": _ro(lambda: f.subsystem_device + "\n"),
            "class": _ro(lambda: f.klass + "\n"),
            "revision": _ro(lambda: "0xa1\n"),
            "numa_node": _ro(lambda: f"{f.numa_node}\n"),
            "enable": _ro(lambda: "1\n" if m.driver[bdf] else "0\n"),
            "modalias": _ro(
                lambda: (
                    f"pci:v0000{f.vendor[2:].upper()}d0000{f.device[2:].upper()}"
                    f"sv0000{f.subsystem_vendor[2:].upper()}sd0000{f.subsystem_device[2:].upper()}"
                    f"bc{f.klass[2:4].upper()}sc{f.klass[4:6].upper()}i{f.klass[6:8].upper()}\n"
                )
            ),
            "uevent": _rw(lambda: self._uevent(bdf), _noop),
            "driver_override": _rw(
                lambda: (m.override.get(bdf) or "(null)") + "\n", lambda v: m.set_override(bdf, v)
            ),
            "reset": _wo(_noop),
            "remove": _wo(_refuse),
            "subsystem": _link(f"{SYS}/bus/pci"),
            "config": Node(
                "file",
                0o644,
                read_bin=lambda: bytes(m.config[bdf]),
                write_bin=lambda data, off: m.config_write(bdf, off, data),
            ),
        }
        if f.klass.startswith("0x0604"):
            sec, sub = m.bus_range(bdf)
            attrs["secondary_bus_number"] = _ro(lambda: f"{sec}\n")
            attrs["subordinate_bus_number"] = _ro(lambda: f"{sub}\n")
        if f.link is not None:
            lk = f.link
            attrs.update(
                {
                    "current_link_speed": _ro(lambda: lk.speed + "\n"),
                    "current_link_width": _ro(lambda: f"{lk.width}\n"),
                    "max_link_speed": _ro(lambda: lk.max_speed + "\n"),
                    "max_link_width": _ro(lambda: f"{lk.max_width}\n"),
                }
            )
        if f.iommu_group is not None:
            attrs["iommu_group"] = _link(f"{SYS}/kernel/iommu_groups/{f.iommu_group}")
        drv = m.driver.get(bdf)
        if drv:
            attrs["driver"] = _link(f"{SYS}/bus/pci/drivers/{drv}")
        drm = self._drm_nodes(bdf)
        if drm:
            attrs["drm"] = _dir(lambda: drm)
        if not p:
            return _dir(lambda: sorted(self._device_names(bdf)))
        if len(p) == 1:
            return attrs.get(p[0])
        if len(p) == 2 and p[0] == "drm" and p[1] in drm:
            return _dir(lambda: ["dev", "uevent"])
        if len(p) == 3 and p[0] == "drm" and p[1] in drm and p[2] in ("dev", "uevent"):
            major_minor = f"226:{int(p[1].removeprefix('card').removeprefix('renderD'))}"
            if p[2] == "dev":
                return _ro(lambda: major_minor + "\n")
            return _ro(lambda: f"MAJOR=226\nMINOR={major_minor[4:]}\nDEVNAME=dri/{p[1]}\nDEVTYPE=drm_minor\n")
        return None

    def _drm_nodes(self, bdf: str) -> list[str]:
        """Return ``cardN``/``renderD(128+N)`` of a GPU that nvidia-drm registered (modeset=Y)."""
        m = self.model
        if m.profile.module_params.get("nvidia_drm", {}).get("modeset") != "Y":
            return []
        n = m.minor.get(bdf)
        if n is None or m.driver.get(bdf) != "nvidia":
            return []
        return [f"card{n}", f"renderD{128 + n}"]

    def _device_names(self, bdf: str) -> list[str]:
        node_names = [
            "vendor",
            "device",
            "subsystem_vendor",
            "subsystem_device",
            "class",
            "revision",
            "numa_node",
            "enable",
            "modalias",
            "uevent",
            "driver_override",
            "reset",
            "remove",
            "subsystem",
            "config",
        ]
        f = self.model.functions[bdf]
        if f.klass.startswith("0x0604"):
            node_names += ["secondary_bus_number", "subordinate_bus_number"]
        if f.link is not None:
            node_names += ["current_link_speed", "current_link_width", "max_link_speed", "max_link_width"]
        if f.iommu_group is not None:
            node_names.append("iommu_group")
        if self.model.driver.get(bdf):
            node_names.append("driver")
        if self._drm_nodes(bdf):
            node_names.append("drm")
        return node_names

    def _uevent(self, bdf: str) -> str:
        f = self.model.functions[bdf]
        lines = []
        drv = self.model.driver.get(bdf)
        if drv:
            lines.append(f"DRIVER={drv}")
        lines += [
            f"PCI_CLASS={int(f.klass, 16):X}",
            f"PCI_ID={f.vendor[2:].upper()}:{f.device[2:].upper()}",
            f"PCI_SUBSYS_ID={f.subsystem_vendor[2:].upper()}:{f.subsystem_device[2:].upper()}",
            f"PCI_SLOT_NAME={bdf}",
        ]
        return "\n".join(lines) + "\n"

    def _driver(self, drv: str, p: list[str]) -> Node | None:
        m = self.model
        if not p:
            return _dir(lambda: ["bind", "unbind", "new_id", "remove_id", "uevent", "module", *m.bound(drv)])
        if len(p) > 1:
            return None
        name = p[0]
        if name in m.functions:
            return _link(f"{SYS}/bus/pci/devices/{name}") if m.driver.get(name) == drv else None
        nodes: dict[str, Node] = {
            "bind": _wo(lambda v: m.bind(drv, v)),
            "unbind": _wo(lambda v: self._unbind(drv, v)),
            "new_id": _wo(lambda v: m.new_id(drv, v)),
            "remove_id": _wo(lambda v: m.remove_id(drv, v)),
            "uevent": _wo(_noop),
            "module": _link(f"{SYS}/module/{drv.replace('-', '_')}"),
        }
        return nodes.get(name)

    def _unbind(self, drv: str, bdf: str) -> None:
        if drv == "nvidia" and bdf in self.model.gpu_bdfs:
            # Validate now (ENODEV comes from write), wait in flush: the kernel holds the FUSE
            # file's inode lock for the whole write, which would also stall every other writer
            # of this attribute; kernfs has no such lock. The writer still blocks, in close().
            self.model.check_unbind(drv, bdf)
            self._tls.defer = bdf
            return
        self.model.unbind(drv, bdf)

    def _finish_unbind(self, fh: int) -> None:
        with self._pending_lock:
            job = self._pending.pop(fh, None)
        if job is None:
            return
        bdf, host_path, pid = job
        blocked: list[bool] = []

        def on_wait() -> None:
            blocked.append(True)
            self.model.record(host_path, bdf, 0, pid, result="blocked")

        try:
            waited = self.model.unbind("nvidia", bdf, on_wait=on_wait)
        except SysfsError as e:
            assert e.errno is not None
            self.model.record(host_path, bdf, e.errno, pid)
            raise mfusepy.FuseOSError(e.errno) from None
        extra = {"blocked_s": round(waited, 3)} if blocked else {}
        self.model.record(host_path, bdf, 0, pid, **extra)

    def _groups(self, p: list[str]) -> Node | None:
        m = self.model
        if not p:
            return _dir(lambda: [str(g) for g in sorted(m.gtype)])
        try:
            g = int(p[0])
        except ValueError:
            return None
        if g not in m.gtype or str(g) != p[0]:
            return None
        rest = p[1:]
        if not rest:
            names = ["devices", "reserved_regions"] + ([] if m.profile.type_era == "none" else ["type"])
            return _dir(lambda: names)
        if rest[0] == "type" and len(rest) == 1:
            era = m.profile.type_era
            if era == "none":
                return None  # before 5.2 there is no type attribute
            if era == "readonly":
                # 5.2..5.10: IOMMU_GROUP_ATTR(type, 0444, iommu_group_show_type, NULL); no DMA-FQ yet
                return _ro(lambda: ("DMA" if m.gtype[g] == "DMA-FQ" else m.gtype[g]) + "\n")
            return _rw(lambda: m.gtype[g] + "\n", lambda v: m.set_group_type(g, v))
        if rest[0] == "reserved_regions" and len(rest) == 1:
            return _ro(lambda: "0x00000000fee00000 0x00000000feefffff msi\n")
        if rest[0] == "devices":
            if len(rest) == 1:
                return _dir(lambda: m.group_members(g))
            if len(rest) == 2 and rest[1] in m.group_members(g):
                return _link(f"{SYS}/bus/pci/devices/{rest[1]}")
        return None

    def _ctl(self, p: list[str]) -> Node | None:
        m = self.model
        if not p:
            return _dir(lambda: ["gsp", "kernel_holders", "minor", "persistence", "reset", "state.json"])
        name, rest = p[0], p[1:]
        if name in ("kernel_holders", "gsp"):
            if not rest:
                return _dir(lambda: list(m.gpu_bdfs))
            b = rest[0]
            if len(rest) != 1 or b not in m.gpu_bdfs:
                return None
            if name == "kernel_holders":
                return _rw(lambda: " ".join(m.kholders[b]) + "\n", lambda v: m.set_kernel_holders(b, v))
            return _rw(lambda: f"{int(m.gsp_ready[b])}\n", lambda v: self._gsp_open(b, v))
        if name == "persistence":
            if not rest:
                return _dir(lambda: list(m.gpu_bdfs))
            b = rest[0]
            if len(rest) == 1 and b in m.gpu_bdfs:
                return _rw(lambda: f"{m.persistence[b]}\n", lambda v: m.set_persistence(b, v))
            return None
        if name == "minor":
            if not rest:
                return _dir(lambda: sorted(m.minor))
            b = rest[0]
            if len(rest) == 1 and b in m.minor:
                return _ro(lambda: f"{m.minor.get(b, '')}\n")
            return None
        if rest:
            return None
        if name == "reset":
            return _rw(lambda: "0\n", self._reset)
        if name == "state.json":
            return _ro(lambda: json.dumps(m.snapshot(), indent=1) + "\n")
        return None

    def _gsp_open(self, bdf: str, v: str) -> None:
        if v != "open":
            raise SysfsError(errno.EINVAL)
        self.model.first_open(bdf)

    def _reset(self, v: str) -> None:
        if v != "1":
            raise SysfsError(errno.EINVAL)
        self.model.reset()

    # ------------------------------------------------------------ fuse ops

    def _uid(self) -> int:
        try:
            return int(mfusepy.fuse_get_context()[0])
        except Exception:
            return 0

    def _pid(self) -> int | None:
        try:
            return int(mfusepy.fuse_get_context()[2])
        except Exception:
            return None

    def init(self, path: str) -> None:
        # Watch for libfuse's own exit (SIGTERM/SIGINT, fusermount -u) so a blocked nvidia
        # unbind gives up and libfuse can join its workers instead of hanging.
        try:
            lib = mfusepy._libfuse  # type: ignore[attr-defined]
            lib.fuse_get_session.restype = ctypes.c_void_p
            lib.fuse_get_session.argtypes = [ctypes.c_void_p]
            lib.fuse_session_exited.argtypes = [ctypes.c_void_p]
            fuse_ptr = ctypes.c_void_p(lib.fuse_get_context().contents.fuse)
            se = lib.fuse_get_session(fuse_ptr)
        except Exception:
            return

        def watch() -> None:
            while not self.model.stopping.is_set():
                if lib.fuse_session_exited(se):
                    self.model.stopping.set()
                    return
                time.sleep(0.1)

        self._watch = threading.Thread(target=watch, name="fuse-exit-watch", daemon=True)
        self._watch.start()

    def destroy(self, path: str) -> None:
        self.model.stopping.set()

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        node = self.lookup(path)
        base = {"st_uid": 0, "st_gid": 0, "st_atime": self.t0, "st_mtime": self.t0, "st_ctime": self.t0}
        if node.kind == "dir":
            return {**base, "st_mode": stat.S_IFDIR | node.mode, "st_nlink": 2, "st_size": 0}
        if node.kind == "link":
            return {**base, "st_mode": stat.S_IFLNK | 0o777, "st_nlink": 1, "st_size": len(node.target)}
        return {**base, "st_mode": stat.S_IFREG | node.mode, "st_nlink": 1, "st_size": 4096}

    def readdir(self, path: str, fh: Any) -> list[str]:
        node = self.lookup(path)
        if node.kind != "dir":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        return [".", "..", *node.children()]

    def readlink(self, path: str) -> str:
        node = self.lookup(path)
        if node.kind != "link":
            raise mfusepy.FuseOSError(errno.EINVAL)
        return node.target

    def open(self, path: str, flags: int) -> int:
        node = self.lookup(path)
        if node.kind == "dir":
            raise mfusepy.FuseOSError(errno.EISDIR)
        acc = flags & os.O_ACCMODE
        if acc in (os.O_WRONLY, os.O_RDWR) and node.write is None and node.write_bin is None:
            raise mfusepy.FuseOSError(errno.EACCES)
        if acc in (os.O_WRONLY, os.O_RDWR) and self._uid() != 0:
            # sysfs attributes are root's 0644/0200 files (and type wants CAP_SYS_ADMIN)
            raise mfusepy.FuseOSError(errno.EACCES)
        if acc in (os.O_RDONLY, os.O_RDWR) and node.read is None and node.read_bin is None:
            raise mfusepy.FuseOSError(errno.EACCES)
        return next(self._fh)

    def flush(self, path: str, fh: Any) -> int:
        self._finish_unbind(int(fh))
        return 0

    def release(self, path: str, fh: Any) -> int:
        try:
            self._finish_unbind(int(fh))
        except mfusepy.FuseOSError:
            pass
        return 0

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        node = self.lookup(path)
        if node.read_bin is not None:
            data = node.read_bin()
            if self._uid() != 0:
                data = data[:64]  # like the kernel: only the standard header without CAP_SYS_ADMIN
            return data[offset : offset + size]
        if node.read is None:
            raise mfusepy.FuseOSError(errno.EACCES)
        data = node.read().encode()
        return data[offset : offset + size]

    def truncate(self, path: str, length: int, fh: Any = None) -> int:
        self.lookup(path)
        return 0

    def write(self, path: str, data: bytes, offset: int, fh: Any) -> int:
        node = self.lookup(path)
        parts = [p for p in path.split("/") if p]
        host_path = HOST_PREFIX.get(parts[0], "") + "/" + "/".join(parts[1:])
        if node.write_bin is not None:
            node.write_bin(bytes(data), offset)
            self.model.record(host_path, f"@{offset:#x}:{bytes(data).hex()}", 0, self._pid())
            return len(data)
        if node.write is None:
            raise mfusepy.FuseOSError(errno.EACCES)
        raw = data.decode("utf-8", "replace")
        # sysfs_streq / the kernel's stores ignore one trailing newline
        value = raw[:-1] if raw.endswith("\n") else raw
        pid = self._pid()
        self._tls.defer = None
        try:
            node.write(value)
        except SysfsError as e:
            assert e.errno is not None
            self.model.record(host_path, value, e.errno, pid)
            raise mfusepy.FuseOSError(e.errno) from None
        if self._tls.defer is not None:
            with self._pending_lock:
                self._pending[int(fh)] = (self._tls.defer, host_path, pid)
            return len(data)
        self.model.record(host_path, value, 0, pid)
        return len(data)

    def chmod(self, path: str, mode: int) -> int:
        raise mfusepy.FuseOSError(errno.EPERM)

    def chown(self, path: str, uid: int, gid: int) -> int:
        raise mfusepy.FuseOSError(errno.EPERM)

    def utimens(self, path: str, times: Any = None) -> int:
        self.lookup(path)
        return 0


class StandaloneMount:
    """Run the daemon on a temporary mount point (tests, tools): a context manager.

    ``StandaloneMount(profile, workdir, kernel=None)`` creates ``workdir/{mnt,state,dev}`` (``dev``
    with ``nvidiaN`` for every GPU minor of the profile, ``nvidiactl``, ``nvidia-uvm``), starts
    ``python -m gpulab.sysfs`` and waits (bounded) until the mount answers. On exit it stops the
    daemon (SIGTERM, then SIGKILL after 5 s) and lazily unmounts whatever is left.
    """

    def __init__(self, profile: str, workdir: str | os.PathLike[str], kernel: str | None = None) -> None:
        self.profile = profile
        self.work = os.fspath(workdir)
        self.kernel = kernel
        self.mnt = os.path.join(self.work, "mnt")
        self.state = os.path.join(self.work, "state")
        self.dev = os.path.join(self.work, "dev")
        self.proc: Any = None

    def __enter__(self) -> StandaloneMount:
        import subprocess

        prof = load_profile(self.profile, {"kernel": self.kernel} if self.kernel else None)
        for d in (self.mnt, self.state, self.dev):
            os.makedirs(d, exist_ok=True)
        for name in [f"nvidia{g.minor}" for g in prof.gpus] + ["nvidiactl", "nvidia-uvm"]:
            open(os.path.join(self.dev, name), "a").close()
        argv = [sys.executable, "-m", "gpulab.sysfs", "--profile", self.profile, "--state", self.state]
        argv += ["--mount", self.mnt, "--devdir", self.dev]
        if self.kernel:
            argv += ["--kernel", self.kernel]
        log = open(os.path.join(self.work, "sysfs.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"gpulab.sysfs exited with {self.proc.returncode}; see {self.work}/sysfs.log"
                )
            if os.path.ismount(self.mnt) and os.path.isdir(os.path.join(self.mnt, "pci", "devices")):
                return self
            time.sleep(0.05)
        self.__exit__(None, None, None)
        raise RuntimeError(f"gpulab.sysfs did not mount {self.mnt} within 15 s")

    def stop(self, timeout: float = 5.0) -> int | None:
        """Send SIGTERM and wait; return the exit code (None if it had to be killed)."""
        import signal as _signal
        import subprocess

        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(_signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                return None
        rc: int = self.proc.returncode
        return rc

    def __exit__(self, *exc: object) -> None:
        import subprocess

        self.stop()
        if os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False, timeout=10)


def main(argv: Sequence[str] | None = None) -> int:
    """Mount the lab sysfs for one host and serve it in the foreground until unmounted."""
    ap = argparse.ArgumentParser(prog="python -m gpulab.sysfs", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile name, YAML or JSON file")
    ap.add_argument("--state", required=True, help="state dir (record.jsonl goes there)")
    ap.add_argument("--mount", required=True, help="mount point")
    ap.add_argument(
        "--devdir", required=True, help="dir with nvidiaN files (holders are found by st_dev/st_ino)"
    )
    ap.add_argument("--kernel", help="override the profile's kernel release (picks the errno era)")
    ap.add_argument(
        "--cmdline",
        help="kernel command line the host booted with (e.g. read from its /etc/kernel/cmdline at a lab "
        "reboot): iommu=pt, iommu.passthrough= and iommu.strict= pick the groups' boot type",
    )
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    overrides: dict[str, str] = {"kernel": args.kernel} if args.kernel else {}
    try:
        profile = load_profile(args.profile, overrides or None)
        if args.cmdline is not None:
            overrides["cmdline"] = args.cmdline
            overrides["default_domain"] = default_domain_for(args.cmdline, profile.default_domain)
            profile = load_profile(args.profile, overrides)
    except ProfileError as e:
        print(f"gpulab.sysfs: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.state, exist_ok=True)
    model = HostModel(profile, args.state, args.devdir)
    ops = SysfsOps(model)
    try:
        mfusepy.FUSE(
            ops,
            args.mount,
            foreground=True,
            allow_other=True,
            direct_io=True,
            # no kernel caching of names or attributes: symlinks must vanish the moment a driver
            # lets go, and appear the moment it binds
            entry_timeout=0,
            attr_timeout=0,
            negative_timeout=0,
            fsname="gpulab-sysfs",
            debug=args.debug,
        )
    except RuntimeError as e:
        # libfuse's main returns 8 when its loop ended on SIGTERM/SIGINT: a normal stop.
        if str(e) != "8":
            print(f"gpulab.sysfs: fuse ended with {e}", file=sys.stderr)
            return 1
    finally:
        model.stopping.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

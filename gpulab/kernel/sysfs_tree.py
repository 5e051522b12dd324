"""The file tree the lab's sysfs daemon serves: which node each path is, and what it reads or writes.

``SysfsTree`` maps a FUSE path (``/pci/devices/BDF/driver``) to a ``Node`` over a ``HostModel``;
``gpulab.kernel.sysfs.SysfsOps`` adds the FUSE operations. Subtrees: ``pci/`` (/sys/bus/pci),
``iommu_groups/`` (/sys/kernel/iommu_groups), ``ctl/`` (/var/lib/gpulab/ctl), ``module/``
(/sys/module) and ``proc/modules`` (/proc/modules).
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

try:
    import mfusepy
except OSError as exc:  # mfusepy raises OSError at import where libfuse is missing: tests skip on ImportError
    raise ImportError(f"mfusepy cannot load libfuse ({exc}): apt-get install fuse3") from exc

from gpulab.kernel.aer import FILES as AER_FILES
from gpulab.kernel.aer import aer_text
from gpulab.kernel.kernelio import SysfsError
from gpulab.kernel.model import HostModel

__all__ = ["HOST_PREFIX", "Node", "SysfsTree"]

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


# Module sizes are placeholders, not taken from a real host (docs/LAB-SOURCES.md says so): the
# suite must read the use count and the users, never the size.
_MODULE_SIZE = {"nvidia_uvm": 2076672, "nvidia_drm": 131072, "nvidia_modeset": 1548288, "nvidia": 11321344}


def proc_modules(refcnt: Mapping[str, int], users: Mapping[str, list[str]]) -> str:
    """Return ``/proc/modules`` lines for the NVIDIA modules (kernel/module/procfs.c m_show()).

    Each line: name, size, use count, the modules using it (``a,b,`` or ``-``), ``Live``, the
    load address (zeros without CAP_SYSLOG) and taint flags (``(OE)``: out of tree and unsigned,
    as DKMS-built open modules show; the open modules are MIT/GPL, so no ``P``).
    """
    lines = []
    for name in ("nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia"):
        if name not in refcnt:
            continue
        by = "".join(f"{u}," for u in users.get(name, [])) or "-"
        lines.append(f"{name} {_MODULE_SIZE[name]} {refcnt[name]} {by} Live 0x0000000000000000 (OE)")
    return "\n".join(lines) + ("\n" if lines else "")


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


def _aer_node(m: HostModel, bdf: str, name: str) -> Node:
    return _ro(lambda: aer_text(m.state_dir, bdf, name))


def _rw(fn: Callable[[], str], w: Callable[[str], None]) -> Node:
    return Node("file", 0o644, read=fn, write=w)


def _wo(w: Callable[[str], None]) -> Node:
    return Node("file", 0o200, write=w)


def _dir(names: Callable[[], list[str]]) -> Node:
    return Node("dir", 0o755, children=names)


def _link(target: str) -> Node:
    return Node("link", 0o777, target=target)


# a device's attributes that print one field of its PciFunction (or its PCIe link) as they are
_ID_ATTRS = {
    "vendor": "vendor",
    "device": "device",
    "subsystem_vendor": "subsystem_vendor",
    "subsystem_device": "subsystem_device",
    "class": "klass",
}
_LINK_ATTRS = {
    "current_link_speed": "speed",
    "current_link_width": "width",
    "max_link_speed": "max_speed",
    "max_link_width": "max_width",
}


def _at_work(m: HostModel, bdf: str) -> bool:
    """Say whether a compute context holds the GPU: a holder other than nvidia-persistenced.

    The persistence daemon keeps a GPU initialised and idle (P8); the lab's nvidia-smi says the
    same (gpulab_tools.GpuView.at_work).
    """
    for pid in m.holders(bdf):
        try:
            with open(f"{m.proc}/{pid}/cmdline", "rb") as f:
                if b"nvidia-persistenced" not in f.read(4096):
                    return True
        except OSError:
            continue
    return False


def _noop(_v: str) -> None:
    return None


def _refuse(_v: str) -> None:
    # removing a device from the bus is not something the lab lets anyone rehearse
    raise SysfsError(errno.EPERM)


class SysfsTree:
    """Path -> Node over a HostModel; ``_unbind`` is supplied by the FUSE operations."""

    model: HostModel

    def _unbind(self, drv: str, bdf: str) -> None:
        raise NotImplementedError

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
                return _ro(lambda: proc_modules(m.module_refcnt(), MODULE_USERS))
        return None

    def _module_names(self) -> list[str]:
        loaded = NVIDIA_MODULES if self.model.profile.node.nvidia_driver else ()
        return sorted({*loaded, *self.model.profile.module_params})

    def _modules(self, p: list[str]) -> Node | None:
        m = self.model
        if not p:
            return _dir(self._module_names)
        name, rest = p[0], p[1:]
        if name not in self._module_names():
            return None
        params = dict(m.profile.module_params.get(name, {}))
        if name == "kvm_amd" and m.profile.kernel_version < (6, 11):
            # KVM's SEV-SNP host support (and its sev_snp parameter) arrived in 6.11 (from memory,
            # not verified); an older kernel can still run the IOMMU with SNP on.
            params.pop("sev_snp", None)
        if not rest:
            kids = ["parameters"] if params else []
            if name in NVIDIA_MODULES:
                kids += ["refcnt", "initstate", "holders", "version"]
            return _dir(lambda: kids)
        if len(rest) == 1 and name in NVIDIA_MODULES:
            if rest[0] == "refcnt":
                return _ro(lambda: f"{m.module_refcnt()[name]}\n")
            if rest[0] == "version":
                # MODULE_VERSION(NV_VERSION_STRING) in nv.c, uvm.c, nvidia-modeset-linux.c and
                # nvidia-drm-linux.c: kernel/module/sysfs.c shows it as /sys/module/M/version
                return _ro(lambda: f"{m.profile.driver_version}\n")
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
        if not p:
            return _dir(lambda: sorted(self._device_names(bdf)))
        if p[0] == "power" and self._is_bridge(bdf):
            return self._power(bdf, p[1:])
        if len(p) == 1:
            return self._device_attr(bdf, p[0])
        if p[0] != "drm" or len(p) > 3:
            return None
        drm = self._drm_nodes(bdf)
        if len(p) == 2 and p[1] in drm:
            return _dir(lambda: ["dev", "uevent"])
        if len(p) == 3 and p[1] in drm and p[2] in ("dev", "uevent"):
            major_minor = f"226:{int(p[1].removeprefix('card').removeprefix('renderD'))}"
            if p[2] == "dev":
                return _ro(lambda: major_minor + "\n")
            return _ro(lambda: f"MAJOR=226\nMINOR={major_minor[4:]}\nDEVNAME=dri/{p[1]}\nDEVTYPE=drm_minor\n")
        return None

    def _device_attr(self, bdf: str, name: str) -> Node | None:
        """Return the node of one entry of a device's directory (the names ``_device_names`` lists).

        Only the asked-for node is built: the daemon looks every path up again for each FUSE
        request (no kernel caching, see ``gpulab.kernel.sysfs.main``), and building all ~25 nodes of the
        directory each time was most of the daemon's Python time.
        """
        m = self.model
        f = m.functions[bdf]
        if name in _ID_ATTRS:
            attr = _ID_ATTRS[name]
            return _ro(lambda: getattr(f, attr) + "\n")
        if name == "revision":
            return _ro(lambda: "0xa1\n")
        if name == "numa_node":
            return _ro(lambda: f"{f.numa_node}\n")
        if name == "resource" and f.is_gpu:
            return _ro(lambda: self._resource(bdf))
        if name == "enable":
            return _ro(lambda: "1\n" if m.driver[bdf] else "0\n")
        if name == "modalias":
            return _ro(
                lambda: (
                    f"pci:v0000{f.vendor[2:].upper()}d0000{f.device[2:].upper()}"
                    f"sv0000{f.subsystem_vendor[2:].upper()}sd0000{f.subsystem_device[2:].upper()}"
                    f"bc{f.klass[2:4].upper()}sc{f.klass[4:6].upper()}i{f.klass[6:8].upper()}\n"
                )
            )
        if name == "uevent":
            return _rw(lambda: self._uevent(bdf), _noop)
        if name == "driver_override":
            return _rw(lambda: (m.override.get(bdf) or "(null)") + "\n", lambda v: m.set_override(bdf, v))
        if name == "reset":
            return _wo(_noop)
        if name == "remove":
            return _wo(_refuse)
        if name == "subsystem":
            return _link(f"{SYS}/bus/pci")
        if name == "config":
            return Node(
                "file",
                0o644,
                read_bin=lambda: m.cfg.read(bdf),
                write_bin=lambda data, off: m.cfg.write(bdf, off, data),
            )
        if name in ("secondary_bus_number", "subordinate_bus_number"):
            if not f.klass.startswith("0x0604"):
                return None
            sec, sub = m.cfg.bus_range(bdf)
            value = sec if name == "secondary_bus_number" else sub
            return _ro(lambda: f"{value}\n")
        if name in _LINK_ATTRS:
            lk = f.link
            if lk is None:
                return None
            attr = _LINK_ATTRS[name]
            if attr == "speed" and lk.idle_speed:
                # an idle GPU's link runs at its idle speed, a held one's at full (LAB-SOURCES.md)
                idle = lk.idle_speed
                return _ro(lambda: f"{lk.speed if _at_work(m, bdf) else idle}\n")
            return _ro(lambda: f"{getattr(lk, attr)}\n")
        if name in AER_FILES:  # AER counters (gpulab/kernel/aer.py)
            return _aer_node(m, bdf, name) if self._has_aer(bdf) else None
        if name == "iommu_group":
            if f.iommu_group is None:
                return None
            return _link(f"{SYS}/kernel/iommu_groups/{f.iommu_group}")
        if name == "driver":
            drv = m.driver.get(bdf)
            return _link(f"{SYS}/bus/pci/drivers/{drv}") if drv else None
        if name == "drm":
            drm = self._drm_nodes(bdf)
            return _dir(lambda: drm) if drm else None
        return None

    def _is_bridge(self, bdf: str) -> bool:
        return self.model.functions[bdf].klass.startswith("0x0604")

    def _power(self, bdf: str, rest: list[str]) -> Node | None:
        """A port's runtime PM (Documentation/ABI/testing/sysfs-devices-power): ``control`` auto lets it
        suspend, on keeps it active (profile ``port_power_control``; default on)."""
        control = str((self.model.profile.raw.get("port_power_control") or {}).get(bdf) or "on")
        if not rest:
            return _dir(lambda: ["control", "runtime_status"])
        if rest == ["control"]:
            return _ro(lambda: control + "\n")
        if rest == ["runtime_status"]:
            return _ro(lambda: "active\n")
        return None

    def _resource(self, bdf: str) -> str:
        """sysfs ``resource`` of a GPU: start, end, flags per region (drivers/pci/pci-sysfs.c
        resource_show); region 1 is BAR1, the framebuffer aperture, sized by the profile's
        ``bar1_mib`` (default the power of two at or above the GPU's memory: Resizable BAR on)."""
        prof = self.model.profile
        mem = next((g.memory_mib for g in prof.gpus if g.bdf == bdf), 0)
        full = 1 << max(mem - 1, 1).bit_length() if mem else 256
        bar1 = int((prof.raw.get("bar1_mib") or {}).get(bdf) or full) << 20
        bus = int(bdf[5:7], 16)
        base0, base1 = 0xF0000000 - (bus << 24), (0x200000000000 + (bus << 40)) & 0xFFFFFFFFFFFF
        regions = [
            (base0, base0 + (16 << 20) - 1, 0x40200),  # BAR0: registers, 32-bit
            (base1, base1 + bar1 - 1, 0x14220C),  # BAR1: 64-bit prefetchable
            (0, 0, 0),
            (base1 + bar1, base1 + bar1 + (32 << 20) - 1, 0x14220C),  # BAR3
            (0, 0, 0),
            (0x5000, 0x507F, 0x40101),  # BAR5: I/O
            (0, 0, 0),
        ]
        return "".join(f"0x{a:016x} 0x{b:016x} 0x{f:016x}\n" for a, b, f in regions + [(0, 0, 0)] * 6)

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
            node_names += ["secondary_bus_number", "subordinate_bus_number", "power"]
        if f.is_gpu:
            node_names.append("resource")
        if f.link is not None:
            node_names += ["current_link_speed", "current_link_width", "max_link_speed", "max_link_width"]
        if self._has_aer(bdf):
            node_names += list(AER_FILES)
        if f.iommu_group is not None:
            node_names.append("iommu_group")
        if self.model.driver.get(bdf):
            node_names.append("driver")
        if self._drm_nodes(bdf):
            node_names.append("drm")
        return node_names

    def _has_aer(self, bdf: str) -> bool:
        """NVIDIA GPUs (display/3D controllers) and PCIe ports have the AER capability: the kernel shows aer_dev_*."""
        f = self.model.functions[bdf]
        return (f.vendor == "0x10de" and f.klass.startswith("0x03")) or (
            f.klass.startswith("0x0604") and f.link is not None
        )

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

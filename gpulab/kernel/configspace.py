"""PCI config space of the lab's functions: header, PCIe capability with link status, ACS.

``ConfigSpace`` is the 4 KiB ``config`` file of each function that ``lspci -vvv`` and ``setpci``
read, with the ACS capability at 0x100 on ports that implement ACS (control bits at
boot from ``gpulab.kernel.acs.boot_acs_ctl()``). Only the command register and ACS control are
writable, as ``setpci`` would find them.
"""

from __future__ import annotations

import threading

from gpulab.kernel import acs
from gpulab.profiles.types import ACS_BITS, PciFunction, Profile

__all__ = ["ConfigSpace"]


class ConfigSpace:
    """The config space of every function of one lab host, at boot and as setpci changed it."""

    def __init__(self, profile: Profile, lock: threading.RLock) -> None:
        self.profile = profile
        self.functions: dict[str, PciFunction] = {f.bdf: f for f in profile.pci}
        self.lock = lock
        self.config: dict[str, bytearray] = {}
        self.reset()

    def reset(self) -> None:
        """Every function's config space as the kernel left it at boot."""
        with self.lock:
            self.config = {b: self._boot_config(b) for b in self.functions}

    def read(self, bdf: str) -> bytes:
        """The function's 4 KiB config space."""
        return bytes(self.config[bdf])

    def bus_range(self, bdf: str) -> tuple[int, int]:
        """Return (secondary, subordinate) bus numbers of a bridge, from the profile's tree."""
        kids = [f for f in self.profile.pci if f.parent == bdf]
        own = int(bdf[5:7], 16)
        if not kids:
            return own + 1, own + 1
        lo = min(int(k.bdf[5:7], 16) for k in kids)
        hi = lo
        todo = list(kids)
        while todo:
            f = todo.pop()
            hi = max(hi, int(f.bdf[5:7], 16))
            todo += [g for g in self.profile.pci if g.parent == f.bdf]
        return lo, hi

    def _boot_config(self, bdf: str) -> bytearray:
        """Build the function's 4 KiB config space: header, PCIe capability, ACS on ports."""
        f = self.functions[bdf]
        c = bytearray(4096)

        def put(off: int, value: int, size: int) -> None:
            c[off : off + size] = value.to_bytes(size, "little")

        put(0x00, int(f.vendor, 16), 2)
        put(0x02, int(f.device, 16), 2)
        put(0x04, 0x0406 if f.driver else 0x0000, 2)
        put(0x06, 0x0010, 2)  # capabilities list
        put(0x08, 0xA1, 1)
        put(0x09, int(f.klass, 16), 3)  # prog-if, subclass, class
        ptype = acs.port_type(self.profile, bdf)
        put(0x0E, 0x01 if ptype else 0x00, 1)
        if ptype:
            sec, sub = self.bus_range(bdf)
            put(0x18, int(bdf[5:7], 16), 1)
            put(0x19, sec, 1)
            put(0x1A, sub, 1)
        else:
            put(0x2C, int(f.subsystem_vendor, 16), 2)
            put(0x2E, int(f.subsystem_device, 16), 2)
        put(0x34, 0x40, 1)
        put(0x40, 0x10, 1)  # PCI Express capability, last in the list
        put(0x42, 0x2 | (ptype << 4), 2)
        if f.link is not None:
            put(0x4C, _speed_code(f.link.max_speed) | (f.link.max_width << 4), 4)
            put(0x52, _speed_code(f.link.speed) | (f.link.width << 4), 2)
        cap = acs.acs_cap(self.profile, f)
        if cap:
            put(0x100, 0x000D | (1 << 16), 4)  # ACS extended capability, version 1, last
            put(0x104, sum(1 << ACS_BITS.index(b) for b in cap), 2)
            put(0x106, sum(1 << ACS_BITS.index(b) for b in acs.boot_acs_ctl(self.profile, f)), 2)
        return c

    def write(self, bdf: str, offset: int, data: bytes) -> None:
        """Write config space like setpci: only the command register and ACS control take it."""
        writable = set(range(0x04, 0x06))
        if self.config[bdf][0x100:0x102] == b"\x0d\x00":
            writable |= set(range(0x106, 0x108))
        with self.lock:
            for i, byte in enumerate(data):
                if offset + i in writable:
                    self.config[bdf][offset + i] = byte

    def acs_ctl(self, bdf: str) -> list[str]:
        """Return the names of the ACS control bits set on a function."""
        c = self.config[bdf]
        if c[0x100:0x102] != b"\x0d\x00":
            return []
        ctl = int.from_bytes(c[0x106:0x108], "little")
        return [n for i, n in enumerate(ACS_BITS) if ctl >> i & 1]


def _speed_code(speed: str) -> int:
    """Return the PCIe Link Speed field for a sysfs speed string (``32.0 GT/s PCIe`` -> 5)."""
    try:
        gts = float(speed.split()[0])
    except (ValueError, IndexError):
        return 0
    for code, v in ((6, 64.0), (5, 32.0), (4, 16.0), (3, 8.0), (2, 5.0), (1, 2.5)):
        if gts >= v:
            return code
    return 0

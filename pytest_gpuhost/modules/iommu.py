"""IOMMU groups: their type (DMA, DMA-FQ, identity, ...) and how to change it, per kernel era.

Facts (docs/FACTS.md): `/sys/kernel/iommu_groups/N/type` exists since 5.11. From 6.4 a write while a
device of the group has a driver gives EPERM and multi-device groups may change once every
device is unbound; from 5.11 to 6.3 a bound device gives EBUSY and a group of more than one
device gives EINVAL whatever is bound.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules.pci import PciFunction

__all__ = [
    "GROUPS",
    "IommuError",
    "IommuGroup",
    "kernel_version",
    "set_type",
    "type_command",
    "type_path",
]

GROUPS = "/sys/kernel/iommu_groups"
WRITABLE = ("DMA", "DMA-FQ", "identity", "auto")


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


def _explain(group: IommuGroup, value: str, code: int, kernel: str) -> str:
    era = kernel_version(kernel) if kernel else (6, 4)
    bound = ", ".join(f"{m.bdf} ({m.driver})" for m in group.bound) or "none seen"
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
    if code == errno.EACCES:
        return "EACCES: needs CAP_SYS_ADMIN and CAP_SYS_RAWIO: run as root (or --sudo)"
    if code == errno.ENOENT:
        return (
            f"ENOENT: no {type_path(group.number)} (kernel {kernel} is older than 5.11 or the IOMMU is off)"
        )
    return f"{errno.errorcode.get(code, str(code))}: write refused"


def set_type(conn: _Conn, group: IommuGroup, value: str, *, kernel: str, timeout: float = 10.0) -> str:
    """Write `value` to the group's type and read it back; return what the kernel reports.

    Raises IommuError with the kernel era's meaning of the errno, or when the read-back differs.
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
        raise IommuError(
            errno.EIO, f"{conn.name}: group {group.number}: wrote {value!r} but it reads {now!r}"
        )
    return now

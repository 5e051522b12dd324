"""PCI functions and driver binding through /sys/bus/pci (kernel semantics in docs/FACTS.md).

Binding is done by writing the BDF to `drivers/X/unbind` and `drivers/X/bind` with the agent's
watched write, so a write that blocks in the kernel (an nvidia unbind while the GPU is held)
comes back as a timeout instead of hanging the run. Errors carry the errno and a message that
says what it means on a real kernel.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_gpuhost.errors import GpuhostError

__all__ = [
    "BDF_RE",
    "DRIVERS",
    "DEVICES",
    "PciError",
    "PciFunction",
    "bind",
    "bind_command",
    "check_bdf",
    "unbind",
    "unbind_command",
]

DEVICES = "/sys/bus/pci/devices"
DRIVERS = "/sys/bus/pci/drivers"
BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_DRIVER_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

GPU_CLASSES = ("0x0300", "0x0302")
NVIDIA_VENDOR = "0x10de"


class _Writer(Protocol):
    name: str

    def write_file(
        self, path: str, data: str | bytes, *, timeout: float | None = None, mode: str = "w"
    ) -> Any: ...


class PciError(GpuhostError, OSError):
    """A bind or unbind write failed; str() is one line for the operator."""

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


def check_bdf(bdf: str) -> str:
    """Return `bdf` if it is a full PCI address (0000:17:00.0); raise ValueError otherwise."""
    if not BDF_RE.match(bdf):
        raise ValueError(f"not a PCI address (domain:bus:device.function): {bdf!r}")
    return bdf


def _check_driver(driver: str) -> str:
    if not _DRIVER_RE.match(driver):
        raise ValueError(f"not a driver name: {driver!r}")
    return driver


@dataclass
class PciFunction:
    """One PCI function as the agent's `gpus` fact describes it."""

    bdf: str
    vendor: str | None = None
    device: str | None = None
    klass: str | None = None
    driver: str | None = None
    driver_override: str | None = None
    iommu_group: int | None = None
    numa_node: int | None = None
    link: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_fact(cls, d: dict[str, Any]) -> PciFunction:
        """Build from one entry of the `gpus` fact (or of its `group_members`)."""
        override = d.get("driver_override")
        return cls(
            bdf=d["bdf"],
            vendor=d.get("vendor"),
            device=d.get("device"),
            klass=d.get("class"),
            driver=d.get("driver"),
            driver_override=None if override in (None, "", "(null)") else override,
            iommu_group=d.get("iommu_group"),
            numa_node=d.get("numa_node"),
            link=dict(d.get("link") or {}),
        )

    @property
    def is_gpu(self) -> bool:
        """True for a display or 3D controller."""
        return bool(self.klass) and str(self.klass).startswith(GPU_CLASSES)

    @property
    def is_nvidia_gpu(self) -> bool:
        """True for an NVIDIA display or 3D controller."""
        return self.is_gpu and self.vendor == NVIDIA_VENDOR


def unbind_command(bdf: str, driver: str) -> str:
    """Return the exact write `unbind` performs, as an operator would type it."""
    return f"echo {check_bdf(bdf)} > {DRIVERS}/{_check_driver(driver)}/unbind"


def bind_command(bdf: str, driver: str) -> str:
    """Return the exact write `bind` performs, as an operator would type it."""
    return f"echo {check_bdf(bdf)} > {DRIVERS}/{_check_driver(driver)}/bind"


def _fail(conn: _Writer, verb: str, bdf: str, driver: str, result: Any, timeout: float) -> PciError:
    if result.timed_out:
        why = (
            f"the write did not return within {timeout:g} s: the driver is waiting for the device's "
            "users to let go (an nvidia unbind blocks while anything holds /dev/nvidia*); "
            "the write is left to the kernel and completes when the holders go"
        )
        return PciError(errno.ETIMEDOUT, f"{conn.name}: {verb} {bdf} {driver}: {why}")
    code = result.errno
    meaning = {
        errno.ENODEV: (
            f"{bdf} is not bound to {driver}"
            if verb == "unbind"
            else f"{driver} does not accept {bdf} (no such device, or no match)"
        ),
        errno.EBUSY: f"{bdf} already has a driver",
        errno.ENOENT: f"no driver {driver} is loaded (no {DRIVERS}/{driver})",
        errno.EACCES: "permission denied: run as root (or --sudo)",
        errno.EPERM: "operation not permitted: run as root (or --sudo)",
    }.get(code or 0, result.error or "write failed")
    name = errno.errorcode.get(code or 0, str(code))
    return PciError(code or 0, f"{conn.name}: {verb} {bdf} from/to {driver}: {name}: {meaning}")


def unbind(conn: _Writer, bdf: str, driver: str, *, timeout: float) -> None:
    """Unbind `bdf` from `driver`; raise PciError (ETIMEDOUT when the write blocked)."""
    result = conn.write_file(f"{DRIVERS}/{_check_driver(driver)}/unbind", check_bdf(bdf), timeout=timeout)
    if not result.ok:
        raise _fail(conn, "unbind", bdf, driver, result, timeout)


def bind(conn: _Writer, bdf: str, driver: str, *, timeout: float) -> None:
    """Bind `bdf` to `driver` by writing to the driver's `bind` (driver_override is not needed)."""
    result = conn.write_file(f"{DRIVERS}/{_check_driver(driver)}/bind", check_bdf(bdf), timeout=timeout)
    if not result.ok:
        raise _fail(conn, "bind", bdf, driver, result, timeout)

"""Who holds a GPU that owes a reset, and what `--fix=reset` would stop for it (suites/health/reset.py).

Every process with the GPU's `/dev/nvidiaN` open (its minor number from nvidia-smi), by the
systemd unit it runs in: an inventory `service` unit or nvidia-persistenced may be stopped and
started again; any other holder is named and the GPU is not reset.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.modules.health.xid import bus_key
from pytest_gpuhost.modules.process import ProcessTable, driver_daemon

__all__ = ["PERSISTENCED", "GpuReset", "NodeHolders", "gpu_rows", "key", "plan_gpu", "plan_node", "units"]

PERSISTENCED = "nvidia-persistenced.service"
_UNIT = re.compile(r"/([^/]+\.service)$")


def key(bdf: Any) -> str:
    """xid.bus_key, with nvidia-smi's 8-digit domain (00000000:14:00.0) folded to the kernel's 4."""
    domain, _, rest = bus_key(bdf).partition(":")
    return f"{domain[-4:]}:{rest}" if rest else domain


@dataclass
class GpuReset:
    """The plan for one GPU: who holds it, what is stopped, what would run."""

    bus: str
    smi_id: str  # the bus id as nvidia-smi prints it (its -i argument)
    why: list[str]
    minor: int | None = None
    persistence: bool = False
    units: list[str] = field(default_factory=list)  # to stop, then start again
    refused: list[str] = field(default_factory=list)  # holders no unit of ours owns

    def commands(self) -> list[list[str]]:
        out = [["systemctl", "stop", "--", u] for u in self.units]
        if self.persistence:
            out.append(["nvidia-smi", "-i", self.smi_id, "-pm", "0"])
        out.append(["nvidia-smi", "-r", "-i", self.smi_id])
        if self.persistence:
            out.append(["nvidia-smi", "-i", self.smi_id, "-pm", "1"])
        out += [["systemctl", "start", "--", u] for u in reversed(self.units)]
        return out


@dataclass
class NodeHolders:
    """Who holds any GPU of the node, for a reboot: what is stopped first, what stops the reboot."""

    units: list[str] = field(default_factory=list)  # inventory units to stop, then start again
    refused: list[str] = field(default_factory=list)  # holders no unit of ours owns


def gpu_rows(facts: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    part = facts.get("gpus")
    if not (isinstance(part, Mapping) and part.get("ok")):
        return {}
    return {key(g.get("bdf")): g for g in part.get("gpus") or [] if isinstance(g, Mapping)}


def _minor(conn: Any, smi_id: str) -> int | None:
    r = conn.run(
        ["nvidia-smi", "-i", smi_id, "--query-gpu=minor_number", "--format=csv,noheader"], timeout=20
    )
    text = (r.stdout or "").strip()
    return int(text) if r.rc == 0 and text.isdigit() else None


def _unit_of(cgroup: str) -> str | None:
    m = _UNIT.search((cgroup or "").rstrip("/"))
    return m.group(1) if m else None


def plan_gpu(conn: Any, bus: str, why: list[str], g: Mapping[str, Any], allowed: list[str]) -> GpuReset:
    """Read who holds the GPU; say what would be stopped, or who stops it from being reset."""
    smi_id = str(g.get("bdf"))
    p = GpuReset(bus, smi_id, why)
    p.persistence = str(g.get("persistence_mode", "")).lower() in ("enabled", "1", "on")
    p.minor = _minor(conn, smi_id)
    if p.minor is None:
        p.refused.append(f"nvidia-smi gave no minor number for {smi_id}: cannot tell who holds it")
        return p
    dev = f"/dev/nvidia{p.minor}"
    table = ProcessTable.read(conn, gpu_holders=True)
    for proc in table.gpu_holders():
        if dev not in proc.gpus:
            continue
        unit = _unit_of(proc.cgroup)
        ok_unit = unit is not None and (unit in allowed or (unit == PERSISTENCED and driver_daemon(proc)))
        if ok_unit and unit not in p.units:
            p.units.append(unit)  # type: ignore[arg-type]
        elif not ok_unit:
            p.refused.append(
                f"PID {proc.pid} ({' '.join(proc.argv)[:120]}) holds {dev}"
                + (f" in {unit}, not an inventory service" if unit else ", outside any systemd service")
            )
    return p


def plan_node(conn: Any, allowed: list[str]) -> NodeHolders:
    """Read who holds any `/dev/nvidia*` on the node: a reboot ends every one of them.

    An inventory `service` unit is stopped first (the bounded ladder, so a server that ignores
    SIGTERM does not hold the shutdown to its own timeout). The driver's daemons
    (nvidia-persistenced, the fabric manager, nv-hostengine) are left to the shutdown, which stops
    them, and the boot, which starts them. Any other holder refuses the reboot.
    """
    out = NodeHolders()
    for proc in ProcessTable.read(conn, gpu_holders=True).gpu_holders():
        if driver_daemon(proc):
            continue
        unit = _unit_of(proc.cgroup)
        if unit is not None and unit in allowed:
            if unit not in out.units:
                out.units.append(unit)
            continue
        out.refused.append(
            f"PID {proc.pid} ({' '.join(proc.argv)[:120]}) holds {', '.join(proc.gpus)[:120]}"
            + (f" in {unit}, not an inventory service" if unit else ", outside any systemd service")
        )
    return out


def units(thresholds: Any) -> list[str]:
    return [u if u.endswith(".service") else f"{u}.service" for u in thresholds.services]

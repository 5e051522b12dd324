"""Who holds a GPU that owes a reset, and what `--fix=reset` would stop for it (suites/health/reset.py).

Every process with the GPU's `/dev/nvidiaN` open (its minor number from nvidia-smi), by the
systemd unit it runs in: an inventory `service` unit or nvidia-persistenced may be stopped and
started again; any other holder is named and the GPU is not reset.

Where nvidia-smi(1) says a GPU's NVLink peers must be reset in the same command
(modules/health/reset_set.py: before Ampere, or on NVSwitches without Fabric Manager), the GPU's
plan takes its peers along (`GpuReset.peers`): their holders are stopped too, their persistence
turned off, and one `nvidia-smi -r -i A,B,...` resets them all; and, as the same text allows no
compute application on any other GPU when a GPU cannot be reset alone, the holders of every other
GPU are stopped or refuse the reset as well. `plan_resets` reads what that takes: the NVLink
peers from `nvidia-smi topo -m`, the NVSwitches from the PCI fact, Fabric Manager's unit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.modules import parsers
from pytest_gpuhost.modules.health import reset_set
from pytest_gpuhost.modules.health.models import model_spec
from pytest_gpuhost.modules.health.xid import bus_key
from pytest_gpuhost.modules.process import ProcessTable, driver_daemon

__all__ = [
    "PERSISTENCED",
    "GpuReset",
    "NodeHolders",
    "gpu_rows",
    "key",
    "plan_gpu",
    "plan_node",
    "plan_resets",
    "units",
]

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
    peers: list[GpuReset] = field(default_factory=list)  # reset in the same command (NVLink peers)
    together: str = ""  # why the peers go with it (reset_set.together_why); "" when alone

    @property
    def members(self) -> list[GpuReset]:
        """This GPU, then the peers reset with it."""
        return [self, *self.peers]

    @property
    def ids(self) -> list[str]:
        """The GPUs of the one `nvidia-smi -r -i` (as nvidia-smi names them)."""
        return [m.smi_id for m in self.members]

    def owes(self) -> str:
        """The check's words: the GPU, why, and the peers that go with it."""
        line = f"{self.smi_id} owes a reset ({'; '.join(self.why)})"
        if self.peers:
            line += f"; its NVLink peers {', '.join(self.ids[1:])} go in the same command (nvidia-smi(1) -r: {self.together})"
        return line

    def commands(self) -> list[list[str]]:
        out = [["systemctl", "stop", "--", u] for u in self.units]
        out += [["nvidia-smi", "-i", m.smi_id, "-pm", "0"] for m in self.members if m.persistence]
        out.append(["nvidia-smi", "-r", "-i", ",".join(self.ids)])
        out += [["nvidia-smi", "-i", m.smi_id, "-pm", "1"] for m in self.members if m.persistence]
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


def plan_gpu(
    conn: Any,
    bus: str,
    why: list[str],
    g: Mapping[str, Any],
    allowed: list[str],
    table: ProcessTable | None = None,
) -> GpuReset:
    """Read who holds the GPU; say what would be stopped, or who stops it from being reset."""
    smi_id = str(g.get("bdf"))
    p = GpuReset(bus, smi_id, why)
    p.persistence = str(g.get("persistence_mode", "")).lower() in ("enabled", "1", "on")
    p.minor = _minor(conn, smi_id)
    if p.minor is None:
        p.refused.append(f"nvidia-smi gave no minor number for {smi_id}: cannot tell who holds it")
        return p
    dev = f"/dev/nvidia{p.minor}"
    table = table or ProcessTable.read(conn, gpu_holders=True)
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


def plan_resets(
    conn: Any,
    owed: Mapping[str, list[str]],
    rows: Mapping[str, Mapping[str, Any]],
    allowed: list[str],
    facts: Mapping[str, Any],
) -> list[GpuReset]:
    """Plan a reset for each GPU in `owed` that nvidia-smi lists ({bus: why}), peers taken along.

    One plan per `nvidia-smi -r`: a GPU alone, or a GPU with the NVLink peers nvidia-smi(1)
    requires in the same command (reset_set.plan_sets), whose units are every member's and every
    other GPU's holders' (no compute application may run on any GPU then), and whose refusals are
    theirs too, so a set with one foreign holder anywhere is not reset.
    """
    listed = {b: w for b, w in owed.items() if b in rows}
    if not listed:
        return []
    peers = _peers(conn, rows)
    node = _node(conn, facts, rows) if any(peers.get(b) for b in listed) else reset_set.Node(None, False)
    names = {b: str(g.get("name") or "") for b, g in rows.items()}
    table = ProcessTable.read(conn, gpu_holders=True)
    plans = []
    for s in reset_set.plan_sets(listed, names, peers, node):
        lead_bus = s.owed[0]
        lead = plan_gpu(conn, lead_bus, listed[lead_bus], rows[lead_bus], allowed, table)
        if len(s.gpus) == 1:
            plans.append(lead)
            continue
        lead.together = s.why
        for b in s.gpus:
            if b != lead_bus:
                why = listed.get(b) or [f"an NVLink peer of {lead.smi_id}, reset in the same command"]
                lead.peers.append(plan_gpu(conn, b, why, rows[b], allowed, table))
        others = [
            plan_gpu(conn, b, [], g, allowed, table) for b, g in sorted(rows.items()) if b not in s.gpus
        ]
        lead.units = list(dict.fromkeys(u for m in [*lead.members, *others] for u in m.units))
        lead.refused = list(dict.fromkeys(r for m in lead.members for r in m.refused))
        lead.refused += [
            f"{r} (another GPU: nvidia-smi(1) allows no compute application on any GPU when one "
            "cannot be reset alone)"
            for o in others
            for r in o.refused
        ]
        plans.append(lead)
    return plans


def _peers(conn: Any, rows: Mapping[str, Mapping[str, Any]]) -> dict[str, set[str]]:
    """Each GPU's NVLink peers from `nvidia-smi topo -m`; none where it cannot be read.

    A topology that cannot be read plans each GPU alone: nvidia-smi itself refuses a reset that
    leaves out a peer it requires, naming them, so nothing is reset that should not be.
    """
    r = conn.run(["nvidia-smi", "topo", "-m"], timeout=20)
    if r.rc != 0 or r.timed_out:
        return {}
    try:
        matrix = parsers.parse_topo_matrix(r.stdout)
    except parsers.ParseError:
        return {}
    index = {str(g.get("index")): b for b, g in rows.items() if g.get("index") is not None}
    return reset_set.nvlink_peers(matrix.links, index)


def _node(conn: Any, facts: Mapping[str, Any], rows: Mapping[str, Mapping[str, Any]]) -> reset_set.Node:
    """NVSwitches on the node (a model that sits on them, or one on the PCI bus) and Fabric Manager."""
    pci = facts.get("pci")
    switches = pci.get("nvswitches") if isinstance(pci, Mapping) and pci.get("ok") else None
    by_model = any((model_spec(str(g.get("name") or "")) or {}).get("fabric") for g in rows.values())
    nvswitch = True if by_model or switches else (None if switches is None else False)
    fabric = facts.get("fabric")
    svc = fabric.get("service") if isinstance(fabric, Mapping) else None
    if isinstance(svc, Mapping) and svc.get("ActiveState"):
        return reset_set.Node(nvswitch, svc.get("ActiveState") == "active")
    r = conn.run(["systemctl", "show", "-p", "ActiveState", "--", reset_set.FABRIC_UNIT], timeout=15)
    return reset_set.Node(nvswitch, r.rc == 0 and "ActiveState=active" in (r.stdout or "").split())


def units(thresholds: Any) -> list[str]:
    return [u if u.endswith(".service") else f"{u}.service" for u in thresholds.services]

"""Which GPUs one `nvidia-smi -r` must reset together: a GPU's NVLink peers, where the driver says so.

nvidia-smi(1), `-r, --gpu-reset` (NVIDIA's nvidia-smi documentation,
docs.nvidia.com/deploy/nvidia-smi/): "Starting with the NVIDIA Ampere architecture, GPUs with
NVLink connections can be individually reset. On Ampere NVSwitch systems, Fabric Manager is
required to facilitate reset. On Hopper and later NVSwitch systems, the dependency on Fabric
Manager to facilitate reset is removed. If Fabric Manager is not running, or if any of the GPUs
being reset are based on an architecture preceding the NVIDIA Ampere architecture, any GPUs with
NVLink connections to a GPU being reset must also be reset in the same command. [...] If the -i
option does not specify a complete set of NVLink GPUs to reset, this command will issue an error
identifying the additional GPUs that must be included in the reset command." Its tables: on
NVSwitch systems a pre-Ampere GPU's peers always go with it, an Ampere-or-later GPU is reset alone
while Fabric Manager runs and with its peers when it does not; on directly connected NVLink
systems ("FM is not supported, as no NVSwitch HW is present") pre-Ampere with its peers,
Ampere-or-later alone. And: "There also can't be any compute applications running on any other
GPU in the system if individual GPU reset is not feasible."

One sentence and the table disagree: a Hopper-or-later GPU on NVSwitches without Fabric Manager
is alone by the sentence ("the dependency ... is removed") and with its peers by the table. The
set is what nvidia-smi accepts under both readings, so that is what is planned; likewise for a GPU
whose architecture is not known, and for a node where it is not known whether NVSwitches are
there. A GPU's NVLink peers are the GPUs `nvidia-smi topo -m` shows as `NV#` in its row, and the
set is closed over them: a peer reset in the command brings its own peers.

Pure: facts in, sets out. suites/health/holders.py reads the topology and Fabric Manager's unit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pytest_gpuhost.modules.health.models import architecture

__all__ = ["FABRIC_UNIT", "BEFORE_AMPERE", "Node", "ResetSet", "nvlink_peers", "plan_sets", "together_why"]

FABRIC_UNIT = "nvidia-fabricmanager.service"  # NVIDIA Fabric Manager user guide
BEFORE_AMPERE = frozenset({"Kepler", "Maxwell", "Pascal", "Volta", "Turing"})
_NV = re.compile(r"^NV\d+$")


@dataclass(frozen=True)
class Node:
    """What decides, besides each GPU: NVSwitches on the node, and Fabric Manager running.

    `nvswitch` is None when it could not be told (the PCI listing unreadable).
    """

    nvswitch: bool | None
    fabric_manager: bool


@dataclass
class ResetSet:
    """GPUs (bus keys) that one `nvidia-smi -r -i A,B,...` resets, and why they go together."""

    gpus: list[str]
    why: str = ""  # empty: one GPU, reset alone
    owed: list[str] = field(default_factory=list)  # the GPUs that owe the reset


def nvlink_peers(
    matrix: Mapping[tuple[str, str], str], index_to_bus: Mapping[str, str]
) -> dict[str, set[str]]:
    """Return {bus: the buses of its NVLink peers} from a parsed `nvidia-smi topo -m` (parsers.TopoMatrix.links).

    `index_to_bus` maps nvidia-smi's index ("3") to a bus key; the matrix names GPUs "GPU3".
    """
    out: dict[str, set[str]] = {b: set() for b in index_to_bus.values()}
    for (a, b), cell in matrix.items():
        if a == b or not _NV.match(cell.strip()):
            continue
        ba, bb = index_to_bus.get(a.removeprefix("GPU")), index_to_bus.get(b.removeprefix("GPU"))
        if ba is None or bb is None or ba == bb:
            continue
        out.setdefault(ba, set()).add(bb)
        out.setdefault(bb, set()).add(ba)
    return out


def together_why(name: str, node: Node) -> str | None:
    """Return why a GPU of model `name` with NVLink peers must be reset with them, None if alone.

    The cases of nvidia-smi(1)'s text above, each in the words an operator checks it by
    ("Quadro GV100 is Volta, before Ampere").
    """
    arch = architecture(name)
    if arch is None:
        return f"the architecture of {name or 'this GPU'} is not known, so it may be before Ampere"
    if arch in BEFORE_AMPERE:
        return f"{name} is {arch}, before Ampere"
    if node.fabric_manager or node.nvswitch is False:
        return None  # Ampere on: alone on direct NVLink, and on NVSwitches while Fabric Manager runs
    where = "on NVSwitches" if node.nvswitch else "maybe on NVSwitches (not known)"
    return f"{arch} {where}, Fabric Manager not running ({FABRIC_UNIT})"


def plan_sets(
    owed: Iterable[str],
    names: Mapping[str, str],
    peers: Mapping[str, set[str]],
    node: Node,
) -> list[ResetSet]:
    """Group the GPUs that owe a reset into the sets nvidia-smi must reset in one command.

    `names`: {bus: model name as nvidia-smi prints it}. A GPU reset alone is a set of one. Sets
    that share a GPU are one set; a peer brought in by the rule brings its own peers in turn.
    """
    sets: list[ResetSet] = []
    placed: dict[str, ResetSet] = {}
    for bus in sorted(owed):
        if bus in placed:
            placed[bus].owed.append(bus)
            continue
        group, whys, todo = {bus}, [], [bus]
        while todo:
            g = todo.pop()
            if not peers.get(g):
                continue
            why = together_why(names.get(g, ""), node)
            if why is None:
                continue
            whys.append(why)
            for p in peers[g] - group:
                group.add(p)
                todo.append(p)
        merged = [s for s in sets if set(s.gpus) & group]
        for s in merged:
            sets.remove(s)
            group |= set(s.gpus)
        why = "; ".join(dict.fromkeys([*(s.why for s in merged if s.why), *whys]))
        new = ResetSet(sorted(group), why, [*(o for s in merged for o in s.owed), bus])
        sets.append(new)
        for g in new.gpus:
            placed[g] = new
    return sets

"""Lab machines whose GPUs cannot be reset one at a time, for the NVLink-set rule of `nvidia-smi -r`.

nvidia-smi(1), ``-r``: a GPU of an architecture before Ampere, or an Ampere GPU on NVSwitches
while Fabric Manager is not running, must be reset in one command with every GPU it has NVLink
connections to (gpulab_tools/nvidia_smi_reset.py emulates it; docs/LAB-SOURCES.md).

``gv100_bridged_pairs()``: the small inference node (`health-ok`) with four Quadro GV100 (Volta)
instead of its RTX PRO 6000s, joined in pairs by NVLink bridges (the GV100 takes a two-way bridge,
as NVIDIA's Quadro GV100 data sheet says; not re-read): 0000:13:00.0 with 0000:14:00.0, 0000:23:00.0 with
0000:24:00.0, PCIe between the pairs. Its SGLang server (tp=4) and nvidia-persistenced hold all
four.

``a100_nvswitch(fabric_manager=False)``: the HGX node (`b200-nvl8`) as an HGX A100 8-GPU board:
eight A100-SXM4 with twelve NVLinks each, all-to-all through six second-generation NVSwitches,
which the host sees as NVIDIA PCI functions of class 0x0680 (device 0x1af1, as lspci shows them
on such boards), and no Fabric Manager unit unless ``fabric_manager``.
"""

from __future__ import annotations

from typing import Any

from gpulab.profiles.load import load_profile
from gpulab.profiles.types import Profile

__all__ = ["GV100_PAIRS", "a100_nvswitch", "gv100_bridged_pairs"]

GV100_PAIRS = (("0000:13:00.0", "0000:14:00.0"), ("0000:23:00.0", "0000:24:00.0"))


def gv100_bridged_pairs() -> Profile:
    """`health-ok` with four Quadro GV100 bridged in pairs by NVLink."""
    base = load_profile("health-ok")
    gpus: list[dict[str, Any]] = []
    for g in base.raw["gpus"]:
        health = {**g.get("health", {}), "nvlinks": [25.0, 25.0, 25.0, 25.0]}
        gpus.append(
            {**g, "model": "Quadro GV100", "memory_mib": 32768, "power_limit": 250.0, "health": health}
        )
    links = [{"a": a, "b": b, "type": "nvlink", "gbps": 90.0} for a, b in GV100_PAIRS]
    return load_profile(
        "health-ok",
        overrides={"name": "gv100-pairs", "hostname": "gv100-node", "gpus": gpus, "links": links},
    )


def a100_nvswitch(fabric_manager: bool = False) -> Profile:
    """`b200-nvl8` as an HGX A100 8-GPU board on NVSwitches, Fabric Manager only if asked for."""
    base = load_profile("b200-nvl8")
    gpus = [
        {
            **g,
            "model": "NVIDIA A100-SXM4-80GB",
            "memory_mib": 81920,
            "power_limit": 400.0,
            "health": {**g.get("health", {}), "nvlinks": [25.0] * 12},
        }
        for g in base.raw["gpus"]
    ]
    switches = [
        {
            "bdf": f"0000:{0x04 + i:02x}:00.0",
            "vendor": "0x10de",
            "device": "0x1af1",
            "class": "0x068000",
            "driver": "nvidia",
            "iommu_group": 60 + i,
            "numa_node": 0,
        }
        for i in range(6)
    ]
    services = [s for s in base.raw["services"] if fabric_manager or s.get("name") != "nvidia-fabricmanager"]
    return load_profile(
        "b200-nvl8",
        overrides={
            "name": "a100-nvswitch" + ("" if fabric_manager else "-nofm"),
            "gpus": gpus,
            "pci": [*switches, *base.raw["pci"]],
            "services": services,
            "link_default": {"type": "nvlink", "gbps": 270.0},
        },
    )

"""Lab machines for suites/accept: the rented HGX B200 node (`b200-nvl8`) with a promise broken.

``gpu_short()``: one of the eight B200s failed the nvidia probe at boot: it is on the PCI bus
with no driver bound, so nvidia-smi lists seven (as `health-gpu-missing` models on the small
node: a GPU that fails RmInitAdapter is left unbound and nvidia-smi does not show it).
"""

from __future__ import annotations

from gpulab.profiles.load import load_profile
from gpulab.profiles.types import Profile

__all__ = ["gpu_short"]


def gpu_short() -> Profile:
    """`b200-nvl8` with its last GPU (0000:df:00.0) unbound: nvidia-smi lists 7 of 8."""
    base = load_profile("b200-nvl8")
    last = sorted(g["bdf"] for g in base.raw["gpus"])[-1]
    pci = [{k: v for k, v in f.items() if k != "driver"} if f["bdf"] == last else f for f in base.raw["pci"]]
    services = [s for s in base.raw["services"] if last not in (s.get("gpus") or [])]
    return load_profile(
        "b200-nvl8",
        overrides={"name": "b200-gpu-short", "hostname": "b200-node08", "pci": pci, "services": services},
    )

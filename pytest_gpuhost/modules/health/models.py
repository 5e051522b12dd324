"""The GPU models the health checks know: the figures each needs, and the names nvidia-smi prints.

`thresholds` reads its model defaults from here (and re-exports these names); a GPU whose name
matches no model is an unknown model, said in the verdict, never judged as a PCIe card.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "MODELS",
    "MODEL_SPECS",
    "architecture",
    "model_name",
    "model_spec",
    "unknown_models",
    "unknown_note",
]

#: Per GPU model, the figures the checks need (`MODEL_SPECS`, by model), and the names nvidia-smi
#: prints for it (`MODELS`: text the name contains, case-insensitive, as a whole model name - "B200"
#: does not match "NVIDIA GB200", "H20" not "NVIDIA H200"; the first match wins). A GPU whose name
#: matches none is an unknown model: the checks that need a model's figure say they cannot judge it
#: ("unknown model: NAME"), never judge it as a PCIe card. Each spec:
#: `nvlinks`, the NVLinks every GPU of the model must have active (0: none required; a PCIe card's
#: optional NVLink bridge is not required); `nvlink_gen`, the NVLink generation; `fabric`, the GPUs sit
#: on NVSwitches (HGX), where Fabric Manager must train the fabric before CUDA can use them (the
#: per-GPU fabric state of `nvidia-smi -q` / NVML `nvmlDeviceGetGpuFabricInfo` is reported from Hopper
#: on, so A100 is not judged by it); `ecc`, the model supports ECC (its datasheet), so ECC off fails;
#: `memory_temp_max`, the HBM's limit in C where no GPU reports its own: 95, as `nvidia-smi -q` prints
#: "Memory Max Operating Temp : 95 C" on H100-class boards; None where no figure was found (the GPU's
#: own limit is read on fabric models; GDDR boards print no memory temperature); `pcie_gen`,
#: `pcie_width`, the GPU's own PCIe link (reported beside the GPU's maximum, never failing it: the host
#: may allow less, e.g. a B300 behind Gen5 CPUs); `h2d_gbps_min`, the host<->device copy bandwidth every
#: GPU must reach (nvbandwidth, opt-in `diag`): 48 GB/s for H100/H200 as Azure's HPC health checks
#: expect; none known for the others; `nvlink_errors_max`, the growth of each NVLink error counter
#: allowed per link since the last run, per class (health_nvlink.CLASSES): 0 for every class, the
#: defaults of the NVLink error check of facebookresearch/gcm (`check-dcgmi nvlink`: CRC data/flit,
#: replay and recovery thresholds 0); an inventory nvlink_<class>_max overrides it; `arch`, the GPU
#: architecture NVIDIA names the model by (its datasheet's "NVIDIA Blackwell", "Hopper", "Ampere",
#: "Ada Lovelace"), which decides whether a reset must take the GPU's NVLink peers with it
#: (modules/health/reset_set.py). `source` names
#: where each figure comes from; a figure that could not be confirmed in an NVIDIA document says
#: "not verified".
_NVLINK_ERRORS_MAX = {"replay": 0, "recovery": 0, "crc": 0, "link_errors": 0}
_NVLINK5: dict[str, Any] = {
    "nvlinks": 18,
    "nvlink_gen": 5,
    "fabric": True,
    "ecc": True,
    "memory_temp_max": None,
    "nvlink_errors_max": _NVLINK_ERRORS_MAX,
}
# H100 and H200 share their limits: the PCIe/NVL cards, and the SXM boards on NVSwitches.
_HOPPER_PCIE: dict[str, Any] = {
    "nvlinks": 0,
    "nvlink_gen": 4,
    "fabric": False,
    "ecc": True,
    "memory_temp_max": 95,
    "h2d_gbps_min": 48,
    "pcie_gen": 5,
    "pcie_width": 16,
}
_HOPPER_SXM: dict[str, Any] = {
    **_HOPPER_PCIE,
    "nvlinks": 18,
    "fabric": True,
    "nvlink_errors_max": _NVLINK_ERRORS_MAX,
}
# NVIDIA's NVLink page (nvidia.com/en-us/data-center/nvlink/): "A single NVIDIA Blackwell Tensor
# Core GPU supports up to 18 NVLink 100 GB/s connections for a total bandwidth of 1.8 TB/s"; H100
# "18 NVLink connections" at 900 GB/s; A100 "up to twelve third-generation NVLink connections for a
# total bandwidth of 600 GB/s".
_NVLINK_PAGE = "NVIDIA NVLink product page (nvidia.com/data-center/nvlink)"
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "B300": {
        "arch": "Blackwell",
        **_NVLINK5,
        "pcie_gen": 6,
        "pcie_width": 16,
        "source": f"NVLinks: {_NVLINK_PAGE} (Blackwell: 18 x 100 GB/s), HGX B300 1.8 TB/s per GPU; "
        "18 links up in `nvidia-smi nvlink -s` of an HGX B300 on 610.57.04 (fixtures/outputs); "
        "fabric: that node runs nvidia-fabricmanager; PCIe Gen6 x16: not verified (third-party "
        "pages, no NVIDIA datasheet found)",
    },
    "GB300": {
        "arch": "Blackwell",
        **_NVLINK5,
        "fabric": False,
        "pcie_gen": None,
        "pcie_width": None,
        "source": f"NVLinks: {_NVLINK_PAGE} (Blackwell: 18 x 100 GB/s; GB300 NVL72 rack); fabric: "
        "the NVL72 NVLink fabric is managed from the NVLink switch trays, not by a Fabric Manager "
        "unit on the compute tray (not verified: no per-GPU fabric check here); PCIe: the GPU hangs "
        "off Grace over NVLink-C2C, no PCIe figure (not verified)",
    },
    "GB200": {
        "arch": "Blackwell",
        **_NVLINK5,
        "fabric": False,
        "pcie_gen": None,
        "pcie_width": None,
        "source": f"NVLinks: {_NVLINK_PAGE} (Blackwell: 18 x 100 GB/s; GB200 NVL72 rack); fabric "
        "and PCIe as GB300 (not verified)",
    },
    "B200": {
        "arch": "Blackwell",
        **_NVLINK5,
        "pcie_gen": 5,
        "pcie_width": 16,
        "source": f"NVLinks: NVIDIA B200 / HGX B200 datasheet and {_NVLINK_PAGE} (18 x 100 GB/s); "
        "PCIe Gen5 x16: not verified (HGX B200 host interface, no per-GPU datasheet figure found)",
    },
    "H200 NVL": {
        "arch": "Hopper",
        **_HOPPER_PCIE,
        "source": "NVIDIA H200 datasheet: H200 NVL, PCIe Gen5 x16, NVLink bridge optional (2- or 4-way), "
        "none required; HBM limit as H100",
    },
    "H200 SXM": {
        "arch": "Hopper",
        **_HOPPER_SXM,
        "source": "NVIDIA H200 datasheet: H200 SXM NVLink 900 GB/s (18 NVLink 4 links), PCIe Gen5 x16",
    },
    "H100 PCIe": {
        "arch": "Hopper",
        **_HOPPER_PCIE,
        "source": "NVIDIA H100 PCIe product brief PB-11133-001: a PCI Express Gen5 card; NVLink bridge "
        "optional, none required",
    },
    "H100 NVL": {
        "arch": "Hopper",
        **_HOPPER_PCIE,
        "source": "NVIDIA H100 datasheet: H100 NVL, PCIe Gen5 x16, NVLink bridge optional",
    },
    "H100 SXM": {
        "arch": "Hopper",
        **_HOPPER_SXM,
        "source": f"NVIDIA H100 datasheet and {_NVLINK_PAGE}: H100 SXM 18 NVLink 4 links, 900 GB/s; "
        "PCIe Gen5 x16",
    },
    "H800 PCIe": {
        "arch": "Hopper",
        **_HOPPER_PCIE,
        "memory_temp_max": None,
        "h2d_gbps_min": None,
        "source": "export variant of H100 PCIe: no NVLink required; PCIe Gen5 x16 and ECC as H100 PCIe "
        "(not verified: no NVIDIA datasheet found)",
    },
    "H800 SXM": {
        "arch": "Hopper",
        **_HOPPER_SXM,
        "nvlinks": 8,
        "memory_temp_max": None,
        "h2d_gbps_min": None,
        "source": "export-limited H100 SXM: NVLink 400 GB/s = 8 NVLink 4 links of 50 GB/s (`nvidia-smi "
        "topo -m` of 8x H800 prints NV8 between every pair, github.com/vllm-project/vllm/issues/40755; NVLink 400 "
        "GB/s: github.com/ai-dynamo/aiconfigurator/pull/968); on NVSwitches with a Fabric section in `nvidia-smi "
        "-q` (github.com/NVIDIA/DCGM/issues/120); PCIe Gen5 x16 and the HBM limit: not verified",
    },
    "H20": {
        "arch": "Hopper",
        **_HOPPER_SXM,
        "memory_temp_max": None,
        "h2d_gbps_min": None,
        "source": "China-market Hopper (HGX H20): NVLink 900 GB/s = 18 NVLink 4 links (not verified: "
        "third-party spec pages, no NVIDIA datasheet or capture found); NVSwitch fabric, PCIe Gen5 x16 "
        "and the HBM limit: not verified",
    },
    "A100 SXM4": {
        "arch": "Ampere",
        "nvlinks": 12,
        "nvlink_gen": 3,
        "fabric": False,
        "ecc": True,
        "memory_temp_max": None,
        "pcie_gen": 4,
        "pcie_width": 16,
        "nvlink_errors_max": _NVLINK_ERRORS_MAX,
        "source": f"{_NVLINK_PAGE}: A100 up to 12 third-generation NVLinks, 600 GB/s; NVIDIA A100 "
        "datasheet: PCIe Gen4 x16; fabric not judged (no per-GPU fabric state before Hopper); HBM "
        "limit: not verified",
    },
    "A100 PCIe": {
        "arch": "Ampere",
        "nvlinks": 0,
        "nvlink_gen": 3,
        "fabric": False,
        "ecc": True,
        "memory_temp_max": None,
        "pcie_gen": 4,
        "pcie_width": 16,
        "source": "NVIDIA A100 PCIe product brief PB-10137-001: a PCI Express Gen4 card, NVLink bridge "
        "for 2 GPUs optional, none required; HBM limit: not verified",
    },
    "L40S": {
        "arch": "Ada Lovelace",
        "nvlinks": 0,
        "fabric": False,
        "ecc": True,
        "memory_temp_max": None,
        "pcie_gen": 4,
        "pcie_width": 16,
        "source": "NVIDIA L40S datasheet, as vendor pages reproduce it: 48 GB GDDR6 with ECC, PCIe Gen4 "
        "x16 (64 GB/s bidirectional), NVLink not supported; GDDR: no memory temperature",
    },
    "RTX PRO 6000": {
        "arch": "Blackwell",
        "nvlinks": 0,
        "fabric": False,
        "ecc": True,
        "memory_temp_max": None,
        "pcie_gen": 5,
        "pcie_width": 16,
        "source": "NVIDIA RTX PRO 6000 Blackwell (Server, Workstation, Max-Q): 96 GB GDDR7 with ECC, no "
        "NVLink; PCIe Gen5 x16: not verified (product announcements, no datasheet found); GDDR7: no "
        "memory temperature",
    },
}
#: (text of the name, model): longer names first, so "H100 PCIe" is found before "H100".
_NAMES: tuple[tuple[str, str], ...] = (
    ("GB300", "GB300"),
    ("GB200", "GB200"),
    ("B300", "B300"),
    ("B200", "B200"),
    ("H100 PCIe", "H100 PCIe"),
    ("H100 NVL", "H100 NVL"),
    ("H100", "H100 SXM"),
    ("H200 NVL", "H200 NVL"),
    ("H200", "H200 SXM"),
    ("H800 PCIe", "H800 PCIe"),
    ("H800", "H800 SXM"),
    ("H20", "H20"),
    ("A100-SXM4", "A100 SXM4"),
    ("A100-PCIE", "A100 PCIe"),
    ("A100 80GB PCIe", "A100 PCIe"),
    ("L40S", "L40S"),
    ("RTX PRO 6000", "RTX PRO 6000"),
)
MODELS: tuple[tuple[str, dict[str, Any]], ...] = tuple((key, MODEL_SPECS[m]) for key, m in _NAMES)
_MODEL_BY_KEY = dict(_NAMES)
_KEY_RES = tuple(
    (re.compile(r"(?<![a-z0-9])" + re.escape(key.lower()) + r"(?![0-9])"), key) for key, _ in _NAMES
)


def model_name(name: str) -> str | None:
    """Return the MODEL_SPECS model of a GPU name as nvidia-smi prints it, None for a model not listed."""
    low = name.lower()
    for rx, key in _KEY_RES:
        if rx.search(low):
            return _MODEL_BY_KEY[key]
    return None


def model_spec(name: str) -> dict[str, Any] | None:
    """Return the MODELS entry for a GPU name as nvidia-smi prints it, None for a model not listed."""
    model = model_name(name)
    return MODEL_SPECS[model] if model is not None else None


#: GPUs before Ampere that have NVLink, which the model table does not judge, by the names
#: nvidia-smi prints for them ("Tesla V100-SXM2-32GB", "Quadro GV100", "Tesla P100-SXM2-16GB"):
#: only their architecture is known here, for the reset rule of reset_set.py.
_OLDER: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(r"(?<![a-z0-9])" + key + r"(?![0-9])"), arch)
    for key, arch in (("v100", "Volta"), ("gv100", "Volta"), ("p100", "Pascal"), ("gp100", "Pascal"))
)


def architecture(name: str) -> str | None:
    """Return the architecture of a GPU name as nvidia-smi prints it ("Blackwell"), None if not known."""
    spec = model_spec(name)
    if spec is not None:
        return str(spec["arch"])
    low = name.lower()
    return next((arch for rx, arch in _OLDER if rx.search(low)), None)


def unknown_models(gpus: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Return {GPU name: [nvidia-smi indexes]} of the GPUs whose name matches no model."""
    out: dict[str, list[str]] = {}
    for g in gpus:
        name = str(g.get("name") or "")
        if model_name(name) is None:
            out.setdefault(name or "(no name)", []).append(str(g.get("index", "?")))
    return out


def unknown_note(gpus: Iterable[Mapping[str, Any]], what: str) -> str:
    """Say which GPUs are an unknown model and what is not judged for them ("" when none)."""
    parts = [
        f"unknown model: {name} (GPU {', '.join(idx)})" for name, idx in sorted(unknown_models(gpus).items())
    ]
    return f"{'; '.join(parts)}: {what}" if parts else ""

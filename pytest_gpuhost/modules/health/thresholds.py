"""The health checks' thresholds: every inventory variable they read, its default and meaning.

`THRESHOLDS` is the one source of the defaults and of their help text (docs/fleet.md shows it);
`Thresholds.from_vars` overlays a host's inventory variables on it and checks their types.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MODELS",
    "MODEL_SPECS",
    "THRESHOLDS",
    "Threshold",
    "ThresholdError",
    "Thresholds",
    "diag_tools",
    "model_name",
    "model_spec",
    "mount_specs",
    "probe_params",
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
#: replay and recovery thresholds 0); an inventory nvlink_<class>_max overrides it. `source` names
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
        **_NVLINK5,
        "pcie_gen": 6,
        "pcie_width": 16,
        "source": f"NVLinks: {_NVLINK_PAGE} (Blackwell: 18 x 100 GB/s), HGX B300 1.8 TB/s per GPU; "
        "18 links up in `nvidia-smi nvlink -s` of an HGX B300 on 610.57.04 (fixtures/outputs); "
        "fabric: that node runs nvidia-fabricmanager; PCIe Gen6 x16: not verified (third-party "
        "pages, no NVIDIA datasheet found)",
    },
    "GB300": {
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
        **_NVLINK5,
        "fabric": False,
        "pcie_gen": None,
        "pcie_width": None,
        "source": f"NVLinks: {_NVLINK_PAGE} (Blackwell: 18 x 100 GB/s; GB200 NVL72 rack); fabric "
        "and PCIe as GB300 (not verified)",
    },
    "B200": {
        **_NVLINK5,
        "pcie_gen": 5,
        "pcie_width": 16,
        "source": f"NVLinks: NVIDIA B200 / HGX B200 datasheet and {_NVLINK_PAGE} (18 x 100 GB/s); "
        "PCIe Gen5 x16: not verified (HGX B200 host interface, no per-GPU datasheet figure found)",
    },
    "H200 NVL": {
        **_HOPPER_PCIE,
        "source": "NVIDIA H200 datasheet: H200 NVL, PCIe Gen5 x16, NVLink bridge optional (2- or 4-way), "
        "none required; HBM limit as H100",
    },
    "H200 SXM": {
        **_HOPPER_SXM,
        "source": "NVIDIA H200 datasheet: H200 SXM NVLink 900 GB/s (18 NVLink 4 links), PCIe Gen5 x16",
    },
    "H100 PCIe": {
        **_HOPPER_PCIE,
        "source": "NVIDIA H100 PCIe product brief PB-11133-001: a PCI Express Gen5 card; NVLink bridge "
        "optional, none required",
    },
    "H100 NVL": {
        **_HOPPER_PCIE,
        "source": "NVIDIA H100 datasheet: H100 NVL, PCIe Gen5 x16, NVLink bridge optional",
    },
    "H100 SXM": {
        **_HOPPER_SXM,
        "source": f"NVIDIA H100 datasheet and {_NVLINK_PAGE}: H100 SXM 18 NVLink 4 links, 900 GB/s; "
        "PCIe Gen5 x16",
    },
    "H800 PCIe": {
        **_HOPPER_PCIE,
        "memory_temp_max": None,
        "h2d_gbps_min": None,
        "source": "export variant of H100 PCIe: no NVLink required; PCIe Gen5 x16 and ECC as H100 PCIe "
        "(not verified: no NVIDIA datasheet found)",
    },
    "H800 SXM": {
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
        **_HOPPER_SXM,
        "memory_temp_max": None,
        "h2d_gbps_min": None,
        "source": "China-market Hopper (HGX H20): NVLink 900 GB/s = 18 NVLink 4 links (not verified: "
        "third-party spec pages, no NVIDIA datasheet or capture found); NVSwitch fabric, PCIe Gen5 x16 "
        "and the HBM limit: not verified",
    },
    "A100 SXM4": {
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


class ThresholdError(ValueError):
    """An inventory variable has a value the health checks cannot use; the message names it."""


@dataclass(frozen=True)
class Threshold:
    """One inventory variable the checks read: its name, default and meaning."""

    name: str
    default: Any
    kind: type | tuple[type, ...]
    help: str


THRESHOLDS: tuple[Threshold, ...] = (
    Threshold(
        "gpu_count",
        None,
        int,
        "GPUs nvidia-smi must see; unset: the NVIDIA display/3D controllers on the PCI bus not on vfio-pci",
    ),
    Threshold("gpu_model", None, str, "text every GPU's name must contain (case-insensitive); unset: any"),
    Threshold("driver_version", None, str, "exact driver version expected; unset: fleet uniformity only"),
    Threshold(
        "cuda_version",
        None,
        str,
        "exact CUDA version (nvidia-smi header) expected; unset: fleet uniformity only",
    ),
    Threshold("persistence_mode", True, bool, "persistence mode must be on for every GPU"),
    Threshold("ecc_uncorrected_max", 0, int, "most volatile uncorrected ECC errors allowed per GPU"),
    Threshold(
        "ecc_required", None, bool, "ECC must be on; unset: on every GPU whose model supports it (MODELS)"
    ),
    Threshold(
        "memory_temperature_max",
        None,
        (int, float),
        "hottest GPU memory (HBM) allowed, C; unset: the GPU's Memory Max Operating Temp, else the model's",
    ),
    Threshold(
        "ecc_corrected_max", None, int, "most volatile corrected ECC errors per GPU; unset: reported only"
    ),
    Threshold(
        "xid_ignore",
        [13, 31, 43, 45],
        list,
        "Xid codes that never fail the host (others: by NVIDIA's catalogue, health_xid)",
    ),
    Threshold("sxid_ignore", [], list, "SXid codes that do not fail the host"),
    Threshold("pcie_gen_min", None, int, "lowest PCIe generation allowed; unset: the GPU's maximum"),
    Threshold("pcie_width_min", None, int, "narrowest PCIe link width allowed; unset: the GPU's maximum"),
    Threshold(
        "nvlink_required", None, bool, "fail when no NVLink is reported; unset: skip hosts without NVLink"
    ),
    Threshold(
        "nvlink_active_min",
        None,
        int,
        "active NVLinks every GPU must have; unset: the model's (MODELS: 18 for B200, H100/H200 SXM)",
    ),
    *(
        Threshold(
            f"nvlink_{cls}_max",
            None,
            int,
            f"growth of each NVLink {what} counter allowed per link since the last run; "
            "unset: the model's (MODELS: 0)",
        )
        for cls, what in (
            ("replay", "replay-error"),
            ("recovery", "recovery-error / link-recovery-event"),
            ("crc", "CRC-error"),
            ("link_errors", "packet/link-error (NVLink 5: Rx, Symbol, Malformed packet, ...)"),
        )
    ),
    Threshold(
        "ib_ports",
        [],
        list,
        "RDMA ports (DEV/PORT, e.g. mlx5_0/1) that must be ACTIVE; unset: InfiniBand ones and those active last run",
    ),
    Threshold(
        "ib_rate_min_gbps",
        None,
        (int, float),
        "slowest RDMA port rate allowed; unset: its rate at the last run",
    ),
    Threshold("ib_link_downed_max", 0, int, "link_downed events allowed per RDMA port since the last run"),
    Threshold(
        "ib_peermem_required", True, bool, "nvidia_peermem must be loaded where an RDMA port is active"
    ),
    Threshold("iommu_group_types", ["identity"], list, "IOMMU group types allowed for GPUs on nvidia"),
    Threshold(
        "acs_redirect_allowed", False, bool, "allow ACS P2P request/completion redirect on GPU bridges"
    ),
    Threshold("p2p_required", True, bool, "every pair of GPUs on nvidia must report P2P OK"),
    Threshold(
        "throttle_fail_mask", 0xE8, int, "throttle reason bits that fail (HW slowdown, thermal, power brake)"
    ),
    Threshold(
        "clock_event_hw_max_s",
        0,
        (int, float),
        "seconds of HW slowdown (thermal or power brake) allowed per GPU since the last run",
    ),
    Threshold(
        "clock_event_sw_thermal_max_s",
        300,
        (int, float),
        "seconds of SW thermal slowdown allowed per GPU since the last run",
    ),
    Threshold(
        "pcie_aer_correctable_max",
        100,
        int,
        "PCIe AER correctable errors allowed per GPU since the last run (fatal and non-fatal: none)",
    ),
    Threshold("temperature_max", 85, (int, float), "hottest GPU temperature allowed, degrees C"),
    Threshold(
        "temperature_noise", 2, (int, float), "noise band around temperature_max that triggers re-reads"
    ),
    Threshold("data_paths", ["/"], list, "paths whose file system must have free space (and be writable)"),
    Threshold(
        "mounts",
        [],
        list,
        "paths that must be mount points of their own, read-write ({path: P, ro: true} allows read-only)",
    ),
    Threshold("disk_free_min_pct", 10, (int, float), "least free space on each data path, percent"),
    Threshold(
        "disk_free_min_gib",
        None,
        (int, float),
        "least free space on each data path, GiB; unset: percent only",
    ),
    Threshold(
        "disk_free_noise_pct", 0.5, (int, float), "noise band around disk_free_min_pct that triggers re-reads"
    ),
    Threshold(
        "service", None, (str, list), "systemd unit(s) of the inference service; unset: service checks skip"
    ),
    Threshold("service_port", None, int, "port of the service's HTTP health endpoint on localhost"),
    Threshold("service_health_path", "/health", str, "path of the health endpoint"),
    Threshold("service_health_timeout", 3, (int, float), "seconds to wait for the health endpoint"),
    Threshold(
        "diag",
        [],
        list,
        "active diagnostics to run (opt-in, they load the GPUs): nvbandwidth, dcgm; where installed",
    ),
    Threshold("diag_level", 1, int, "dcgmi diag run level (1 quick .. 4 long)"),
    Threshold(
        "diag_timeout",
        90,
        (int, float),
        "seconds all diagnostics of a host may take (at most 4 x probe_timeout + 10)",
    ),
    Threshold(
        "h2d_bandwidth_min_gbps",
        None,
        (int, float),
        "host<->device copy GB/s every GPU must reach (nvbandwidth); unset: the model's (MODELS)",
    ),
    Threshold("reread_count", 3, int, "re-reads of a measurement inside its noise band"),
    Threshold("reread_interval", 0.5, (int, float), "seconds between re-reads"),
    Threshold("probe_timeout", 20, (int, float), "timeout of each command the health probe runs, seconds"),
)
_BY_NAME = {t.name: t for t in THRESHOLDS}


@dataclass
class Thresholds:
    """The thresholds of one host: the documented defaults overlaid with its inventory vars."""

    values: dict[str, Any]

    @classmethod
    def from_vars(cls, host_vars: Mapping[str, Any] | None) -> Thresholds:
        """Pick the known variables out of a host's vars and check their types.

        Unknown variables are ignored (inventories carry vars for other suites); a known one
        with the wrong type raises ThresholdError naming it.
        """
        values = {t.name: t.default for t in THRESHOLDS}
        for name, value in (host_vars or {}).items():
            spec = _BY_NAME.get(name)
            if spec is None or value is None:
                continue
            kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
            if isinstance(value, str) and int in kinds and str not in kinds:
                try:
                    value = int(value, 0)
                except ValueError:
                    pass
            if isinstance(value, str) and float in kinds and str not in kinds:
                try:
                    value = float(value)
                except ValueError:
                    pass
            if isinstance(value, str) and bool in kinds and value.lower() in ("true", "false", "yes", "no"):
                value = value.lower() in ("true", "yes")
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                raise ThresholdError(
                    f"inventory variable {name}={value!r}: expected {_kind_names(kinds)} ({spec.help})"
                )
            values[name] = value
        return cls(values)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    @property
    def services(self) -> list[str]:
        """Return the configured service units, each with a `.service` suffix."""
        raw = self.values["service"]
        names = [raw] if isinstance(raw, str) else list(raw or [])
        return [n if "." in n else n + ".service" for n in names]


def _kind_names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def mount_specs(t: Thresholds) -> list[tuple[str, bool]]:
    """Return the inventory's `mounts` as (path, read-only allowed); a bad entry raises ThresholdError."""
    out = []
    for entry in t["mounts"] or []:
        if isinstance(entry, str):
            path, ro_ok = entry, False
        elif isinstance(entry, Mapping) and isinstance(entry.get("path"), str):
            path, ro_ok = entry["path"], bool(entry.get("ro", False))
        else:
            raise ThresholdError(
                f"inventory variable mounts: entry {entry!r} is neither a path nor {{path: P, ro: true}}"
            )
        if not path.startswith("/") or "\x00" in path:
            raise ThresholdError(f"inventory variable mounts: {path!r} is not an absolute path")
        out.append((path.rstrip("/") or "/", ro_ok))
    return out


DIAG_TOOLS = ("nvbandwidth", "dcgm")


def diag_tools(t: Thresholds) -> list[str]:
    """Return the inventory's `diag` list; an unknown name raises ThresholdError."""
    bad = [d for d in t["diag"] if d not in DIAG_TOOLS]
    if bad:
        raise ThresholdError(f"inventory variable diag: {bad[0]!r} is not one of {', '.join(DIAG_TOOLS)}")
    return list(t["diag"])


def probe_params(t: Thresholds) -> dict[str, Any]:
    """Return the `health` fact's params for a host with these thresholds."""
    services = []
    for i, unit in enumerate(t.services):
        svc: dict[str, Any] = {"unit": unit, "timeout": t["service_health_timeout"]}
        if t["service_port"] is not None and i == 0:
            svc["url"] = f"http://127.0.0.1:{int(t['service_port'])}{t['service_health_path']}"
        services.append(svc)
    return {
        "data_paths": list(t["data_paths"]),
        "mounts": [path for path, _ in mount_specs(t)],
        "diag": diag_tools(t),
        "diag_level": t["diag_level"],
        # the request's bound gives each fact after `health` 4 x probe_timeout + 10 s
        "diag_timeout": min(float(t["diag_timeout"]), 4 * float(t["probe_timeout"]) + 10),
        "services": services,
        "timeout": t["probe_timeout"],
        # the probe reads the fabric (nvidia-smi -q) only on GPUs of these models: first match wins
        "fabric_models": [[key, bool(spec.get("fabric"))] for key, spec in MODELS],
    }

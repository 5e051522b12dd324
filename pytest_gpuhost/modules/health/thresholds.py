"""The health checks' thresholds: every inventory variable they read, its default and meaning.

`THRESHOLDS` is the one source of the defaults and of their help text (docs/fleet.md shows it);
`Thresholds.from_vars` overlays a host's inventory variables on it and checks their types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_gpuhost.modules.health.models import (
    MODEL_SPECS,
    MODELS,
    model_name,
    model_spec,
    unknown_models,
    unknown_note,
)

__all__ = [
    "MODELS",
    "MODEL_SPECS",
    "THRESHOLDS",
    "Threshold",
    "ThresholdError",
    "Thresholds",
    "diag_tools",
    "markdown_table",
    "model_name",
    "model_spec",
    "mount_specs",
    "probe_params",
    "unknown_models",
    "unknown_note",
]


def _shown(name: str, value: Any) -> str:
    """A default as docs/fleet.md shows it: unset, true/false, [a, b], a mask in hex."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(name, v) for v in value) + "]"
    if isinstance(value, int) and name.endswith("_mask"):
        return hex(value)
    return str(value)


def markdown_table() -> str:
    """Return the thresholds table of docs/fleet.md, one row per `THRESHOLDS` entry, in its order.

    scripts/docs_tables.py writes it into the doc; a test fails when the doc's copy is stale.
    """
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{t.name}` | {_shown(t.name, t.default)} | {t.help} |" for t in THRESHOLDS]
    return "\n".join(rows) + "\n"


class ThresholdError(ValueError):
    """An inventory variable has a value the health checks cannot use; the message names it."""


@dataclass(frozen=True)
class Threshold:
    """One inventory variable the checks read: its name, default and meaning."""

    name: str
    default: Any
    kind: type | tuple[type, ...]
    help: str
    #: the words a string variable may take (matched without case, kept as written here)
    choices: tuple[str, ...] = ()


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
        "mig_mode",
        "Disabled",
        str,
        "the MIG mode of every GPU whose model has MIG, now and after its next reset: "
        "Disabled, Enabled, or any (not judged)",
        choices=("Disabled", "Enabled", "any"),
    ),
    Threshold(
        "xid_ignore",
        [13, 31, 43, 45],
        list,
        "Xid codes that never fail the host (others: by NVIDIA's catalogue, modules/health/xid)",
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
            if spec.choices and isinstance(value, str):
                word = next((c for c in spec.choices if c.lower() == value.lower()), None)
                if word is None:
                    raise ThresholdError(
                        f"inventory variable {name}={value!r}: expected one of {', '.join(spec.choices)}"
                    )
                value = word
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

"""Health verdicts: one host's `health` facts and its thresholds -> one verdict per check.

Pure logic, no I/O: the facts come from the agent's `health` fact (agent/probe_health.py, one
request per host), the thresholds from the inventory's host and group variables (`THRESHOLDS`
lists every variable with its default and meaning; docs/fleet.md shows them). Every verdict says
why, in one summary line plus one reason per offending GPU, line or path.

Measurements that jitter (temperature, free disk) are judged with a noise band: a value within
the band of its limit is not trusted on one reading. `evaluate` then returns `reread` naming the
facts part to sample again; the caller gathers N samples (in one more request) and calls
`evaluate` again with them, and the median of all readings decides. A value that flaps around
its limit therefore does not flip the verdict night after night.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.modules.parsers import P2P_STATUS_LEGEND

__all__ = [
    "CHECKS",
    "FIXES",
    "THRESHOLDS",
    "Threshold",
    "Thresholds",
    "ThresholdError",
    "Verdict",
    "evaluate",
    "probe_params",
    "throttle_reason_names",
]

Facts = Mapping[str, Any]


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
    Threshold("gpu_count", None, int, "GPUs nvidia-smi must see; unset: at least one"),
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
        "ecc_corrected_max", None, int, "most volatile corrected ECC errors per GPU; unset: reported only"
    ),
    Threshold(
        "xid_ignore", [13, 31, 43, 45], list, "Xid codes that do not fail the host (application faults)"
    ),
    Threshold("sxid_ignore", [], list, "SXid codes that do not fail the host"),
    Threshold("pcie_gen_min", None, int, "lowest PCIe generation allowed; unset: the GPU's maximum"),
    Threshold("pcie_width_min", None, int, "narrowest PCIe link width allowed; unset: the GPU's maximum"),
    Threshold(
        "nvlink_required", None, bool, "fail when no NVLink is reported; unset: skip hosts without NVLink"
    ),
    Threshold("iommu_group_types", ["identity"], list, "IOMMU group types allowed for GPUs on nvidia"),
    Threshold(
        "acs_redirect_allowed", False, bool, "allow ACS P2P request/completion redirect on GPU bridges"
    ),
    Threshold("p2p_required", True, bool, "every pair of GPUs on nvidia must report P2P OK"),
    Threshold(
        "throttle_fail_mask", 0xE8, int, "throttle reason bits that fail (HW slowdown, thermal, power brake)"
    ),
    Threshold("temperature_max", 85, (int, float), "hottest GPU temperature allowed, degrees C"),
    Threshold(
        "temperature_noise", 2, (int, float), "noise band around temperature_max that triggers re-reads"
    ),
    Threshold("data_paths", ["/"], list, "paths whose file system must have free space"),
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
    Threshold("reread_count", 3, int, "re-reads of a measurement inside its noise band"),
    Threshold("reread_interval", 0.5, (int, float), "seconds between re-reads"),
    Threshold("probe_timeout", 20, (int, float), "timeout of each command the health probe runs, seconds"),
)
_BY_NAME = {t.name: t for t in THRESHOLDS}

#: The checks, in the order the suite runs them.
CHECKS: tuple[str, ...] = (
    "gpu_count",
    "driver_version",
    "cuda_version",
    "persistence_mode",
    "ecc",
    "retired_pages",
    "remapped_rows",
    "xid",
    "sxid",
    "pcie_link",
    "nvlink",
    "iommu_group_type",
    "acs",
    "p2p",
    "throttle",
    "temperature",
    "disk_free",
    "service",
    "service_health",
)

#: Safe fixes `--fix=NAME` offers, and the check each repairs.
FIXES: Mapping[str, str] = {"persistence": "persistence_mode", "service": "service"}

_THROTTLE_BITS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
_GEN_BY_SPEED = {
    "2.5": 1,
    "5.0": 2,
    "5": 2,
    "8.0": 3,
    "8": 3,
    "16.0": 4,
    "16": 4,
    "32.0": 5,
    "32": 5,
    "64.0": 6,
    "64": 6,
}


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


def probe_params(t: Thresholds) -> dict[str, Any]:
    """Return the `health` fact's params for a host with these thresholds."""
    services = []
    for i, unit in enumerate(t.services):
        svc: dict[str, Any] = {"unit": unit, "timeout": t["service_health_timeout"]}
        if t["service_port"] is not None and i == 0:
            svc["url"] = f"http://127.0.0.1:{int(t['service_port'])}{t['service_health_path']}"
        services.append(svc)
    return {"data_paths": list(t["data_paths"]), "services": services, "timeout": t["probe_timeout"]}


@dataclass
class Verdict:
    """One check's verdict on one host: ok, skipped, or failed, and why."""

    check: str
    ok: bool
    summary: str
    reasons: list[str] = field(default_factory=list)
    skip: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    fix: str | None = None  # the --fix name that can repair it
    reread: str | None = None  # facts part to sample again before deciding

    def as_dict(self) -> dict[str, Any]:
        """Return the verdict as JSON-able data."""
        return {
            "check": self.check,
            "ok": self.ok,
            "summary": self.summary,
            "reasons": list(self.reasons),
            "skip": self.skip,
            "state": self.state,
            "fix": self.fix,
        }


def _skip(check: str, why: str, **state: Any) -> Verdict:
    return Verdict(check, True, why, skip=why, state=dict(state))


def _part(facts: Facts, name: str) -> tuple[Mapping[str, Any] | None, str | None]:
    part = facts.get(name)
    if not isinstance(part, Mapping):
        return None, f"{name}: not gathered"
    if part.get("ok") is False or "error" in part and part.get("ok") is None:
        return None, str(part.get("error") or f"{name}: failed")
    return part, None


def _gpus(facts: Facts) -> tuple[list[Mapping[str, Any]], str | None]:
    part, err = _part(facts, "gpus")
    if part is None:
        return [], err
    return list(part.get("gpus") or []), None


def _gpu_label(g: Mapping[str, Any]) -> str:
    return f"GPU {g.get('index', '?')} ({g.get('bdf', '?')})"


def _fail(check: str, summary: str, reasons: Sequence[str], **kw: Any) -> Verdict:
    return Verdict(check, False, summary, list(reasons), **kw)


# ---------------------------------------------------------------- the checks


def check_gpu_count(facts: Facts, t: Thresholds) -> Verdict:
    gpus, err = _gpus(facts)
    if err:
        return _fail("gpu_count", f"nvidia-smi failed: {err}", [err])
    names = [str(g.get("name") or "") for g in gpus]
    models = sorted(set(names))
    state: dict[str, Any] = {"count": len(gpus), "models": models}
    reasons = []
    want = t["gpu_count"]
    if want is not None and len(gpus) != want:
        reasons.append(f"nvidia-smi sees {len(gpus)} GPUs, the inventory expects {want}")
    if want is None and not gpus:
        reasons.append("nvidia-smi sees no GPU")
    model = t["gpu_model"]
    if model:
        for g, n in zip(gpus, names, strict=True):
            if model.lower() not in n.lower():
                reasons.append(f"{_gpu_label(g)} is {n!r}, expected {model!r}")
    pci, _ = _part(facts, "pci")
    if pci is not None:
        bound = sorted(b for b, d in (pci.get("devices") or {}).items() if d.get("driver") == "nvidia")
        seen = {g.get("bdf") for g in gpus}
        lost = [b for b in bound if b not in seen]
        state["nvidia_bound"] = len(bound)
        for b in lost:
            reasons.append(f"{b} is bound to nvidia but nvidia-smi does not list it (fallen off the bus?)")
    desc = f"{len(gpus)} GPUs" + (f" ({', '.join(models)})" if gpus else "")
    if reasons:
        return _fail("gpu_count", f"{desc}: {reasons[0]}", reasons, state=state)
    return Verdict(
        "gpu_count", True, desc + (f", as expected ({want})" if want is not None else ""), state=state
    )


def _version_check(check: str, found: Sequence[str | None], want: str | None, what: str) -> Verdict:
    versions = sorted({v for v in found if v})
    state = {"versions": versions, check: versions[0] if len(versions) == 1 else None}
    if not versions:
        return _fail(check, f"{what} unknown: nvidia-smi did not report it", [], state=state)
    if len(versions) > 1:
        return _fail(check, f"{what} differs between GPUs: {', '.join(versions)}", [], state=state)
    if want is not None and versions[0] != want:
        return _fail(check, f"{what} {versions[0]}, the inventory expects {want}", [], state=state)
    note = ", as expected" if want is not None else " (fleet uniformity is judged in the fleet summary)"
    return Verdict(check, True, f"{what} {versions[0]}{note}", state=state)


def check_driver_version(facts: Facts, t: Thresholds) -> Verdict:
    gpus, err = _gpus(facts)
    found = [g.get("driver_version") for g in gpus]
    smi, _ = _part(facts, "smi")
    if not found and smi is not None:
        found = [smi.get("driver_version")]
    if err and not found:
        return _fail("driver_version", f"nvidia-smi failed: {err}", [err])
    return _version_check("driver_version", found, t["driver_version"], "driver")


def check_cuda_version(facts: Facts, t: Thresholds) -> Verdict:
    smi, err = _part(facts, "smi")
    if smi is None:
        return _fail("cuda_version", f"nvidia-smi failed: {err}", [str(err)])
    v = _version_check("cuda_version", [smi.get("cuda_version")], t["cuda_version"], "CUDA")
    cached = smi.get("cached")
    if isinstance(cached, dict):
        # read from the health state: the same driver reported this CUDA version on an earlier run
        when = cached.get("at")
        stamp = (
            time.strftime("%Y-%m-%d %H:%M", time.gmtime(when)) + " UTC"
            if isinstance(when, int | float)
            else "?"
        )
        v.state["source"] = f"cached for driver {cached.get('driver_version')} (nvidia-smi header, {stamp})"
        v.reasons.append(
            f"CUDA version cached: driver {cached.get('driver_version')} unchanged since {stamp}"
        )
    else:
        v.state["source"] = "nvidia-smi header"
    return v


def check_persistence_mode(facts: Facts, t: Thresholds) -> Verdict:
    if not t["persistence_mode"]:
        return _skip("persistence_mode", "not required (persistence_mode: false)")
    gpus, err = _gpus(facts)
    if err:
        return _fail("persistence_mode", f"nvidia-smi failed: {err}", [err])
    off = [g for g in gpus if g.get("persistence_mode") != 1]
    state = {"off": [g.get("bdf") for g in off], "gpus": len(gpus)}
    if off:
        reasons = [
            f"{_gpu_label(g)}: persistence mode {g.get('raw', {}).get('persistence_mode', '?')}" for g in off
        ]
        return _fail(
            "persistence_mode",
            f"persistence mode off on {len(off)} of {len(gpus)} GPUs",
            reasons,
            state=state,
            fix="persistence",
        )
    return Verdict("persistence_mode", True, f"persistence mode on for all {len(gpus)} GPUs", state=state)


def _per_gpu_counter(
    check: str, facts: Facts, field_name: str, limit: int | None, what: str, na_skip: str
) -> tuple[Verdict | None, list[str], dict[str, Any]]:
    gpus, err = _gpus(facts)
    if err:
        return _fail(check, f"nvidia-smi failed: {err}", [err]), [], {}
    values = {str(g.get("bdf")): g.get(field_name) for g in gpus}
    known = {k: v for k, v in values.items() if isinstance(v, int | float)}
    if gpus and not known:
        return _skip(check, na_skip), [], {}
    reasons = []
    if limit is not None:
        for g in gpus:
            v = g.get(field_name)
            if isinstance(v, int | float) and v > limit:
                reasons.append(f"{_gpu_label(g)}: {what} {v:g} > {limit}")
    return None, reasons, {field_name: values}


def check_ecc(facts: Facts, t: Thresholds) -> Verdict:
    done, reasons, state = _per_gpu_counter(
        "ecc",
        facts,
        "ecc.errors.uncorrected.volatile.total",
        t["ecc_uncorrected_max"],
        "uncorrected ECC errors",
        "ECC not enabled or not supported on these GPUs",
    )
    if done:
        return done
    done2, reasons2, state2 = _per_gpu_counter(
        "ecc",
        facts,
        "ecc.errors.corrected.volatile.total",
        t["ecc_corrected_max"],
        "corrected ECC errors",
        "",
    )
    reasons += reasons2 if not done2 else []
    state.update(state2)
    if reasons:
        return _fail("ecc", reasons[0], reasons, state=state)
    total_unc = sum(v for v in state[next(iter(state))].values() if isinstance(v, int | float))
    return Verdict(
        "ecc",
        True,
        f"{total_unc:g} uncorrected ECC errors (limit {t['ecc_uncorrected_max']} per GPU)",
        state=state,
    )


def check_retired_pages(facts: Facts, t: Thresholds) -> Verdict:
    done, reasons, state = _per_gpu_counter(
        "retired_pages",
        facts,
        "retired_pages.pending",
        0,
        "retired pages pending (reset needed)",
        "GPUs do not retire pages (row remapping instead)",
    )
    if done:
        return done
    if reasons:
        return _fail("retired_pages", reasons[0], reasons, state=state)
    return Verdict("retired_pages", True, "no retired pages pending", state=state)


def check_remapped_rows(facts: Facts, t: Thresholds) -> Verdict:
    done, reasons, state = _per_gpu_counter(
        "remapped_rows",
        facts,
        "remapped_rows.failure",
        0,
        "row remapping failure",
        "GPUs do not remap rows (page retirement instead)",
    )
    if done:
        return done
    if reasons:
        return _fail("remapped_rows", reasons[0], reasons, state=state)
    return Verdict("remapped_rows", True, "no row remapping failure", state=state)


def _kernel_errors(check: str, facts: Facts, key: str, ignore: Sequence[int], label: str) -> Verdict:
    part, err = _part(facts, "kernel_log")
    if part is None:
        return _fail(check, f"kernel log unreadable: {err}", [str(err)])
    events = list(part.get(key) or [])
    counted = [e for e in events if int(e.get("code", -1)) not in set(ignore)]
    ignored = [e for e in events if e not in counted]
    window = "since boot (first run; baseline recorded)" if part.get("first_run") else "since the last run"
    ignored_codes = sorted({int(e["code"]) for e in ignored})
    state = {
        "window": window,
        "since": part.get("since"),
        "events": [{k: e.get(k) for k in ("ts", "bdf", "code", "msg")} for e in events],
        "ignored_codes": ignored_codes,
    }
    note = f"; {len(ignored)} ignored ({', '.join(str(c) for c in ignored_codes)})" if ignored else ""
    if counted:
        codes = sorted({int(e["code"]) for e in counted})
        reasons = [f"{label} {e.get('code')} on {e.get('bdf')}: {e.get('msg')}" for e in counted]
        return _fail(
            check,
            f"{len(counted)} {label} error(s) {window}: code {', '.join(map(str, codes))}{note}",
            reasons,
            state=state,
        )
    return Verdict(check, True, f"no {label} errors {window}{note}", state=state)


def check_xid(facts: Facts, t: Thresholds) -> Verdict:
    return _kernel_errors("xid", facts, "xid", t["xid_ignore"], "Xid")


def check_sxid(facts: Facts, t: Thresholds) -> Verdict:
    return _kernel_errors("sxid", facts, "sxid", t["sxid_ignore"], "SXid")


def _sysfs_gen(speed: Any) -> int | None:
    if not isinstance(speed, str):
        return None
    return _GEN_BY_SPEED.get(speed.split(" ")[0])


def check_pcie_link(facts: Facts, t: Thresholds) -> Verdict:
    gpus, err = _gpus(facts)
    if err:
        return _fail("pcie_link", f"nvidia-smi failed: {err}", [err])
    pci, _ = _part(facts, "pci")
    devices = (pci or {}).get("devices") or {}
    reasons = []
    links = {}
    for g in gpus:
        gen, gen_max = g.get("pcie.link.gen.current"), g.get("pcie.link.gen.max")
        width, width_max = g.get("pcie.link.width.current"), g.get("pcie.link.width.max")
        sys_link = (devices.get(str(g.get("bdf"))) or {}).get("link") or {}
        if not isinstance(gen, int):
            gen, gen_max = _sysfs_gen(sys_link.get("speed")), _sysfs_gen(sys_link.get("max_speed"))
        if not isinstance(width, int):
            width, width_max = _int_or_none(sys_link.get("width")), _int_or_none(sys_link.get("max_width"))
        links[str(g.get("bdf"))] = {"gen": gen, "gen_max": gen_max, "width": width, "width_max": width_max}
        want_gen = t["pcie_gen_min"] if t["pcie_gen_min"] is not None else gen_max
        want_width = t["pcie_width_min"] if t["pcie_width_min"] is not None else width_max
        if isinstance(gen, int) and isinstance(want_gen, int) and gen < want_gen:
            reasons.append(f"{_gpu_label(g)}: PCIe Gen{gen}, below Gen{want_gen} (max Gen{gen_max})")
        if isinstance(width, int) and isinstance(want_width, int) and width < want_width:
            reasons.append(f"{_gpu_label(g)}: PCIe x{width}, below x{want_width} (max x{width_max})")
    state = {"links": links}
    if not links:
        return _skip("pcie_link", "no GPU on nvidia to check")
    if reasons:
        return _fail("pcie_link", f"degraded PCIe link: {reasons[0]}", reasons, state=state)
    shapes = sorted({f"Gen{v['gen']} x{v['width']}" for v in links.values()})
    return Verdict(
        "pcie_link", True, f"all {len(links)} links at their maximum ({', '.join(shapes)})", state=state
    )


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def check_nvlink(facts: Facts, t: Thresholds) -> Verdict:
    part, err = _part(facts, "nvlink")
    required = t["nvlink_required"]
    gpus = (part or {}).get("gpus") or {}
    total = sum(len(g.get("links") or {}) for g in gpus.values())
    if part is None or total == 0:
        if required:
            return _fail("nvlink", "no NVLink reported, but nvlink_required is set", [str(err or "no links")])
        return _skip("nvlink", "no NVLink on this host" + (f" ({err})" if err else ""))
    reasons = []
    up = 0
    for idx, g in sorted(gpus.items(), key=lambda kv: int(kv[0])):
        for link, st in sorted((g.get("links") or {}).items(), key=lambda kv: int(kv[0])):
            if st.get("up"):
                up += 1
            else:
                reasons.append(f"GPU {idx} link {link}: {st.get('text') or 'down'}")
    state = {"links_up": up, "links_total": total}
    if reasons:
        return _fail("nvlink", f"{len(reasons)} of {total} NVLinks down", reasons, state=state)
    return Verdict("nvlink", True, f"all {total} NVLinks up", state=state)


def _nvidia_devices(facts: Facts) -> tuple[dict[str, Any], str | None]:
    pci, err = _part(facts, "pci")
    if pci is None:
        return {}, err
    return {b: d for b, d in (pci.get("devices") or {}).items() if d.get("driver") == "nvidia"}, None


def check_iommu_group_type(facts: Facts, t: Thresholds) -> Verdict:
    devs, err = _nvidia_devices(facts)
    if err:
        return _fail("iommu_group_type", f"sysfs unreadable: {err}", [str(err)])
    if not devs:
        return _skip("iommu_group_type", "no GPU on nvidia (GPUs on vfio-pci belong to VMs)")
    allowed = list(t["iommu_group_types"])
    reasons = []
    types = {}
    for b, d in sorted(devs.items()):
        typ = d.get("iommu_type")
        types[b] = typ
        if d.get("iommu_group") is None:
            continue  # IOMMU off: no translation on the path
        if typ not in allowed:
            reasons.append(
                f"{b}: IOMMU group {d.get('iommu_group')} is {typ}, expected {' or '.join(allowed)}"
            )
    state = {"types": types}
    if reasons:
        return _fail(
            "iommu_group_type",
            f"{len(reasons)} GPU IOMMU group(s) not {'/'.join(allowed)}",
            reasons,
            state=state,
        )
    shown = sorted({str(v) for v in types.values()})
    return Verdict("iommu_group_type", True, f"GPU IOMMU groups: {', '.join(shown)}", state=state)


def check_acs(facts: Facts, t: Thresholds) -> Verdict:
    devs, err = _nvidia_devices(facts)
    if err:
        return _fail("acs", f"sysfs unreadable: {err}", [str(err)])
    bridges: dict[str, Mapping[str, Any]] = {}
    for d in devs.values():
        for br in d.get("bridges") or []:
            bridges[br["bdf"]] = br.get("acs") or {}
    if not bridges:
        return _skip("acs", "no upstream bridge found for the GPUs")
    unknown = sorted(b for b, a in bridges.items() if a.get("source") == "unknown")
    if len(unknown) == len(bridges):
        return _skip(
            "acs", f"ACS state unknown on {len(unknown)} bridge(s): config space unreadable and no lspci"
        )
    reasons = []
    for b, a in sorted(bridges.items()):
        ctl = a.get("ctl") or {}
        on = [k for k in ("ReqRedir", "CmpltRedir") if ctl.get(k)]
        if on and not t["acs_redirect_allowed"]:
            reasons.append(
                f"bridge {b}: ACS {'+ '.join(on)}+ redirects peer traffic through the root complex"
            )
    state = {"bridges": {b: dict(a) for b, a in bridges.items()}, "unknown": unknown}
    note = f"; unknown on {', '.join(unknown)}" if unknown else ""
    if reasons:
        return _fail("acs", f"ACS redirect on {len(reasons)} GPU bridge(s){note}", reasons, state=state)
    return Verdict(
        "acs", True, f"no ACS redirect on {len(bridges) - len(unknown)} GPU bridge(s){note}", state=state
    )


def check_p2p(facts: Facts, t: Thresholds) -> Verdict:
    if not t["p2p_required"]:
        return _skip("p2p", "not required (p2p_required: false)")
    part, err = _part(facts, "p2p")
    if part is None:
        return _fail("p2p", f"P2P matrix unavailable: {err}", [str(err)])
    labels = list(part.get("labels") or [])
    matrix = [list(r) for r in part.get("matrix") or []]
    if len(labels) < 2:
        return _skip("p2p", f"{len(labels)} GPU: no pair to check")
    reasons = []
    for i, row in enumerate(matrix):
        for j, cell in enumerate(row):
            if j <= i or cell in ("X", "OK"):
                continue
            reasons.append(
                f"{labels[i]} <-> {labels[j]}: {cell} ({P2P_STATUS_LEGEND.get(cell, 'unknown code')})"
            )
    pairs = len(labels) * (len(labels) - 1) // 2
    state = {"labels": labels, "matrix": matrix}
    if reasons:
        return _fail(
            "p2p", f"P2P not available for {len(reasons)} of {pairs} GPU pairs", reasons, state=state
        )
    return Verdict("p2p", True, f"P2P OK for all {pairs} GPU pairs", state=state)


def throttle_reason_names(mask: int) -> list[str]:
    """Decode a clocks_throttle_reasons bitmask into nvidia-smi's reason names."""
    return [name for bit, name in _THROTTLE_BITS if mask & bit]


def check_throttle(facts: Facts, t: Thresholds) -> Verdict:
    gpus, err = _gpus(facts)
    if err:
        return _fail("throttle", f"nvidia-smi failed: {err}", [err])
    fail_mask = int(t["throttle_fail_mask"])
    reasons = []
    masks = {}
    for g in gpus:
        v = g.get("clocks_throttle_reasons.active")
        if not isinstance(v, int):
            continue
        masks[str(g.get("bdf"))] = f"0x{v:016x}"
        bad = v & fail_mask
        if bad:
            reasons.append(f"{_gpu_label(g)}: throttled by {', '.join(throttle_reason_names(bad))} (0x{v:x})")
    state = {"reasons": masks, "fail_mask": f"0x{fail_mask:x}"}
    if not masks:
        return _skip("throttle", "GPUs do not report throttle reasons")
    if reasons:
        return _fail("throttle", f"{len(reasons)} GPU(s) throttled", reasons, state=state)
    return Verdict("throttle", True, f"no failing throttle reason on {len(masks)} GPUs", state=state)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def check_temperature(facts: Facts, t: Thresholds, samples: Sequence[Facts] | None = None) -> Verdict:
    gpus, err = _gpus(facts)
    if err:
        return _fail("temperature", f"nvidia-smi failed: {err}", [err])
    limit, band = float(t["temperature_max"]), float(t["temperature_noise"])
    readings: dict[str, list[float]] = {}
    labels = {}
    for g in gpus:
        v = g.get("temperature.gpu")
        if isinstance(v, int | float):
            readings.setdefault(str(g.get("bdf")), []).append(float(v))
            labels[str(g.get("bdf"))] = _gpu_label(g)
    for s in samples or []:
        for g in _gpus(s)[0]:
            v = g.get("temperature.gpu")
            if isinstance(v, int | float) and str(g.get("bdf")) in readings:
                readings[str(g.get("bdf"))].append(float(v))
    if not readings:
        return _skip("temperature", "GPUs do not report a temperature")
    near = [b for b, r in readings.items() if abs(r[0] - limit) <= band]
    decided = {b: (_median(r) if samples else r[0]) for b, r in readings.items()}
    hot = sorted(b for b, v in decided.items() if v > limit)
    state = {"readings": readings, "limit": limit, "noise_band": band}
    reasons = []
    for b in hot:
        how = f"median of {len(readings[b])} readings {readings[b]}" if samples else "one reading"
        reasons.append(f"{labels[b]}: {decided[b]:g} C > {limit:g} C ({how})")
    if samples:
        for b in near:
            if b not in hot:
                reasons.append(
                    f"{labels[b]}: near the limit, readings {readings[b]}, median {decided[b]:g} C"
                )
    verdict = Verdict(
        "temperature",
        not hot,
        (
            f"{len(hot)} GPU(s) above {limit:g} C"
            if hot
            else f"hottest GPU {max(decided.values()):g} C (limit {limit:g} C)"
        ),
        reasons,
        state=state,
    )
    if near and not samples and t["reread_count"] > 0:
        verdict.reread = "gpus"
    return verdict


def check_disk_free(facts: Facts, t: Thresholds, samples: Sequence[Facts] | None = None) -> Verdict:
    part, err = _part(facts, "disk")
    if part is None:
        return _fail("disk_free", f"disk facts missing: {err}", [str(err)])
    min_pct, band = float(t["disk_free_min_pct"]), float(t["disk_free_noise_pct"])
    min_gib = t["disk_free_min_gib"]
    reasons = []
    near = False
    state: dict[str, Any] = {"paths": {}}

    def pct_of(entry: Mapping[str, Any]) -> float:
        return 100.0 * entry["avail"] / entry["total"] if entry.get("total") else 0.0

    for path, entry in (part.get("paths") or {}).items():
        if "error" in entry:
            reasons.append(str(entry["error"]))
            continue
        pcts = [pct_of(entry)]
        for s in samples or []:
            sp, _ = _part(s, "disk")
            se = ((sp or {}).get("paths") or {}).get(path)
            if se and "error" not in se:
                pcts.append(pct_of(se))
        pct = _median(pcts) if samples else pcts[0]
        gib = entry["avail"] / 2**30
        state["paths"][path] = {
            "free_pct": round(pct, 2),
            "free_gib": round(gib, 2),
            "readings_pct": [round(p, 2) for p in pcts],
        }
        if abs(pcts[0] - min_pct) <= band:
            near = True
        if pct < min_pct:
            how = f" (median of {len(pcts)} readings)" if samples else ""
            reasons.append(f"{path}: {pct:.1f}% free < {min_pct:g}%{how}")
        if min_gib is not None and gib < float(min_gib):
            reasons.append(f"{path}: {gib:.1f} GiB free < {float(min_gib):g} GiB")
    if reasons:
        v = _fail("disk_free", reasons[0], reasons, state=state)
    else:
        shown = ", ".join(f"{p} {e['free_pct']:.1f}%" for p, e in state["paths"].items())
        v = Verdict("disk_free", True, f"free space: {shown} (min {min_pct:g}%)", state=state)
    if near and not samples and t["reread_count"] > 0:
        v.reread = "disk"
    return v


def _service_entries(facts: Facts, t: Thresholds) -> tuple[list[Mapping[str, Any]], str | None]:
    part, err = _part(facts, "services")
    if part is None:
        return [], err
    found = part.get("services") or {}
    return [found.get(u) or {"unit": u, "error": "not gathered", "show": {}} for u in t.services], None


def check_service(facts: Facts, t: Thresholds) -> Verdict:
    if not t.services:
        return _skip("service", "no inference service configured (inventory variable `service`)")
    entries, err = _service_entries(facts, t)
    if err:
        return _fail("service", f"service state unavailable: {err}", [str(err)])
    reasons = []
    state = {}
    for e in entries:
        show = e.get("show") or {}
        state[e["unit"]] = {
            k: show.get(k) for k in ("LoadState", "ActiveState", "SubState", "MainPID", "Result")
        }
        if e.get("error") and not show:
            reasons.append(f"{e['unit']}: {e['error']}")
        elif show.get("LoadState") != "loaded":
            reasons.append(f"{e['unit']}: unit {show.get('LoadState') or 'unknown'}")
        elif show.get("ActiveState") != "active":
            reasons.append(
                f"{e['unit']}: {show.get('ActiveState')} ({show.get('SubState')}, result {show.get('Result')})"
            )
    fixable = any(
        (s.get("ActiveState") in ("failed", "inactive")) and s.get("LoadState") == "loaded"
        for s in state.values()
    )
    if reasons:
        return _fail("service", reasons[0], reasons, state=state, fix="service" if fixable else None)
    shown = ", ".join(f"{u} active ({s['SubState']}, pid {s['MainPID']})" for u, s in state.items())
    return Verdict("service", True, shown, state=state)


def check_service_health(facts: Facts, t: Thresholds) -> Verdict:
    if not t.services or t["service_port"] is None:
        return _skip(
            "service_health", "no health endpoint configured (inventory variables `service`, `service_port`)"
        )
    entries, err = _service_entries(facts, t)
    if err:
        return _fail("service_health", f"service state unavailable: {err}", [str(err)])
    h = entries[0].get("health") or {}
    state = {
        "url": h.get("url"),
        "status": h.get("status"),
        "error": h.get("error"),
        "duration": h.get("duration"),
    }
    if h.get("status") == 200:
        return Verdict(
            "service_health",
            True,
            f"{h.get('url')} answered 200 in {h.get('duration', 0):.3f} s",
            state=state,
        )
    why = h.get("error") or f"HTTP {h.get('status')}"
    return _fail("service_health", f"{h.get('url') or 'health endpoint'}: {why}", [why], state=state)


_CHECK_FUNCS: dict[str, Callable[..., Verdict]] = {
    "gpu_count": check_gpu_count,
    "driver_version": check_driver_version,
    "cuda_version": check_cuda_version,
    "persistence_mode": check_persistence_mode,
    "ecc": check_ecc,
    "retired_pages": check_retired_pages,
    "remapped_rows": check_remapped_rows,
    "xid": check_xid,
    "sxid": check_sxid,
    "pcie_link": check_pcie_link,
    "nvlink": check_nvlink,
    "iommu_group_type": check_iommu_group_type,
    "acs": check_acs,
    "p2p": check_p2p,
    "throttle": check_throttle,
    "temperature": check_temperature,
    "disk_free": check_disk_free,
    "service": check_service,
    "service_health": check_service_health,
}
_SAMPLED = {"temperature", "disk_free"}


def evaluate(check: str, facts: Facts, t: Thresholds, samples: Sequence[Facts] | None = None) -> Verdict:
    """Judge one check from a host's facts; pass `samples` after a `reread` was asked for."""
    fn = _CHECK_FUNCS.get(check)
    if fn is None:
        raise KeyError(f"unknown health check {check!r}; known: {', '.join(CHECKS)}")
    if check in _SAMPLED:
        return fn(facts, t, samples)
    return fn(facts, t)

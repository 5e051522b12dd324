"""Health checks judged from nvidia-smi: GPU count and model, versions, persistence, memory errors,
throttling and temperature.

Pure logic, no I/O (facts in, verdicts out). Temperature is judged with a noise band: a reading
within `temperature_noise` of the limit asks for re-reads (`Verdict.reread`), and the median decides.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_gpuhost.modules.health.memory import ecc_off
from pytest_gpuhost.modules.health.thresholds import Thresholds, unknown_models, unknown_note
from pytest_gpuhost.modules.health.verdict import (
    Facts,
    Verdict,
    cell_error,
    container_of,
    facts_gpus,
    facts_part,
    failed,
    field_gone,
    field_source,
    gpu_label,
    median,
    skipped,
)

# NVML errors (nvmlErrorString) that say the GPU itself is unusable until it is reset or the host rebooted.
GPU_DOWN_ERRORS = ("GPU requires reset", "GPU is lost")

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


def _given_gpus(facts: Facts, gpus: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Return the GPUs a container node was given, None on a host (or where it cannot be told).

    The NVIDIA container toolkit creates in the container only the `/dev/nvidiaN` of the GPUs it
    was given (NVIDIA_VISIBLE_DEVICES): their count is the node's. A GPU given and then lost
    keeps its device file, so nvidia-smi listing fewer is still a GPU gone.
    """
    kind = container_of(facts)
    node = facts.get("node")
    if not kind or not isinstance(node, Mapping):
        return None
    devices = node.get("gpu_devices")
    if not isinstance(devices, list) or not devices:
        return None
    return {"container": kind, "devices": len(devices), "visible_devices": node.get("visible_devices")}


def check_gpu_count(facts: Facts, t: Thresholds) -> Verdict:
    gpus, err = facts_gpus(facts)
    part = facts.get("gpus")
    # where the GPUs were read from (probe_health_nvml.py): "nvml", or "nvidia-smi" and why not NVML
    src = {k: part[k] for k in ("source", "nvml_fallback") if k in part} if isinstance(part, dict) else {}
    if err:
        said = err if src.get("source") == "nvml" else f"nvidia-smi failed: {err}"
        return failed("gpu_count", said, [err], state=src)
    names = [str(g.get("name") or "") for g in gpus]
    models = sorted(set(names))
    state: dict[str, Any] = {"count": len(gpus), "models": models, **src}
    # a GPU of no model in health.thresholds.MODELS: its per-model expectations are not judged
    unknown = unknown_note(gpus, "no per-model expectations (NVLinks, fabric, ECC, memory limit)")
    if unknown:
        state["unknown_models"] = sorted(unknown_models(gpus))
    reasons = []
    want = t["gpu_count"]
    if want is not None and len(gpus) != want:
        reasons.append(f"nvidia-smi sees {len(gpus)} GPUs, the inventory expects {want}")
    model = t["gpu_model"]
    if model:
        for g, n in zip(gpus, names, strict=True):
            if model.lower() not in n.lower():
                reasons.append(f"{gpu_label(g)} is {n!r}, expected {model!r}")
    pci, _ = facts_part(facts, "pci")
    source = "inventory" if want is not None else None
    given = _given_gpus(facts, gpus)
    if pci is not None:
        seen = {g.get("bdf") for g in gpus}
        bound = sorted(b for b, d in (pci.get("devices") or {}).items() if d.get("driver") == "nvidia")
        state["nvidia_bound"] = len(bound)
        if given is not None:
            # A container given some of the host's GPUs sees all of them in sysfs, and only its
            # own in nvidia-smi (the NVIDIA container toolkit): the others are not this node's.
            others = sorted(b for b in bound if b not in seen)
            state["not_this_nodes"] = others
            state["given"] = given
            bound = [b for b in bound if b in seen]
            if want is None:
                want, source = given["devices"], "the GPU devices this container was given"
                if len(gpus) != want:
                    reasons.insert(
                        0,
                        f"nvidia-smi sees {len(gpus)} GPUs, this container was given {want} (/dev/nvidiaN)",
                    )
        for b in bound:
            if b not in seen:
                reasons.append(
                    f"{b} is bound to nvidia but nvidia-smi does not list it (fallen off the bus?)"
                )
        on_bus = pci.get("on_bus")
        if isinstance(on_bus, dict) and given is None:
            # A GPU on vfio-pci is handed to a VM: the host's nvidia-smi never lists it.
            ours = {b: d.get("driver") for b, d in on_bus.items() if d.get("driver") != "vfio-pci"}
            state["on_bus"] = len(ours)
            if want is None:
                want, source = len(ours), "PCI bus"
                if len(gpus) != want:
                    reasons.insert(
                        0,
                        f"nvidia-smi sees {len(gpus)} GPUs, the PCI bus has {want} NVIDIA display "
                        "controllers not on vfio-pci",
                    )
            for b in sorted(ours):
                if b not in seen and b not in bound:
                    reasons.append(
                        f"{b} is an NVIDIA GPU on the PCI bus, driver {ours[b] or 'none'}, "
                        "but nvidia-smi does not list it"
                    )
    state["expected"] = want
    state["expected_from"] = source
    desc = f"{len(gpus)} GPUs" + (f" ({', '.join(models)})" if gpus else "")
    down = {}
    for g in gpus:
        errs = g.get("cell_errors") or {}
        bad = sorted(f for f, e in errs.items() if e in GPU_DOWN_ERRORS)
        if bad:
            down[str(g.get("bdf"))] = errs[bad[0]]
            reasons.append(f"{gpu_label(g)}: nvidia-smi prints [{errs[bad[0]]}] for {', '.join(bad)}")
    if down:
        state["down"] = down
    if not gpus and not reasons and t["gpu_count"] is None:
        reasons.append("nvidia-smi sees no GPU")
    if reasons:
        return failed("gpu_count", f"{desc}: {reasons[0]}", reasons, state=state)
    if source == "inventory":
        desc += f", as expected ({want})"
    elif given is not None:
        desc += f", as many as this container was given ({want})"
    elif source:
        desc += f", as many as the PCI bus has ({want})"
    if state.get("not_this_nodes"):
        desc += f"; {len(state['not_this_nodes'])} more on the host's bus: not this node's"
    if unknown:
        desc += f"; {unknown}"
    return Verdict("gpu_count", True, desc, state=state)


def _version_check(check: str, found: Sequence[str | None], want: str | None, what: str) -> Verdict:
    versions = sorted({v for v in found if v})
    state = {"versions": versions, check: versions[0] if len(versions) == 1 else None}
    if not versions:
        return failed(check, f"{what} unknown: nvidia-smi did not report it", [], state=state)
    if len(versions) > 1:
        return failed(check, f"{what} differs between GPUs: {', '.join(versions)}", [], state=state)
    if want is not None and versions[0] != want:
        return failed(check, f"{what} {versions[0]}, the inventory expects {want}", [], state=state)
    note = ", as expected" if want is not None else " (fleet uniformity is judged in the fleet summary)"
    return Verdict(check, True, f"{what} {versions[0]}{note}", state=state)


def check_driver_version(facts: Facts, t: Thresholds) -> Verdict:
    gpus, err = facts_gpus(facts)
    found = [g.get("driver_version") for g in gpus]
    smi, _ = facts_part(facts, "smi")
    if not found and smi is not None:
        found = [smi.get("driver_version")]
    if err and not found:
        return failed("driver_version", f"nvidia-smi failed: {err}", [err])
    return _version_check("driver_version", found, t["driver_version"], "driver")


def check_cuda_version(facts: Facts, t: Thresholds) -> Verdict:
    smi, err = facts_part(facts, "smi")
    if smi is None:
        return failed("cuda_version", f"nvidia-smi failed: {err}", [str(err)])
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
        return skipped("persistence_mode", "not required (persistence_mode: false)")
    gpus, err = facts_gpus(facts)
    if err:
        return failed("persistence_mode", f"nvidia-smi failed: {err}", [err])
    off = [g for g in gpus if g.get("persistence_mode") != 1]
    state = {"off": [g.get("bdf") for g in off], "gpus": len(gpus)}
    if off:
        reasons = [
            f"{gpu_label(g)}: persistence mode {g.get('raw', {}).get('persistence_mode', '?')}" for g in off
        ]
        inside = container_of(facts)
        if inside:
            # Persistence mode is the host driver's: a container can neither start
            # nvidia-persistenced for it nor run `nvidia-smi -pm 1` (root of the host only).
            reasons.append(f"this node is a {inside} container: set persistence mode on its host")
        return failed(
            "persistence_mode",
            f"persistence mode off on {len(off)} of {len(gpus)} GPUs",
            reasons,
            state=state,
            fix=None if inside else "persistence",
        )
    return Verdict("persistence_mode", True, f"persistence mode on for all {len(gpus)} GPUs", state=state)


def _per_gpu_counter(
    check: str, facts: Facts, field_name: str, limit: int | None, what: str, na_skip: str
) -> tuple[Verdict | None, list[str], dict[str, Any]]:
    gpus, err = facts_gpus(facts)
    if err:
        return failed(check, f"nvidia-smi failed: {err}", [err]), [], {}
    gone = field_gone(facts, field_name)
    if gone and na_skip:
        return skipped(check, gone), [], {}
    values = {str(g.get("bdf")): g.get(field_name) for g in gpus}
    known = {k: v for k, v in values.items() if isinstance(v, int | float)}
    reasons = [f"{gpu_label(g)}: {field_name} [{e}]" for g in gpus if (e := cell_error(g, field_name))]
    if gpus and not known and not reasons:
        return skipped(check, na_skip), [], {}
    if limit is not None:
        for g in gpus:
            v = g.get(field_name)
            if isinstance(v, int | float) and v > limit:
                reasons.append(f"{gpu_label(g)}: {what} {v:g} > {limit}")
    return None, reasons, {field_name: values}


def check_ecc(facts: Facts, t: Thresholds) -> Verdict:
    off, modes = ecc_off(facts, t)
    if off:  # its counters read [N/A] then: "not supported" would be a false pass
        return failed("ecc", off[0], off, state=modes)
    done, reasons, state = _per_gpu_counter(
        "ecc",
        facts,
        "ecc.errors.uncorrected.volatile.total",
        t["ecc_uncorrected_max"],
        "uncorrected ECC errors",
        "ECC not enabled or not supported on these GPUs",
    )
    if done:
        gpus, _ = facts_gpus(facts)
        unknown = unknown_note(gpus, "whether it supports ECC is not known (set ecc_required)")
        if done.skip and unknown and t["ecc_required"] is None:
            return skipped("ecc", f"{done.skip}; {unknown}")
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
        return failed("ecc", reasons[0], reasons, state=state)
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
        return failed("retired_pages", reasons[0], reasons, state=state)
    return Verdict("retired_pages", True, "no retired pages pending", state=state)


def check_remapped_rows(facts: Facts, t: Thresholds) -> Verdict:
    """Fail a GPU with a row remap pending (a GPU reset applies it) or a remapping failure.

    Read from `--query-remapped-rows` (the `remap` part); where that query failed, from the
    `--query-gpu` field remapped_rows.failure, with the query's error in the state.
    """
    remap, remap_err = facts_part(facts, "remap")
    rows = (remap or {}).get("gpus") or {}
    if remap is not None and rows:
        gpus, _ = facts_gpus(facts)
        labels = {str(g.get("bdf")): gpu_label(g) for g in gpus}
        reasons = []
        for bdf, r in sorted(rows.items()):
            label = labels.get(bdf, f"GPU ? ({bdf})")
            for f, e in sorted((r.get("cell_errors") or {}).items()):
                reasons.append(f"{label}: {f} [{e}]")
            if (r.get("remapped_rows.failure") or 0) > 0:
                reasons.append(f"{label}: row remapping failure")
            if (r.get("remapped_rows.pending") or 0) > 0:
                reasons.append(f"{label}: row remap pending (a GPU reset applies it)")
        known = [r for r in rows.values() if isinstance(r.get("remapped_rows.pending"), int)]
        state = {"source": "--query-remapped-rows", "gpus": rows}
        if reasons:
            return failed("remapped_rows", reasons[0], reasons, state=state)
        if known:
            total = sum(int(r.get("remapped_rows.uncorrectable") or 0) for r in known)
            return Verdict(
                "remapped_rows",
                True,
                f"no row remap pending or failed on {len(known)} GPUs ({total} rows remapped for uncorrectable errors)",
                state=state,
            )
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
    state["source"] = "--query-gpu"
    if remap_err:
        state["remap_query"] = remap_err
    if reasons:
        return failed("remapped_rows", reasons[0], reasons, state=state)
    return Verdict("remapped_rows", True, "no row remapping failure", state=state)


def throttle_reason_names(mask: int) -> list[str]:
    """Decode a clocks_throttle_reasons bitmask into nvidia-smi's reason names."""
    return [name for bit, name in _THROTTLE_BITS if mask & bit]


def check_throttle(facts: Facts, t: Thresholds) -> Verdict:
    gpus, err = facts_gpus(facts)
    if err:
        return failed("throttle", f"nvidia-smi failed: {err}", [err])
    gone = field_gone(facts, "clocks_throttle_reasons.active")
    if gone:
        return skipped("throttle", gone)
    fail_mask = int(t["throttle_fail_mask"])
    reasons = []
    masks = {}
    for g in gpus:
        v = g.get("clocks_throttle_reasons.active")
        e = cell_error(g, "clocks_throttle_reasons.active")
        if e:
            reasons.append(f"{gpu_label(g)}: throttle reasons [{e}]")
        if not isinstance(v, int):
            continue
        masks[str(g.get("bdf"))] = f"0x{v:016x}"
        bad = v & fail_mask
        if bad:
            reasons.append(f"{gpu_label(g)}: throttled by {', '.join(throttle_reason_names(bad))} (0x{v:x})")
    state = {
        "reasons": masks,
        "fail_mask": f"0x{fail_mask:x}",
        "field": field_source(facts, "clocks_throttle_reasons.active"),
    }
    if not masks and not reasons:
        return skipped("throttle", "GPUs do not report throttle reasons")
    if reasons:
        return failed("throttle", f"{len(reasons)} GPU(s) throttled", reasons, state=state)
    return Verdict("throttle", True, f"no failing throttle reason on {len(masks)} GPUs", state=state)


def check_temperature(facts: Facts, t: Thresholds, samples: Sequence[Facts] | None = None) -> Verdict:
    gpus, err = facts_gpus(facts)
    if err:
        return failed("temperature", f"nvidia-smi failed: {err}", [err])
    limit, band = float(t["temperature_max"]), float(t["temperature_noise"])
    readings: dict[str, list[float]] = {}
    labels = {}
    for g in gpus:
        v = g.get("temperature.gpu")
        if isinstance(v, int | float):
            readings.setdefault(str(g.get("bdf")), []).append(float(v))
            labels[str(g.get("bdf"))] = gpu_label(g)
    for s in samples or []:
        for g in facts_gpus(s)[0]:
            v = g.get("temperature.gpu")
            if isinstance(v, int | float) and str(g.get("bdf")) in readings:
                readings[str(g.get("bdf"))].append(float(v))
    broken = [f"{gpu_label(g)}: temperature [{e}]" for g in gpus if (e := cell_error(g, "temperature.gpu"))]
    if broken:
        return failed("temperature", broken[0], broken, state={"readings": readings})
    if not readings:
        return skipped(
            "temperature", field_gone(facts, "temperature.gpu") or "GPUs do not report a temperature"
        )
    near = [b for b, r in readings.items() if abs(r[0] - limit) <= band]
    decided = {b: (median(r) if samples else r[0]) for b, r in readings.items()}
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

"""Health checks of GPU memory that depend on the GPU model: ECC left off, and HBM temperature.

Pure logic, no I/O. What each model has comes from `health.thresholds.MODELS` (`ecc`: the model
supports ECC, so ECC off is a misconfiguration, not "not supported"; `memory_temp_max`: the HBM's
limit); an inventory variable overrides the model's value, and the GPU's own limit, where the
probe read it (`Memory Max Operating Temp` in `nvidia-smi -q`, read on NVSwitch models for the
fabric), comes before the model's.

Drivers that print temperatures as T.Limit margins print `Memory Max Operating T.Limit Temp : 0 C`
instead: 0 C is the limit itself as the reference of a margin, and no memory margin is printed
next to it, so such a GPU states no limit in C (an H200 on 550.90.12,
fixtures/outputs/nvidia-smi-q-550.90.12-h200-tlimit.txt). Its memory is judged by the model's
limit, and the verdict says the GPU gave its own only as a T.Limit reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.modules.health.thresholds import Thresholds, model_spec
from pytest_gpuhost.modules.health.verdict import (
    Facts,
    Verdict,
    cell_error,
    facts_gpus,
    failed,
    field_gone,
    gpu_label,
    skipped,
)

__all__ = ["ecc_off", "check_memory_temperature"]


def ecc_off(facts: Facts, t: Thresholds) -> tuple[list[str], dict[str, Any]]:
    """Return a reason per GPU whose model supports ECC but runs with it off, and the modes read."""
    gpus, _ = facts_gpus(facts)
    modes: dict[str, Any] = {}
    reasons = []
    for g in gpus:
        mode = g.get("ecc.mode.current")
        modes[str(g.get("bdf"))] = mode
        spec = model_spec(str(g.get("name") or "")) or {}
        want = t["ecc_required"] if t["ecc_required"] is not None else spec.get("ecc")
        if mode == 0 and want:
            reasons.append(
                f"{gpu_label(g)}: ECC disabled on {g.get('name')}, which supports it "
                "(nvidia-smi -e 1, then a GPU reset or reboot)"
            )
    return reasons, {"ecc.mode.current": modes}


def _fabric_limit(facts: Facts, bdf: str, key: str = "memory_temp_max") -> float | None:
    part = facts.get("fabric")
    limits = part.get(key) if isinstance(part, Mapping) and part.get("ok") else None
    v = limits.get(bdf) if isinstance(limits, Mapping) else None
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def check_memory_temperature(facts: Facts, t: Thresholds) -> Verdict:
    """Compare each GPU's memory (HBM) temperature with its limit."""
    gpus, err = facts_gpus(facts)
    if err:
        return failed("memory_temperature", f"nvidia-smi failed: {err}", [str(err)])
    broken = [
        f"{gpu_label(g)}: memory temperature [{e}]"
        for g in gpus
        if (e := cell_error(g, "temperature.memory"))
    ]
    if broken:
        return failed("memory_temperature", broken[0], broken)
    readings: dict[str, float] = {}
    limits: dict[str, tuple[float, str]] = {}
    unknown = []
    reasons = []
    for g in gpus:
        v = g.get("temperature.memory")
        if not isinstance(v, int | float) or isinstance(v, bool):
            continue
        bdf = str(g.get("bdf"))
        readings[bdf] = float(v)
        spec = model_spec(str(g.get("name") or "")) or {}
        if t["memory_temperature_max"] is not None:
            limits[bdf] = (float(t["memory_temperature_max"]), "inventory memory_temperature_max")
        elif (own := _fabric_limit(facts, bdf)) is not None:
            limits[bdf] = (own, "the GPU's Memory Max Operating Temp")
        elif spec.get("memory_temp_max") is not None:
            source = f"the model's ({g.get('name')})"
            if (ref := _fabric_limit(facts, bdf, "memory_temp_max_tlimit")) is not None:
                source = (
                    f"the model's ({g.get('name')}; the GPU prints its own only as a T.Limit "
                    f"reference, Memory Max Operating T.Limit Temp {ref:g} C)"
                )
            limits[bdf] = (float(spec["memory_temp_max"]), source)
        elif not spec:
            unknown.append(f"{gpu_label(g)}: unknown model: {g.get('name')}")
            continue
        else:
            unknown.append(f"{gpu_label(g)} ({g.get('name')})")
            continue
        limit, source = limits[bdf]
        if v > limit:
            reasons.append(f"{gpu_label(g)}: memory {v:g} C > {limit:g} C ({source})")
    state = {
        "readings": readings,
        "limits": {b: {"limit": lim, "from": src} for b, (lim, src) in limits.items()},
    }
    if not readings:
        why = (
            field_gone(facts, "temperature.memory")
            or "GPUs do not report a memory temperature (GDDR, or N/A)"
        )
        return skipped("memory_temperature", why, **state)
    if reasons:
        return failed(
            "memory_temperature", f"{len(reasons)} GPU(s) with memory above its limit", reasons, state=state
        )
    if not limits:
        return skipped(
            "memory_temperature",
            f"no memory temperature limit known for {', '.join(unknown)}: set memory_temperature_max",
            **state,
        )
    hottest = max(readings[b] for b in limits)
    note = f"; no limit known for {', '.join(unknown)}" if unknown else ""
    return Verdict(
        "memory_temperature",
        True,
        f"hottest GPU memory {hottest:g} C, under its limit on {len(limits)} GPUs{note}",
        state=state,
    )

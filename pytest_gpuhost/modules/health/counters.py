"""Counters since the last run: the time each GPU spent held down by a clock-event reason.

Pure logic, no I/O. nvidia-smi reports, per GPU, the time in microseconds since the driver loaded
that each clock-event (formerly "throttle") reason held the clocks down
(`--query-gpu=clocks_event_reasons_counters.*`, R550+, "[us]" in the csv header). A snapshot of
`clocks_event_reasons.active` at night, with the GPUs idle, says nothing of the day; the counters
do. `counters_state` is what the health state keeps of this run (modules/health/facts.commit_state); the
next run gets it back in the kernel-log part (`previous_counters`) and `check_clock_events`
judges the difference.

A counter lower than the one recorded (the driver reloaded, the GPU was reset, the host rebooted)
started again from 0 since the last run, so all it holds happened since: that value is the
difference (and the new baseline). A GPU with no recorded value (the first run, a new GPU) is
judged on its whole count since the driver loaded, as the Xid check judges the first night since
boot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.modules.health.ib import ib_state
from pytest_gpuhost.modules.health.nvlink import nvlink_state
from pytest_gpuhost.modules.health.thresholds import Thresholds
from pytest_gpuhost.modules.health.verdict import (
    Facts,
    Verdict,
    facts_gpus,
    failed,
    field_gone,
    gpu_label,
    skipped,
)

__all__ = ["CLOCK_EVENT_COUNTERS", "check_clock_events", "check_pcie_aer", "counters_state"]

PREFIX = "clocks_event_reasons_counters."
#: The counters read, and which limit each counts against ("hw", "sw_thermal", or None: reported).
CLOCK_EVENT_COUNTERS: Mapping[str, str | None] = {
    PREFIX + "hw_thermal_slowdown": "hw",
    PREFIX + "hw_power_brake_slowdown": "hw",
    PREFIX + "sw_thermal_slowdown": "sw_thermal",
    PREFIX + "sw_power_cap": None,
}


def _current(facts: Facts) -> dict[str, dict[str, int]]:
    gpus, _ = facts_gpus(facts)
    out: dict[str, dict[str, int]] = {}
    for g in gpus:
        vals = {
            k: int(v)
            for k in CLOCK_EVENT_COUNTERS
            if isinstance(v := g.get(k), int) and not isinstance(v, bool)
        }
        if vals:
            out[str(g.get("bdf"))] = vals
    return out


def _aer_now(facts: Facts) -> dict[str, dict[str, int]]:
    part = facts.get("pci")
    devices = part.get("devices") if isinstance(part, Mapping) and part.get("ok") else None
    out: dict[str, dict[str, int]] = {}
    for bdf, dev in (devices or {}).items():
        aer = dev.get("aer") if isinstance(dev, Mapping) else None
        if isinstance(aer, Mapping):
            out[str(bdf)] = {
                k: int(v) for k, v in aer.items() if isinstance(v, int) and not isinstance(v, bool)
            }
    return out


def counters_state(facts: Facts) -> dict[str, Any] | None:
    """Return what the health state keeps of this run's counters, None when there are none."""
    gpus = _current(facts)
    aer = _aer_now(facts)
    ib = ib_state(facts)
    nvlink = nvlink_state(facts)
    if not gpus and not aer and not ib and nvlink is None:
        return None
    boot = ((facts.get("kernel_log") or {}).get("cursor") or {}).get("boot_id")
    out = {"version": 1, "at": facts.get("time"), "boot_id": boot, "gpus": gpus, "aer": aer, "ib": ib}
    return out if nvlink is None else {**out, "nvlink": nvlink}


def _previous(facts: Facts) -> Mapping[str, Any]:
    part = facts.get("kernel_log")
    prev = part.get("previous_counters") if isinstance(part, Mapping) else None
    return prev if isinstance(prev, Mapping) else {}


def check_clock_events(facts: Facts, t: Thresholds) -> Verdict:
    """Fail a GPU held down by hardware slowdown (or too long by software thermal slowdown) since the last run."""
    gpus, err = facts_gpus(facts)
    if err:
        return failed("clock_events", f"nvidia-smi failed: {err}", [str(err)])
    current = _current(facts)
    if not current:
        gone = field_gone(facts, PREFIX + "hw_thermal_slowdown")
        return skipped("clock_events", gone or "GPUs do not report clock-event counters")
    prev = _previous(facts)
    prev_gpus = prev.get("gpus") or {}
    limits = {"hw": float(t["clock_event_hw_max_s"]), "sw_thermal": float(t["clock_event_sw_thermal_max_s"])}
    labels = {str(g.get("bdf")): gpu_label(g) for g in gpus}
    reasons: list[str] = []
    state: dict[str, Any] = {
        "window": "since the last run" if prev else "since the driver loaded (no earlier run)"
    }
    per_gpu: dict[str, Any] = {}
    for bdf, vals in sorted(current.items()):
        got = prev_gpus.get(bdf)
        before: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
        delta: dict[str, float] = {}
        restarted = []
        for name, now in vals.items():
            was = before.get(name)
            if isinstance(was, int) and now >= was:
                delta[name] = (now - was) / 1e6
            else:
                delta[name] = now / 1e6
                if isinstance(was, int):
                    restarted.append(name[len(PREFIX) :])
        per_gpu[bdf] = {
            "seconds": {k[len(PREFIX) :]: round(v, 3) for k, v in delta.items()},
            "restarted": restarted,
        }
        for group, limit in limits.items():
            names = [k for k, g in CLOCK_EVENT_COUNTERS.items() if g == group and k in delta]
            total = sum(delta[k] for k in names)
            if names and total > limit:
                parts = ", ".join(f"{k[len(PREFIX) :]} {delta[k]:g} s" for k in names if delta[k])
                reasons.append(
                    f"{labels.get(bdf, bdf)}: clocks held down {total:g} s {state['window']} ({parts}; limit {limit:g} s)"
                )
    state["gpus"] = per_gpu
    state["limits_s"] = limits
    if reasons:
        return failed(
            "clock_events",
            f"{len(reasons)} GPU(s) held down by clock events {state['window']}",
            reasons,
            state=state,
        )
    worst = max((sum(p["seconds"].values()) for p in per_gpu.values()), default=0.0)
    note = ""
    restarted_gpus = [b for b, p in per_gpu.items() if p["restarted"]]
    if restarted_gpus:
        note = f"; counters restarted (new baseline) on {', '.join(restarted_gpus)}"
    return Verdict(
        "clock_events",
        True,
        f"no GPU held down past its limit {state['window']} on {len(per_gpu)} GPUs (most {worst:g} s in all reasons){note}",
        state=state,
    )


def check_pcie_aer(facts: Facts, t: Thresholds) -> Verdict:
    """Fail a GPU whose PCIe link logged a fatal or non-fatal AER error, or too many correctable ones, since the last run."""
    now = _aer_now(facts)
    part = facts.get("pci")
    if not isinstance(part, Mapping) or not part.get("ok"):
        err = part.get("error") if isinstance(part, Mapping) else "pci: not gathered"
        return failed("pcie_aer", f"PCI facts missing: {err}", [str(err)])
    if not now:
        return skipped(
            "pcie_aer",
            "no AER counters in sysfs for these GPUs (no AER capability, or AER handled by the firmware)",
        )
    prev = _previous(facts)
    got_all = prev.get("aer")
    before_all: Mapping[str, Any] = got_all if isinstance(got_all, Mapping) else {}
    window = "since the last run" if prev else "since boot (no earlier run)"
    limits = {"fatal": 0, "nonfatal": 0, "correctable": int(t["pcie_aer_correctable_max"])}
    reasons = []
    per: dict[str, Any] = {}
    for bdf, vals in sorted(now.items()):
        got = before_all.get(bdf)
        before: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
        delta = {}
        for k, v in vals.items():
            was = before.get(k)
            delta[k] = v - was if isinstance(was, int) and v >= was else v  # lower: counted again from 0
        per[bdf] = {"since": delta, "total": vals}
        over = [
            f"{delta[k]} {k}" for k in ("fatal", "nonfatal", "correctable") if delta.get(k, 0) > limits[k]
        ]
        if over:
            reasons.append(
                f"{bdf}: PCIe AER {', '.join(over)} error(s) {window} (limits: fatal 0, non-fatal 0, "
                f"correctable {limits['correctable']})"
            )
    state = {"window": window, "gpus": per, "limits": limits}
    if reasons:
        return failed(
            "pcie_aer", f"{len(reasons)} GPU(s) with PCIe AER errors {window}", reasons, state=state
        )
    cor = sum(p["since"].get("correctable", 0) for p in per.values())
    return Verdict(
        "pcie_aer",
        True,
        f"no fatal or non-fatal AER error on {len(per)} GPUs {window} ({cor} correctable)",
        state=state,
    )

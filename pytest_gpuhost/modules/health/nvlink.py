"""NVLink error counters since the last run: per GPU, link and counter (part of the `nvlink` check).

Pure logic, no I/O. The probe reads `nvidia-smi nvlink -e` in the `nvlink` part, only on hosts
where `nvidia-smi nvlink -s` printed links (`nvlink.errors`: per GPU index the number of error
counters read, and per link the non-zero ones as printed). The counters count since the driver
loaded (or since `nvidia-smi nvlink -r` reset them), so a count says nothing of last night by itself: `nvlink_state` is what the health
state keeps of this run (`counters.nvlink` in health-state.json, written by
modules/health/facts.commit_state through modules/health/counters.counters_state), and `judge_nvlink_errors`
compares this run's counters with the last run's, which come back in the kernel-log part
(`previous_counters`), as the clock-event, AER and InfiniBand counters do.

- The first run, and a GPU the last run did not read: a baseline, nothing judged.
- A counter lower than the last run's: reset (reboot, driver reload, GPU reset, `nvlink -r`):
  a new baseline for that counter, reported, not judged.
- A counter that grew by more than its class's limit fails, naming GPU, link and counter.

Counter classes (the names nvidia-smi prints; docs/health-checks.md gives the sources): NVLink 2-4
drivers print `Replay Errors` (replay), `Recovery Errors` (recovery) and `CRC Errors` (crc);
NVLink 5 (Blackwell) prints `Link recovery successful events` / `Link recovery failed events`
(recovery; `Total link recovery events` is their sum, kept but not judged twice) and packet and
link errors (`Malformed packet Errors`, `Rx Errors`, `Symbol Errors`, ...: link_errors). A counter
name this table does not know is judged as link_errors, never dropped. The limits: the inventory's
`nvlink_<class>_max`, else the GPU model's `nvlink_errors_max` (modules/health/models.MODELS), else 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.modules.health.thresholds import Thresholds, model_spec
from pytest_gpuhost.modules.health.verdict import Facts, facts_gpus, gpu_label

__all__ = ["CLASSES", "COUNTER_CLASS", "judge_nvlink_errors", "nvlink_errors_now", "nvlink_state"]

#: The classes a counter counts against; each has an inventory variable nvlink_<class>_max.
CLASSES = ("replay", "recovery", "crc", "link_errors")
#: Counter name as nvidia-smi prints it -> class (None: kept, not judged).
COUNTER_CLASS: Mapping[str, str | None] = {
    "Replay Errors": "replay",
    "Recovery Errors": "recovery",
    "CRC Errors": "crc",
    "Link recovery successful events": "recovery",
    "Link recovery failed events": "recovery",
    "Total link recovery events": None,
    "Malformed packet Errors": "link_errors",
    "Buffer overrun Errors": "link_errors",
    "Rx Errors": "link_errors",
    "Rx remote Errors": "link_errors",
    "Rx General Errors": "link_errors",
    "Local link integrity Errors": "link_errors",
    "Tx discards": "link_errors",
    "Effective Errors": "link_errors",
    "Symbol Errors": "link_errors",
}
Counters = dict[str, dict[str, dict[str, int]]]  # GPU (BDF) -> link -> counter -> value


def _part(facts: Facts) -> Mapping[str, Any] | None:
    nv = facts.get("nvlink")
    errors = nv.get("errors") if isinstance(nv, Mapping) else None
    return errors if isinstance(errors, Mapping) else None


def _keys(facts: Facts) -> dict[str, Mapping[str, Any]]:
    """Map nvidia-smi's GPU index to its --query-gpu row (its BDF, name, label)."""
    gpus, _ = facts_gpus(facts)
    return {str(g.get("index")): g for g in gpus}


def nvlink_errors_now(facts: Facts) -> Counters | None:
    """Return this run's counters keyed by BDF (`GPU N` where nvidia-smi gave no row), None if unread."""
    part = _part(facts)
    if part is None or not part.get("ok"):
        return None
    rows = _keys(facts)
    out: Counters = {}
    for idx, gpu in (part.get("gpus") or {}).items():
        row = rows.get(str(idx))
        key = str(row.get("bdf")) if row is not None else f"GPU {idx}"
        links = gpu.get("links") if isinstance(gpu, Mapping) else None
        out[key] = {
            str(link): {str(k): v for k, v in vals.items() if isinstance(v, int) and not isinstance(v, bool)}
            for link, vals in (links or {}).items()
            if isinstance(vals, Mapping)
        }
    return out


def _previous(facts: Facts) -> Mapping[str, Any] | None:
    """Return the last run's nvlink counters, None when the last run kept none (first run)."""
    log = facts.get("kernel_log")
    prev = log.get("previous_counters") if isinstance(log, Mapping) else None
    got = prev.get("nvlink") if isinstance(prev, Mapping) else None
    return got if isinstance(got, Mapping) else None


def nvlink_state(facts: Facts) -> dict[str, Any] | None:
    """Return what the health state keeps: the non-zero counters per GPU and link (a GPU read has
    a key, so a counter absent under it was 0). Where `nvlink -e` failed, the last run's state
    is carried forward (the next run still compares with a real reading)."""
    now = nvlink_errors_now(facts)
    if now is None:
        prev = _previous(facts)
        return dict(prev) if prev is not None and _part(facts) is not None else None
    return {
        gpu: {
            link: {k: v for k, v in vals.items() if v} for link, vals in links.items() if any(vals.values())
        }
        for gpu, links in now.items()
    }


def _limits(row: Mapping[str, Any] | None, t: Thresholds) -> dict[str, int]:
    spec = model_spec(str((row or {}).get("name") or "")) or {}
    model = spec.get("nvlink_errors_max") or {}
    out = {}
    for cls in CLASSES:
        mine = t[f"nvlink_{cls}_max"]
        out[cls] = int(mine if mine is not None else model.get(cls, 0))
    return out


def judge_nvlink_errors(facts: Facts, t: Thresholds) -> tuple[list[str], dict[str, Any], str]:
    """Return (reasons, state, note) for the counters that grew past their limit since the last run.

    `note` is one clause for the summary ("" when the counters were not read: no NVLink links).
    """
    part = _part(facts)
    if part is None:
        return [], {}, ""
    if not part.get("ok"):
        err = str(part.get("error") or "nvidia-smi nvlink -e failed")
        return [f"NVLink error counters unreadable: {err}"], {"error": err}, ""
    now = nvlink_errors_now(facts) or {}
    read = sum(int(g.get("read") or 0) for g in (part.get("gpus") or {}).values() if isinstance(g, Mapping))
    if not read:
        why = "nvidia-smi nvlink -e printed no error counters for links nvlink -s lists"
        return [why], {"error": why}, ""
    prev = _previous(facts)
    rows = {str(g.get("bdf")): g for g in _keys(facts).values()}
    reasons: list[str] = []
    grown: dict[str, Any] = {}
    reset: list[str] = []
    baseline = sorted(now) if prev is None else sorted(g for g in now if g not in prev)
    for gpu, links in sorted(now.items()):
        if gpu in baseline:
            continue
        row = rows.get(gpu)
        label = gpu_label(row) if row is not None else gpu
        limits = _limits(row, t)
        before_links = prev.get(gpu) if prev is not None else None
        before_links = before_links if isinstance(before_links, Mapping) else {}
        for link, vals in sorted(links.items(), key=lambda kv: int(kv[0]) if kv[0].isdecimal() else -1):
            got = before_links.get(link)
            before: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
            for name, value in vals.items():
                was = before.get(name, 0)
                was = was if isinstance(was, int) else 0
                if value < was:
                    reset.append(f"{label} link {link} {name}")
                    continue
                cls = COUNTER_CLASS.get(name, "link_errors")
                if value == was:
                    continue
                grown.setdefault(gpu, {}).setdefault(link, {})[name] = value - was
                if cls is not None and value - was > limits[cls]:
                    reasons.append(
                        f"{label} link {link}: {name} +{value - was} since the last run "
                        f"(now {value}; limit {limits[cls]}, {cls})"
                    )
    state: dict[str, Any] = {"grown": grown, "reset": reset, "baseline": baseline, "counters_read": read}
    if prev is None:
        note = f"{read} NVLink error counters on {len(now)} GPUs recorded as the baseline (first run)"
    else:
        note = f"no NVLink error counter past its limit since the last run ({read} counters, {len(now)} GPUs)"
        if baseline:
            note += f" (baseline for {', '.join(baseline)})"
        if reset:
            note += f"; {len(reset)} counter(s) reset (new baseline)"
    return reasons, state, note

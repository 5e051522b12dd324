"""The `diag` health check: active diagnostics, opt-in (inventory `diag`) and time-bounded.

Pure logic, no I/O: the `health_diag` fact (exec/agent/probe_health_diag.py) ran them. Two kinds:

- `nvbandwidth`: host-to-device and device-to-host CE copies per GPU (NVIDIA/nvbandwidth,
  `-j`), each GPU's GB/s against `h2d_bandwidth_min_gbps`, else its model's
  (`h2d_gbps_min` in `modules/health/models.MODELS`: 48 GB/s for H100/H200, the figure Azure's HPC health
  checks use for those nodes); a model with no figure is measured and reported, not judged.
- `dcgm`: `dcgmi diag -r N -j`, every test's result per GPU; FAIL fails, WARN is reported. The
  JSON is walked by shape: DCGM 3.x nests tests under "DCGM GPU Diagnostic" > "test_categories"
  (NVIDIA/DCGM nvvs JsonOutput.h: status PASS|FAIL|WARN|SKIPPED); 4.x lists "tests" at the top.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from pytest_gpuhost.modules.health.thresholds import Thresholds, model_spec
from pytest_gpuhost.modules.health.verdict import Facts, Verdict, facts_gpus, facts_part, failed, skipped
from pytest_gpuhost.modules.parsers import ParseError, parse_nvbandwidth_json

__all__ = ["check_diag", "dcgm_results"]


def _tests(node: Any, category: str = "") -> Iterator[tuple[str, str, list[Any]]]:
    if isinstance(node, Mapping):
        if isinstance(node.get("results"), list) and "name" in node:
            yield category, str(node.get("name")), list(node["results"])
            return
        cat = str(node.get("category") or category)
        for v in node.values():
            yield from _tests(v, cat)
    elif isinstance(node, list):
        for v in node:
            yield from _tests(v, category)


def dcgm_results(text: str) -> tuple[list[str], list[str], int]:
    """Return (failures, warnings, tests seen) from `dcgmi diag -j` output."""
    doc = json.loads(text[text.index("{") :])
    fails, warns, seen = [], [], 0
    for category, name, results in _tests(doc):
        seen += 1
        for r in results:
            if not isinstance(r, Mapping):
                continue
            status = str(r.get("status", "")).strip().upper()
            who = r.get("gpu_ids", r.get("entity_id", "?"))
            info = r.get("warnings") or r.get("info") or r.get("error") or ""
            text_info = "; ".join(map(str, info)) if isinstance(info, list) else str(info)
            line = f"dcgmi diag {category + ': ' if category else ''}{name} on GPU {who}: {status}"
            line += f" ({text_info})" if text_info else ""
            if status in ("FAIL", "FAILED", "ERROR"):
                fails.append(line)
            elif status in ("WARN", "WARNING"):
                warns.append(line)
    return fails, warns, seen


def _nvbandwidth(
    facts: Facts, t: Thresholds, res: Mapping[str, Any]
) -> tuple[list[str], list[str], dict[str, Any]]:
    gpus, _ = facts_gpus(facts)
    try:
        matrices = parse_nvbandwidth_json(str(res.get("stdout") or ""))
    except ParseError as exc:
        return [f"nvbandwidth: {exc}"], [], {}
    reasons, notes = [], []
    state: dict[str, Any] = {}
    for test in ("host_to_device_memcpy_ce", "device_to_host_memcpy_ce"):
        m = matrices.get(test)
        if m is None:
            reasons.append(f"nvbandwidth: {test} did not pass (no result)")
            continue
        row = m.values[0] if m.values else []
        state[test] = row
        for i, gbps in enumerate(row):
            g = gpus[i] if i < len(gpus) else {}
            spec = model_spec(str(g.get("name") or "")) or {}
            limit = (
                t["h2d_bandwidth_min_gbps"]
                if t["h2d_bandwidth_min_gbps"] is not None
                else spec.get("h2d_gbps_min")
            )
            label = f"GPU {i} ({g.get('bdf', '?')})"
            if gbps is None:
                reasons.append(f"{label}: nvbandwidth {test}: no measurement")
            elif limit is None:
                why = f"no limit for {g.get('name')}" if spec else f"unknown model: {g.get('name')}"
                notes.append(f"{label} {test} {gbps:.1f} GB/s ({why})")
            elif gbps < float(limit):
                reasons.append(f"{label}: {test} {gbps:.1f} GB/s < {float(limit):g} GB/s")
    return reasons, notes, state


def check_diag(facts: Facts, t: Thresholds) -> Verdict:
    """Judge the diagnostics the inventory asked for; skipped when none was asked for."""
    part, err = facts_part(facts, "diag")
    if not t["diag"]:
        return skipped("diag", "active diagnostics are opt-in (inventory variable diag: [nvbandwidth, dcgm])")
    if part is None:
        return failed("diag", f"diagnostics did not run: {err}", [str(err)])
    results = part.get("results") or {}
    reasons: list[str] = []
    notes: list[str] = []
    missing: list[str] = []
    absent: list[str] = []
    state: dict[str, Any] = {}
    for tool in t["diag"]:
        res = results.get(tool) or {"error": "no result"}
        if "missing" in res:
            missing.append(str(res["missing"]))
            absent.append(tool)
            continue
        if "error" in res:
            reasons.append(f"{tool}: {res['error']}")
            continue
        if res.get("timed_out"):
            reasons.append(f"{tool}: timed out after {res.get('duration', 0):.0f} s (diag_timeout)")
            continue
        if tool == "nvbandwidth":
            r, n, st = _nvbandwidth(facts, t, res)
            reasons += r
            notes += n
            state["nvbandwidth"] = st
        elif tool == "dcgm":
            try:
                fails, warns, seen = dcgm_results(str(res.get("stdout") or ""))
            except ValueError as exc:
                reasons.append(f"dcgmi diag: output does not parse ({exc}); exit {res.get('rc')}")
                continue
            if not seen:
                reasons.append(
                    f"dcgmi diag: no test results (exit {res.get('rc')}): {str(res.get('stderr'))[-200:]}"
                )
            reasons += fails
            notes += warns
            state["dcgm"] = {"tests": seen, "failed": len(fails), "warnings": len(warns)}
    state["missing"] = missing
    state["notes"] = notes
    if reasons:
        return failed("diag", reasons[0], reasons, state=state)
    if missing and len(missing) == len(t["diag"]):
        return skipped("diag", "; ".join(missing), **state)
    ran = [x for x in t["diag"] if x not in absent]
    extra = f"; {'; '.join(missing)}" if missing else ""
    extra += f"; {'; '.join(notes)}" if notes else ""
    return Verdict("diag", True, f"diagnostics passed: {', '.join(ran)}{extra}", state=state)

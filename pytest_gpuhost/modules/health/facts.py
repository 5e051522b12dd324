"""The agent facts the health checks read, asked for in one request and merged into one dict.

The agent gathers a host's health in seven facts (exec/agent/probe_health*.py): `health` (the
nvidia-smi parts and free disk, read in parallel), `health_kernel_log`, `health_pci`,
`health_services`, `health_mounts`, `health_ib` and `health_diag` (runs nothing unless the
inventory opts in), and, first, `health_nvml` (the GPUs through NVML, which `health` then takes
instead of nvidia-smi's `gpus` and `remap`; merged as `nvml`). `fact_names` says which facts hold the parts a caller wants; `merge` turns the
`facts` op's reply into the one dict the verdicts read (modules/health/checks.py), keyed by part, with
every command each fact ran under `commands`; `commit_state` is what `health_commit` records
after the run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pytest_gpuhost.modules.health.counters import counters_state
from pytest_gpuhost.modules.health.xid import pending_after, reset_signals

__all__ = [
    "FACT_OF_PART",
    "NVML_FACT",
    "PARTS",
    "SOURCE_ENV",
    "commit_state",
    "fact_names",
    "gpu_source",
    "merge",
]

#: The fact that gathers each part, in the order the verdicts list them.
FACT_OF_PART: Mapping[str, str] = {
    "gpus": "health",
    "smi": "health",
    "remap": "health",
    "fabric": "health",
    "nvlink": "health",
    "p2p": "health",
    "disk": "health",
    "kernel_log": "health_kernel_log",
    "pci": "health_pci",
    "services": "health_services",
    "mounts": "health_mounts",
    "diag": "health_diag",
    "ib": "health_ib",
}
PARTS: tuple[str, ...] = tuple(FACT_OF_PART)
#: The fact that reads the `gpus`, `remap` and `nvlink` parts and the GPUs' side of `fabric` through
#: NVML (exec/agent/probe_health_nvml.py): asked for before `health`, which takes its answer
#: instead of starting nvidia-smi.
NVML_FACT = "health_nvml"
NVML_READS = ("gpus", "remap", "nvlink", "fabric")
#: `nvidia-smi` reads the GPUs with nvidia-smi only; `auto` (the default) through NVML where the
#: host has libnvidia-ml.so.1, else nvidia-smi.
SOURCE_ENV = "GPUHOST_HEALTH_SOURCE"
SOURCES = ("auto", "nvidia-smi")


def gpu_source() -> str:
    """Return where the GPU facts are read from: `auto` or `nvidia-smi` (SOURCE_ENV)."""
    value = os.environ.get(SOURCE_ENV, "").strip() or "auto"
    if value not in SOURCES:
        raise ValueError(f"{SOURCE_ENV}={value!r} (from the environment): use one of {', '.join(SOURCES)}")
    return value


def fact_names(parts: Iterable[str] | None = None) -> list[str]:
    """Return the facts to ask for to get `parts` (all parts when None), `health` first.

    Where the GPUs are read and NVML is not turned off (SOURCE_ENV), NVML_FACT comes before all.
    """
    wanted = PARTS if parts is None else tuple(parts)
    unknown = [p for p in wanted if p not in FACT_OF_PART]
    if unknown:
        raise KeyError(f"unknown health facts part(s) {unknown}; known: {', '.join(PARTS)}")
    names = list(dict.fromkeys(FACT_OF_PART[p] for p in PARTS if p in wanted))
    if set(wanted) & set(NVML_READS) and gpu_source() == "auto":
        names.insert(0, NVML_FACT)
    return names


def _as_part(value: Any, name: str) -> dict[str, Any]:
    if isinstance(value, dict) and "error" in value and "ok" not in value:
        return {"ok": False, "error": str(value["error"])}  # the fact raised on the host
    if not isinstance(value, dict):
        return {"ok": False, "error": f"{name}: no answer"}
    return value


def merge(reply: Mapping[str, Any]) -> dict[str, Any]:
    """Return one facts dict from a `facts` reply; `{"samples": [...]}` when `health` sampled."""
    base = reply.get("health")
    facts: dict[str, Any] = dict(base) if isinstance(base, dict) else {}
    if "samples" in facts:
        return facts
    commands = list(facts.get("commands") or [])
    for part, name in FACT_OF_PART.items():
        if name == "health" or name not in reply:
            continue
        value = _as_part(reply[name], name)
        commands += list(value.pop("commands", None) or [])
        facts[part] = value
    if NVML_FACT in reply:
        facts["nvml"] = _as_part(reply[NVML_FACT], NVML_FACT)
    facts["commands"] = commands
    return facts


def commit_state(facts: Mapping[str, Any], xid_ignore: Sequence[int] = ()) -> dict[str, Any] | None:
    """Return what `health_commit` records after this run, None when there is nothing to record.

    The kernel-log cursor (the next run reads only later lines), the resets and reboots the node
    still owes for its Xids (modules/health/xid.settle: a later run fails until the host shows them
    done: a new boot id, or the GPU's reset seen in its reset signals) and the CUDA version for this driver (the next run skips the nvidia-smi start
    that reads it while the driver is the same).
    """
    part = facts.get("kernel_log")
    if not isinstance(part, Mapping) or not part.get("ok") or not isinstance(part.get("cursor"), Mapping):
        return None
    state = dict(part["cursor"])
    state["pending"] = pending_after(part, xid_ignore, reset_signals(facts))
    counters = counters_state(facts)
    if counters is not None:
        state["counters"] = counters
    smi = facts.get("smi")
    if isinstance(smi, Mapping) and smi.get("ok") and smi.get("cuda_version") and smi.get("driver_version"):
        cached = smi.get("cached")
        state["cuda"] = (
            dict(cached)
            if isinstance(cached, Mapping)
            else {
                "driver_version": smi["driver_version"],
                "cuda_version": smi["cuda_version"],
                "at": facts.get("time"),
            }
        )
    return state

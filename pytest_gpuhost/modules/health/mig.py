"""The MIG mode check: every GPU whose model has MIG is in the mode the inventory expects.

A GPU left in MIG mode (by the last tenant, a MIG manager, or `nvidia-smi -mig 1`) shows CUDA
no whole GPU: an inference server started on it sees a MIG instance or nothing, and NVLink
queries are refused. A mode change waits for the GPU's next reset (NVIDIA MIG User Guide,
"Enable MIG Mode"), so `nvidia-smi --query-gpu=mig.mode.current,mig.mode.pending` can say
`Disabled, Enabled`: fine tonight, partitioned after the next reset. Both are judged.

The probe reads `mig.mode.current` and `mig.mode.pending` (exec/agent/probe_health_smi.py) or
`nvmlDeviceGetMigMode` (probe_health_nvml.py): 1 Enabled, 0 Disabled, None where the model has
no MIG ([N/A], NVML_ERROR_NOT_SUPPORTED), which is not judged. Pure logic, no I/O.
"""

from __future__ import annotations

from pytest_gpuhost.modules.health.thresholds import Thresholds
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

__all__ = ["check_mig_mode"]

_WORD: dict[object, str] = {1: "Enabled", 0: "Disabled"}


def check_mig_mode(facts: Facts, t: Thresholds) -> Verdict:
    want = t["mig_mode"]
    if want == "any":
        return skipped("mig_mode", "not judged (mig_mode: any)")
    gpus, err = facts_gpus(facts)
    if err:
        return failed("mig_mode", f"nvidia-smi failed: {err}", [err])
    gone = field_gone(facts, "mig.mode.current")
    if gone:
        return skipped("mig_mode", gone)
    reasons: list[str] = []
    modes: dict[str, list[str | None]] = {}
    judged = 0
    for g in gpus:
        cur, pend = g.get("mig.mode.current"), g.get("mig.mode.pending")
        error = cell_error(g, "mig.mode.current")
        modes[str(g.get("bdf"))] = [_WORD.get(cur), _WORD.get(pend)]
        if error:
            reasons.append(f"{gpu_label(g)}: MIG mode [{error}]")
            continue
        if cur not in _WORD:
            continue  # a model without MIG
        judged += 1
        now, then = _WORD[cur], _WORD.get(pend, _WORD[cur])
        flag = "1" if want == "Enabled" else "0"
        undo = f"nvidia-smi -i {g.get('index', '?')} -mig {flag}"
        if now != want and then == want:
            reasons.append(f"{gpu_label(g)}: MIG mode {now}, {want} pending (the next GPU reset applies it)")
        elif now != want:
            reasons.append(
                f"{gpu_label(g)}: MIG mode {now}, the inventory expects {want} ({undo}, then a GPU reset)"
            )
        elif then != want:
            reasons.append(
                f"{gpu_label(g)}: MIG mode {then} pending: the next GPU reset applies it ({undo} undoes it)"
            )
    state = {"mig_mode": modes, "want": want}
    if reasons:
        return failed(
            "mig_mode", f"MIG mode not {want} on {len(reasons)} of {len(gpus)} GPUs", reasons, state=state
        )
    if not judged:
        return skipped("mig_mode", "no GPU here has MIG", **state)
    return Verdict("mig_mode", True, f"MIG mode {want} on all {judged} GPUs with MIG", state=state)

"""The answer a p2p run gives for its host, in words: is P2P working now, and how fast?

"P2P RESTORED on 4 GPUs: pairs 52-56 GB/s (were 11-14); all-reduce 38.1 GB/s bus (14.2 with P2P
off)", "P2P WORKING on 4 GPUs: ...; nothing changed", or "P2P BLOCKED on 4 GPUs: ..." under
--check-only. Said from the procedure's own measurements at the end of the run; a step of the
host that failed turns it into "NEEDS ATTENTION" (report/answer.py).
"""

from __future__ import annotations

from typing import Any

from .procedure import P2PProcedure

__all__ = ["headline", "pair_range"]


def pair_range(matrix: Any, gpus: list[str]) -> str:
    """'52-56 GB/s' over the measured pairs among `gpus` ('' when none was measured)."""
    scope = set(gpus)
    vals = [
        v for (a, b), v in matrix.values.items() if a != b and a in scope and b in scope and v is not None
    ]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    return f"{lo:.0f} GB/s" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f} GB/s"


def headline(run: P2PProcedure) -> tuple[bool, str, list[str]] | None:
    """(ok, the verdict line, details) for the run's host; None when the plan was never made."""
    plan = run.plan
    if plan is None:
        return None
    gpus = sorted(plan.gpus)
    n = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}"
    before = pair_range(run.before, gpus) if run.before is not None else ""
    after = pair_range(run.after, gpus) if run.after is not None else ""
    details = [f"plan: {plan.summary()}"]
    if run.check_only and plan.needs_repair:
        was = f": pairs {before}" if before else ""
        return False, f"P2P BLOCKED on {n}{was}; the repair was not run (--check-only)", details
    coll = ""
    if run.collective is not None:
        on, off = (arm.result.avg_busbw for arm in run.collective)
        if on is not None:
            coll = f"; all-reduce {on:.1f} GB/s bus" + (
                f" ({off:.1f} with P2P off)" if off is not None else ""
            )
    if run.changed:
        now = f": pairs {after}" if after else ""
        was = (
            f" (were {before})"
            if before
            else " (no pair reached P2P before)"
            if run.before is not None
            else ""
        )
        return True, f"P2P RESTORED on {n}{now}{was}{coll}", []
    if plan.needs_repair:
        return False, f"P2P NOT RESTORED on {n}: the repair did not complete", details
    now = f": pairs {after or before}" if (after or before) else ""
    return True, f"P2P WORKING on {n}{now}{coll}; nothing changed", []

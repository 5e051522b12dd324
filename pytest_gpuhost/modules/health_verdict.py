"""What a health check returns (`Verdict`) and the helpers every check uses to read the facts.

Pure logic, no I/O. A facts part that failed on the host (`{"ok": false, "error": ...}`) reads as
missing, with its error as the reason.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Facts",
    "Verdict",
    "facts_gpus",
    "facts_part",
    "failed",
    "gpu_label",
    "int_or_none",
    "median",
    "skipped",
]

Facts = Mapping[str, Any]


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


def skipped(check: str, why: str, **state: Any) -> Verdict:
    """Return a verdict that does not apply to this host (reported as skipped, with why)."""
    return Verdict(check, True, why, skip=why, state=dict(state))


def facts_part(facts: Facts, name: str) -> tuple[Mapping[str, Any] | None, str | None]:
    """Return a facts part and None, or None and why it is missing or failed on the host."""
    part = facts.get(name)
    if not isinstance(part, Mapping):
        return None, f"{name}: not gathered"
    if part.get("ok") is False or "error" in part and part.get("ok") is None:
        return None, str(part.get("error") or f"{name}: failed")
    return part, None


def facts_gpus(facts: Facts) -> tuple[list[Mapping[str, Any]], str | None]:
    """Return the GPU rows nvidia-smi gave, or [] and why there are none."""
    part, err = facts_part(facts, "gpus")
    if part is None:
        return [], err
    return list(part.get("gpus") or []), None


def gpu_label(g: Mapping[str, Any]) -> str:
    """Name a GPU in a reason line: index and PCI address."""
    return f"GPU {g.get('index', '?')} ({g.get('bdf', '?')})"


def failed(check: str, summary: str, reasons: Sequence[str], **kw: Any) -> Verdict:
    """Return a failed verdict."""
    return Verdict(check, False, summary, list(reasons), **kw)


def int_or_none(v: Any) -> int | None:
    """Return `v` as an int, None when it is not a number."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def median(values: Sequence[float]) -> float:
    """Return the median of the readings of a measurement."""
    return float(statistics.median(values))

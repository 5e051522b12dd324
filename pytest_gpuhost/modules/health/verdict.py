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
    "cell_error",
    "facts_gpus",
    "facts_part",
    "failed",
    "field_gone",
    "field_source",
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


def cell_error(g: Mapping[str, Any], name: str) -> str | None:
    """Return the NVML error nvidia-smi printed in a GPU's cell (``[GPU requires reset]``), or None.

    ``N/A`` and ``[N/A]``/``[Not Supported]`` are no value, not an error: the probe leaves them out.
    """
    errors = g.get("cell_errors")
    if isinstance(errors, Mapping) and errors.get(name):
        return str(errors[name])
    return None


def field_gone(facts: Facts, name: str) -> str | None:
    """Return why nvidia-smi gave no `name` field at all on this host, None when it did."""
    part = facts.get("gpus")
    if isinstance(part, Mapping) and name in (part.get("dropped") or []):
        return f"this driver's nvidia-smi does not know the field {name} (nor another name for it)"
    return None


def field_source(facts: Facts, name: str) -> str:
    """Return the --query-gpu field `name` was read as (its new name on a driver that renamed it)."""
    part = facts.get("gpus")
    renamed = part.get("renamed") if isinstance(part, Mapping) else None
    return str(renamed[name]) if isinstance(renamed, Mapping) and name in renamed else name

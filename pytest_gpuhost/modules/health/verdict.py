"""What a health check returns (`Verdict`) and the helpers every check uses to read the facts.

Pure logic, no I/O. A facts part that failed on the host (`{"ok": false, "error": ...}`) reads as
missing, with its error as the reason.

A check whose input the node does not give (the kernel log denied to a container, no systemd, a
tool missing) returns `cannot_see(...)`: neither a pass nor a failure, saying what it could not
read and what would let it. `blind_reason` tells such a part from one that failed for a reason
that is the node's problem.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Facts",
    "Verdict",
    "blind_reason",
    "cannot_see",
    "cell_error",
    "facts_gpus",
    "facts_part",
    "failed",
    "field_gone",
    "field_source",
    "gpu_label",
    "int_or_none",
    "median",
    "container_of",
    "no_driver",
    "skipped",
]

Facts = Mapping[str, Any]


@dataclass
class Verdict:
    """One check's verdict on one host: ok, skipped, cannot see, or failed, and why."""

    check: str
    ok: bool
    summary: str
    reasons: list[str] = field(default_factory=list)
    skip: str | None = None
    state: dict[str, Any] = field(default_factory=dict)
    fix: str | None = None  # the --fix name that can repair it
    reread: str | None = None  # facts part to sample again before deciding
    #: what the check could not read on this node, and what would let it (neither pass nor fail)
    cannot_see: str | None = None

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
            "cannot_see": self.cannot_see,
        }


def skipped(check: str, why: str, **state: Any) -> Verdict:
    """Return a verdict that does not apply to this host (reported as skipped, with why)."""
    return Verdict(check, True, why, skip=why, state=dict(state))


def cannot_see(check: str, what: str, would_let: str, **state: Any) -> Verdict:
    """Return a verdict for a check whose input this node does not give: what, and what would let it."""
    why = f"{what}; {would_let}"
    return Verdict(check, True, why, cannot_see=why, state=dict(state))


#: errno names a probe gives for a read the node refused (not a broken host: a blind checker)
_DENIED = ("EPERM", "EACCES")


def blind_reason(part: Mapping[str, Any] | None) -> str | None:
    """Return why a failed facts part is the checker's blindness (denied, tool missing), else None.

    Probes mark such a part with `denied` (an errno name) or `missing` (the tool not on PATH):
    decided from those fields, never from the error's text.
    """
    if not isinstance(part, Mapping) or part.get("ok") is not False:
        return None
    if part.get("denied") in _DENIED:
        needs = f", this node lacks {part['needs']}" if part.get("needs") else ""
        return f"denied ({part['denied']}{needs})"
    if part.get("missing"):
        return f"{part['missing']}: not on this node"
    return None


def container_of(facts: Facts) -> str | None:
    """Return the container kind this node is (docker, podman, lxc, ...), None on a host."""
    node = facts.get("node")
    kind = node.get("container") if isinstance(node, Mapping) else None
    return str(kind) if kind else None


NO_DRIVER = "no NVIDIA driver on this host"


def no_driver(facts: Facts) -> str | None:
    """Return the one line for a host without the NVIDIA driver, None where there is one.

    No driver: nvidia-smi is not on PATH and none of the driver's signs is there (the `nvidia`
    module in /sys/module, /proc/driver/nvidia, /dev/nvidiactl). A host with the driver but no
    nvidia-smi is not this: its checks fail on the missing tool.
    """
    part = facts.get("gpus")
    if not isinstance(part, Mapping) or part.get("ok") is not False:
        return None
    if part.get("missing") != "nvidia-smi" or part.get("driver_signs"):
        return None
    return f"{NO_DRIVER} (no nvidia-smi, no nvidia module, no /dev/nvidiactl)"


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

"""The service of a P2P run when none is named: the systemd unit that holds the in-scope GPUs.

A unit's processes sit in its cgroup, whose last path component is the unit's name
(systemd.special(7), "system.slice"; a container's units end the same way seen from the host,
under /lxc/ID/ or lxc.payload.ID/). The processes step 1's `gpu_holders` fact found with an
in-scope /dev/nvidiaN open name the unit from their /proc/PID/cgroup. nvidia-persistenced is not
the service (step 3 stops it on its own). A run that completes an interrupted one takes the unit
its journal recorded as stopped: nothing holds the GPUs then. Processes outside any unit (started
by hand, with nohup) name no unit: the run stops nothing for them, and step 3 says who holds on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Found", "service_of"]

_UNIT = re.compile(r"/([^/]+\.service)$")
_NOT_THE_SERVICE = ("nvidia-persistenced.service",)


@dataclass(frozen=True)
class Found:
    """The unit found (or "" for none) and the sentence the evidence keeps."""

    unit: str
    why: str


def unit_of(cgroup: str) -> str | None:
    """The .service unit a /proc/PID/cgroup line names (None: a scope, a slice, the root)."""
    m = _UNIT.search((cgroup or "").strip().rstrip("/"))
    return m.group(1) if m else None


def service_of(raw_holders: Any, minors: Iterable[int], journal: dict[str, Any] | None) -> Found:
    """The unit to stop and start again: the interrupted run's, else the one holding the GPUs."""
    old = (journal or {}).get("service")
    if (journal or {}).get("service_stopped") and isinstance(old, dict) and old.get("unit"):
        return Found(str(old["unit"]), f"{old['unit']}, stopped by the interrupted run its journal records")
    files = {f"/dev/nvidia{m}" for m in minors}
    units: dict[str, list[int]] = {}
    loose: list[str] = []
    for h in raw_holders if isinstance(raw_holders, list) else []:
        if not isinstance(h, dict) or not set(h.get("files") or []) & files:
            continue
        unit = unit_of(str(h.get("cgroup") or ""))
        if unit in _NOT_THE_SERVICE or h.get("comm") == "nvidia-persistenced":
            continue
        if unit is None:
            loose.append(f"pid {h.get('pid')} ({str(h.get('comm') or '')[:32]!r})")
        else:
            units.setdefault(unit, []).append(int(h.get("pid") or 0))
    outside = f"; held outside any unit by {', '.join(loose[:5])}" if loose else ""
    if len(units) == 1:
        unit, pids = next(iter(units.items()))
        held = ", ".join(map(str, pids[:5]))
        return Found(unit, f"{unit}, the unit whose processes hold the in-scope GPUs (pid {held}){outside}")
    if units:
        return Found(
            "",
            f"none stopped: several units hold the in-scope GPUs ({', '.join(sorted(units))}); "
            f"name the one to stop with --service{outside}",
        )
    return Found(
        "",
        "none to stop or restore: no unit holds the in-scope GPUs and none was given "
        f"(--service or the inventory var p2p_service){outside}",
    )

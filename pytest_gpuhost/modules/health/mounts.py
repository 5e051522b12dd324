"""The `mounts` health check: each mount the inventory names is mounted, and writable where it must be.

Pure logic, no I/O. The `health_mounts` fact (exec/agent/probe_health_mounts.py, the `mounts`
part) reads /proc/self/mountinfo once and says, for each data path and each mount named in the
inventory variable `mounts`, which mount holds it and whether that mount is read-only. Without
this, a model mount that is missing passes (`statvfs` of the empty directory measures the parent
file system), and so does a file system the kernel remounted read-only after errors (ext4
`errors=remount-ro`: it still has free space).

`mounts` entries: a path (mounted, read-write) or `{path: /models, ro: true}` (mounted, read-only
allowed, e.g. a model share exported read-only). The data paths (`data_paths`) must be writable.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.modules.health.thresholds import Thresholds, mount_specs
from pytest_gpuhost.modules.health.verdict import Facts, Verdict, facts_part, failed, skipped

__all__ = ["check_mounts"]


def check_mounts(facts: Facts, t: Thresholds) -> Verdict:
    """Fail a named mount that is missing or read-only, and a data path on a read-only mount."""
    specs = mount_specs(t)
    part, err = facts_part(facts, "mounts")
    if part is None:
        return failed("mounts", f"mounts unreadable: {err}", [str(err)])
    paths = part.get("paths") or {}
    disk = (facts.get("disk") or {}).get("paths") or {}
    reasons = []
    state: dict[str, Any] = {}
    for path, ro_ok in specs:
        e = paths.get(path) or {}
        state[path] = {k: e.get(k) for k in ("mount_point", "fstype", "source", "ro")}
        if e.get("mount_point") != path:
            held = e.get("mount_point") or "?"
            reasons.append(
                f"{path}: not mounted (the path is on {held}'s file system; its free space would be {held}'s)"
            )
        elif e.get("ro") and not ro_ok:
            reasons.append(f"{path}: mounted read-only ({e.get('fstype')} {e.get('source')})")
    for path in t["data_paths"]:
        e = paths.get(path) or {}
        state.setdefault(path, {k: e.get(k) for k in ("mount_point", "fstype", "source", "ro")})
        st_ro = (disk.get(path) or {}).get("ro")  # statvfs ST_RDONLY, where the disk part read it
        if (e.get("ro") or st_ro) and not any(p == path and ro for p, ro in specs):
            reasons.append(f"{path}: on a read-only mount ({e.get('mount_point')}, {e.get('fstype')})")
    if reasons:
        return failed("mounts", reasons[0], reasons, state=state)
    if not specs:
        v = Verdict(
            "mounts",
            True,
            f"data paths writable: {', '.join(t['data_paths'])} (no `mounts` named)",
            state=state,
        )
        return v if t["data_paths"] else skipped("mounts", "no mounts or data paths configured")
    shown = ", ".join(f"{p} ({state[p]['fstype']}{', ro' if state[p]['ro'] else ''})" for p, _ in specs)
    return Verdict("mounts", True, f"mounted: {shown}; data paths writable", state=state)

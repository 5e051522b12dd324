"""cgroups of the lab's machines: one cgroup per machine in every hierarchy, joined, frozen, removed.

Each lab machine runs in cgroup ``gpulab/NAME`` (containers ``gpulab/NAME/lxc/ID``) of the
hierarchies its systemd needs (``JOIN_HIERARCHIES``), on cgroup v1 machines as on pure cgroup2
ones; memory and cpu stay this machine's. ``set_frozen`` is how the lab makes a host hang
(freezer.state on v1, cgroup.freeze on v2; Documentation/admin-guide/cgroup-v2.rst).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from gpulab.errors import LabError

__all__ = [
    "CGROUP_ROOT",
    "cgroup_dirs",
    "cgroup_tree",
    "join_cgroup",
    "make_cgroup",
    "remove_cgroup",
    "set_frozen",
    "thaw",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_dirs(rel: str) -> list[Path]:
    """Return ``rel`` in every cgroup hierarchy this machine mounts (v1 controllers and unified)."""
    out: list[Path] = []
    if not CGROUP_ROOT.is_dir():
        return out
    for h in sorted(CGROUP_ROOT.iterdir()):
        if h.is_dir() and (h / "cgroup.procs").exists():
            out.append(h / rel)
    if (CGROUP_ROOT / "cgroup.procs").exists():  # a pure cgroup2 machine
        out.append(CGROUP_ROOT / rel)
    return out


def make_cgroup(rel: str) -> None:
    for d in cgroup_dirs(rel):
        with contextlib.suppress(OSError):
            d.mkdir(parents=True, exist_ok=True)
            if (d / "cpuset.cpus").exists():
                _init_cpuset(d)


def _init_cpuset(d: Path) -> None:
    """Give a new v1 cpuset cgroup (and its new ancestors) the parent's cpus and mems."""
    chain = []
    p = d
    while (p / "cpuset.cpus").exists() and p != p.parent:
        chain.append(p)
        p = p.parent
    for c in reversed(chain):
        for f in ("cpuset.cpus", "cpuset.mems"):
            with contextlib.suppress(OSError):
                if not (c / f).read_text().strip():
                    (c / f).write_text((c.parent / f).read_text())


# Hierarchies a lab process is moved in: systemd's own (name=systemd, unified), the freezer, and
# the two controllers systemd uses anyway (pids for TasksMax, devices): each machine's cgroup
# namespace then roots them in its own subtree. memory and cpu keep this machine's limits.
JOIN_HIERARCHIES = ("systemd", "unified", "freezer", "pids", "devices")


def join_cgroup(rel: str) -> None:
    """Move the calling process into ``rel`` (systemd and freezer hierarchies; a preexec_fn)."""
    make_cgroup(rel)
    for d in cgroup_dirs(rel):
        pure_v2 = (CGROUP_ROOT / "cgroup.procs").exists()
        if not pure_v2 and d.relative_to(CGROUP_ROOT).parts[0] not in JOIN_HIERARCHIES:
            continue
        with contextlib.suppress(OSError):
            (d / "cgroup.procs").write_text(str(os.getpid()))


def cgroup_tree(d: Path) -> list[Path]:
    """Return cgroup `d` and every cgroup below it ([] when `d` is gone).

    os.walk, not Path.rglob: a child cgroup removed while it is listed (a lab-exec command ending,
    systemd cleaning up a unit) is skipped; rglob raised FileNotFoundError out of a host's reset.
    """
    return [Path(root) for root, _, _ in os.walk(d)]


def remove_cgroup(rel: str) -> None:
    for d in cgroup_dirs(rel):
        if not d.is_dir():
            continue
        for sub in sorted(cgroup_tree(d)[1:], key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            d.rmdir()


def set_frozen(cg: str, frozen: bool, timeout: float = 10) -> None:
    """Freeze or thaw cgroup ``cg``: v1 freezer.state, or cgroup.freeze on a pure cgroup2 machine."""
    v1 = CGROUP_ROOT / "freezer" / cg / "freezer.state"
    v2 = CGROUP_ROOT / cg / "cgroup.freeze"
    if v1.exists():
        want = "FROZEN" if frozen else "THAWED"
        v1.write_text(want)

        def done() -> bool:
            return v1.read_text().strip() == want
    elif v2.exists():
        v2.write_text("1" if frozen else "0")
        events = CGROUP_ROOT / cg / "cgroup.events"

        def done() -> bool:
            return f"frozen {int(frozen)}" in events.read_text()
    else:
        raise LabError(f"no freezer for cgroup {cg} on this machine")
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise LabError(f"cgroup {cg} did not {'freeze' if frozen else 'thaw'} within {timeout:g} s")
        time.sleep(0.02)


def thaw(cg: str) -> None:
    """Thaw ``cg`` if frozen (a frozen task does not die of SIGKILL); never raises."""
    with contextlib.suppress(OSError, LabError):
        set_frozen(cg, False, timeout=5)

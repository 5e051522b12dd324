"""Lab machines whose Python is not the lab machine's: `health-ok` with another `node_python`.

The node Pythons an operator meets (gpulab/host/pythons.py builds each from real interpreters):
CPython 3.6 (the agent's floor), Debian's python3-minimal (no json), Python 2.7 installed as
``python3``, RHEL 8's ``/usr/libexec/platform-python`` alone, and no Python at all. The SGLang
service runs under its own interpreter (``LAB_PYTHON``, as a server runs from its
virtualenv), so it serves whatever the node's ``python3`` is.
"""

from __future__ import annotations

from typing import Any

import yaml

from gpulab.profiles.load import PROFILE_DIR, load_profile
from gpulab.profiles.types import Profile

__all__ = ["LAB_PYTHON", "SHAPES", "node_python_profile"]

#: The values of `node_python` (schema.yaml), built by gpulab/host/pythons.py.
SHAPES = ("system", "cpython-3.6", "minimal", "python2", "platform-python", "none")
#: Where the lab's own tools find their interpreter in a host whose node Python is not the
#: system's (relative to the host's root): a path no node has.
LAB_PYTHON = "usr/local/lib/gpulab/python3"

BASE = "health-ok"


def node_python_profile(shape: str, *, services: bool = True, base: str = BASE, **overrides: Any) -> Profile:
    """`health-ok` (or the profile `base`) whose node Python is `shape` (one of SHAPES).

    ``services=False``: no SGLang and no nvidia-persistenced, so no Python runs on the node (the
    agent's last candidates are the interpreters of running Pythons: exec/pythons.py).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown node Python {shape!r}: one of {', '.join(SHAPES)}")
    data = yaml.safe_load((PROFILE_DIR / f"{base}.yaml").read_text())
    kept = []
    for svc in data["services"] if services else []:
        svc = dict(svc)
        if shape != "system" and svc.get("kind") == "sglang" and svc["argv"][0] == "python3":
            svc["argv"] = [f"/{LAB_PYTHON}", *svc["argv"][1:]]
        kept.append(svc)
    name = f"{base}-python-{shape}" + ("" if services else "-idle")
    changes: dict[str, Any] = {"name": name, "node_python": shape, "services": kept}
    changes.update(overrides)
    return load_profile(base, changes)

"""The health state a `--check-only` run keeps on the controller, so that it writes nothing on a node.

A health run remembers, per node, where its kernel-log reading ended, the resets and reboots the
node still owes, the counters it saw and the CUDA version of the driver (`facts.commit_state`).
A run that may change the node keeps them there (`health_commit`, under the agent's state
directory). A `--check-only` run writes nothing on any node, so it keeps them here, one JSON
file per target under `$GPUHOST_CONTROLLER_STATE_DIR`, else `$XDG_STATE_HOME/gpuhost`, else
`~/.local/state/gpuhost` (the XDG base directory specification's place for state), and sends the
file's contents with every later request, check-only or not. The node's probe takes the newer
(by the controller's `committed` stamp, which both copies carry) of what was sent and of its own
state file, so check-only and fixing runs in any order each go on from the run before.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["ENV", "load", "path_for", "root", "save"]

ENV = "GPUHOST_CONTROLLER_STATE_DIR"


def root() -> Path:
    """The controller's state directory for health runs."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "gpuhost"


def path_for(target: str) -> Path:
    """The file of one target: its name made one safe path component, plus a hash of the name.

    A target's name comes from an inventory or a URL: it is never trusted as a path (`../x`,
    `a/b` and a name of 300 characters all give one file directly under the directory).
    """
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", target).strip("._")[:80] or "target"
    tag = hashlib.sha256(target.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return root() / "health" / f"{safe}-{tag}.json"


def load(target: str) -> dict[str, Any] | None:
    """The state kept for `target`, or None when there is none (or it cannot be read as an object)."""
    try:
        data = json.loads(path_for(target).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save(target: str, state: dict[str, Any]) -> Path:
    """Keep `state` for `target` (temp file, fsync, rename); return where it went."""
    path = path_for(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path

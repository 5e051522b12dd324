"""The name of the machine the plugin runs on: what a `local://` target is called.

Every node of a Slurm or Kubernetes job runs the health suite against `local://` and writes its
own summary; the merge keys hosts by target name, so each node must be called after itself, not
`local` (a merge of 16 such nodes would show one host). The name is the machine's host name
(`socket.gethostname()`, what `hostname` prints and what Slurm's `NodeHostname` defaults to), or
the operator's `--node-name`, or `$GPUHOST_NODE_NAME` (for where a flag cannot be passed, or the
host name is not the node's: a Kubernetes pod's host name is the pod's, so a DaemonSet sets the
variable from the downward API's `spec.nodeName`).

The host name is a string from the node, so hostile: it becomes a test id, a file name, an HTML
cell and a Prometheus label. A host name that passes the inventory's rule for names
(`exec/hostnames.valid_host_name`: labels of letters, digits, `_` and `-`, or an IP address) is
used as it is; any other (markup, spaces, control characters, non-ASCII, too long) becomes a
readable host name plus `-` and 8 hex digits of the SHA-256 of the exact bytes, so two different
raw names never end up with the same target name and the result always passes the rule. An
explicit `--node-name` or `$GPUHOST_NODE_NAME` is the operator's word: it must pass the rule, or
it is refused with one line.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import unicodedata

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.hostnames import valid_host_name

__all__ = ["ENV", "check_node_name", "local_node_name", "safe_host_name"]

#: The environment variable that names this machine when no --node-name is given.
ENV = "GPUHOST_NODE_NAME"

_NOT_LABEL = re.compile(r"[^A-Za-z0-9_-]+")
HASH_HEX = 8
MAX_LABEL = 63


def safe_host_name(raw: str) -> str:
    """Return `raw` when it is a valid host name, else a valid host name made from it (injective)."""
    if valid_host_name(raw) and not raw.endswith("."):
        return raw
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_HEX]
    ascii_text = unicodedata.normalize("NFKC", raw).encode("ascii", "ignore").decode("ascii")
    labels = [_NOT_LABEL.sub("-", part).strip("-") for part in ascii_text.split(".")]
    labels = [lab[:MAX_LABEL].strip("-") for lab in labels if lab.strip("-")][:4]
    if not labels:
        return f"node-{digest}"
    labels[-1] = f"{labels[-1][: MAX_LABEL - HASH_HEX - 1]}-{digest}"
    return ".".join(labels)


def check_node_name(name: str, where: str = "--node-name") -> str:
    """Return an operator-given node name, or raise TargetError naming it and what to give."""
    text = name.strip()
    if not valid_host_name(text) or text.endswith("."):
        raise TargetError(
            f"{where}={name!r} is not a host name: use letters, digits, '_', '-' and dots (e.g. gpu-07)"
        )
    return text


def local_node_name(explicit: str | None = None) -> str:
    """Return this machine's name as a target: `explicit`, else $GPUHOST_NODE_NAME (both checked),
    else its host name made safe."""
    if explicit:
        return check_node_name(explicit)
    if os.environ.get(ENV, "").strip():
        return check_node_name(os.environ[ENV], f"${ENV}")
    return safe_host_name(socket.gethostname())

"""Where fleet summaries go and come from: local files (written atomically) and s3:// URLs."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.exec.nodename import local_node_name, safe_host_name
from pytest_gpuhost.exec.s3io import S3Store
from pytest_gpuhost.redact import redact_obj
from pytest_gpuhost.report.summary import FORMAT

__all__ = ["SummaryError", "atomic_write", "load_summary", "object_name", "write_summary"]


class SummaryError(GpuhostError, ValueError):
    """A file or object is not a fleet summary (not JSON, or another format)."""


def atomic_write(path: str, text: str) -> None:
    """Write `text` to `path` through a temp file in the same directory and a rename."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    # Same directory, then rename: node_exporter (or a merge) never reads a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".gpuhost-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_summary(summary: Mapping[str, Any], dest: str, store: S3Store | None = None) -> str:
    """Write the fleet summary to a path or an s3:// URL; return where it went.

    An s3:// prefix ending in `/` gets `<node name>.json`, so the nodes of one job can share it:
    `object_name(summary)`, one safe path component.
    """
    text = json.dumps(redact_obj(summary), default=str)  # one line: the C encoder (see jsonfile.py)
    if dest.startswith("s3://"):
        if dest.endswith("/"):
            dest = dest + object_name(summary) + ".json"
        (store or S3Store()).put(dest, text.encode("utf-8"), content_type="application/json")
        return dest
    atomic_write(dest, text)
    return dest


def object_name(summary: Mapping[str, Any]) -> str:
    """The name of a run's object under a shared s3:// prefix: the one host it checked (a per-node
    run: `local://` is named after the node), else this machine's node name ($GPUHOST_NODE_NAME or
    its host name). Either is made a valid host name (`safe_host_name`: never `/`, `..` or markup;
    two different names never collide), so a hostile name cannot pick another node's key."""
    hosts = list(summary.get("hosts") or {})
    raw = str(hosts[0]) if len(hosts) == 1 else local_node_name()
    return safe_host_name(raw)


def load_summary(source: str, store: S3Store | None = None) -> dict[str, Any]:
    """Read one fleet summary from a path or an s3:// URL; raise SummaryError if it is not one."""
    if source.startswith("s3://"):
        data = (store or S3Store()).get(source).decode("utf-8")
    else:
        data = Path(source).read_text(encoding="utf-8")
    try:
        summary = json.loads(data)
    except ValueError as exc:
        raise SummaryError(f"{source}: not JSON: {exc}") from None
    if not isinstance(summary, dict) or summary.get("format") != FORMAT:
        raise SummaryError(f"{source}: not a pytest-gpuhost fleet summary (format {FORMAT})")
    return summary

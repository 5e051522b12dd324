"""Snapshots of what a run could have written: a lab host's files, a local folder, an S3 bucket.

A lab host's root is an overlay whose upper directory holds every file the host changed since it
booted (gpulab/host/lab.py), so a walk of that directory, before and after a run, shows each
write the run made on the host, its containers included. The sysfs writes go to the lab's
record instead (`LabHost.record()`), compared as a count.

Left out of the comparison, each because a process other than the run writes it on a login:
sshd's and PAM's login records (utmp, wtmp, btmp, lastlog) and systemd-logind's and the
journal's own files. Nothing the plugin or its agent writes is left out.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["LOGIN_RECORDS", "bucket_snapshot", "diff", "host_snapshot", "settled_snapshot", "tree_snapshot"]

#: Paths (relative to a machine's /) that sshd, PAM, logind and journald write on every login.
LOGIN_RECORDS = (
    "var/log/wtmp",
    "var/log/btmp",
    "var/log/lastlog",
    "var/log/journal",
    "var/lib/systemd",
    "var/lib/private/systemd",
    "run",
    "var/run",
)


def _entry(path: Path) -> tuple[str, Any]:
    st = path.lstat()
    if path.is_symlink():
        return "link", os.readlink(path)
    if path.is_dir():
        return "dir", oct(st.st_mode & 0o7777)
    if not path.is_file():
        return "special", st.st_mode  # a char device of 0/0 is an overlay whiteout: a deletion
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return "file", (st.st_size, digest, oct(st.st_mode & 0o7777))


def tree_snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[str, Any]]:
    """Every path under root (relative), with its type and content digest; {} when root is absent."""
    out: dict[str, tuple[str, Any]] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        kept = []
        for d in dirnames:
            rel = os.path.join(rel_dir, d)
            if any(rel == s or rel.startswith(s + "/") for s in skip):
                continue
            kept.append(d)
            out[rel] = _entry(Path(dirpath) / d)
        dirnames[:] = kept
        for name in filenames:
            rel = os.path.join(rel_dir, name)
            if any(rel == s or rel.startswith(s + "/") for s in skip):
                continue
            out[rel] = _entry(Path(dirpath) / name)
    return out


def host_snapshot(host: Any) -> dict[str, Any]:
    """What a lab host (and each of its containers) holds beyond its pristine root, and its sysfs writes."""
    snap: dict[str, Any] = {}
    for m in host.machines():
        upper = host._fs(m) / "upper"
        snap[f"{m.name}:/"] = tree_snapshot(upper, LOGIN_RECORDS)
    snap["sysfs writes"] = len(host.record())
    return snap


def settled_snapshot(host: Any, timeout: float = 30.0, gap: float = 5.0) -> dict[str, Any]:
    """A host's snapshot once its own processes stopped writing (two in a row, `gap` apart, agree).

    A freshly booted host still settles: the B200 node's `vim` (a decoy editing the notes) writes
    its swap file once more `updatetime` (4 s, vim's `:help 'updatetime'`) after it starts. Those
    are the host's writes, not a run's.
    """
    deadline = time.monotonic() + timeout
    snap = host_snapshot(host)
    while True:
        time.sleep(gap)
        again = host_snapshot(host)
        if again == snap or time.monotonic() > deadline:
            return again
        snap = again


def bucket_snapshot(client: Any, bucket: str) -> dict[str, Any]:
    """Every object (key -> ETag, size) and every open multipart upload of a bucket."""
    objects: dict[str, Any] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            objects[o["Key"]] = (o["ETag"], o["Size"])
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return {"objects": objects, "uploads": sorted(u["Key"] for u in uploads)}


def diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Say what changed between two snapshots, one line per path (empty: nothing changed)."""
    lines: list[str] = []
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        if isinstance(b, dict) and isinstance(a, dict):
            lines += [f"{key}{line}" for line in diff(b, a)]
        elif b != a:
            lines.append(f"{key}: {b!r} -> {a!r}")
    return lines

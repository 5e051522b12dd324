"""What a decommission needs, checked before its first change: one line per problem, all at once.

Two halves. The suite's preconditions (suite.py) are asked once per run, on the controller,
before any test (at configure): the options the manifest implies (`--backup-to` for categories
marked s3, or for in_s3 files sent there), each backup directory (a folder this user can make
or write), and each S3 location (the bucket answers with the credentials given). A problem
there is a usage error: pytest exits 4 and nothing has connected to a node. `node_problems`
is asked per node by step 1 (inventory), from the listing it just read: room at the backup
directory for the bytes it will copy. A problem there fails step 1, so no server is stopped
and nothing is copied; pytest exits 1 and the verdict says "refused before any change".
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pytest_gpuhost.exec.s3io import location_problem
from pytest_gpuhost.modules.backup.local import Listing, Manifest
from pytest_gpuhost.redact import printable, redact

__all__ = [
    "backup_dir_problem",
    "bytes_to_copy",
    "node_problems",
    "options_problems",
    "s3_destinations",
    "s3_problems",
    "space_problem",
]


def options_problems(manifest: Manifest, *, backup_to: str | None, send_to: str | None) -> list[str]:
    """The options the manifest implies and the run lacks, one line each."""
    problems = []
    s3_cats = [c.name for c in manifest.categories if c.s3]
    if s3_cats and not backup_to:
        problems.append(
            f"the manifest marks {', '.join(s3_cats)} for S3 (s3: true) but no --backup-to=s3://BUCKET/PREFIX "
            "was given: pass it, or remove s3: true from those categories"
        )
    in_s3 = [c.name for c in manifest.categories if c.in_s3]
    if send_to == "backup-to" and in_s3 and not backup_to:
        problems.append(
            f"--in-s3-send-to=backup-to sends files of {', '.join(in_s3)} under --backup-to, "
            "but no --backup-to was given"
        )
    return problems


def _nearest_existing(path: Path) -> Path:
    """The path itself, or the closest of its parents that exists (what a mkdir -p would start from)."""
    p = path
    while not os.path.lexists(p) and p.parent != p:
        p = p.parent
    return p


def backup_dir_problem(dest: Path) -> str | None:
    """Why the backup directory cannot be made or written by this user, or None. Nothing is made."""
    p = _nearest_existing(dest)
    if p.is_symlink() and p == dest:
        return f"--backup-dir {dest} is a symbolic link: give the directory it points to"
    if not p.is_dir():
        what = "is not a directory" if p == dest else f"cannot be made: {p} is not a directory"
        return f"--backup-dir {dest} {what}"
    if not os.access(p, os.W_OK | os.X_OK):
        what = "is not writable" if p == dest else f"cannot be made: {p} is not writable"
        return f"--backup-dir {dest} {what} by this user (uid {os.geteuid()})"
    return None


def bytes_to_copy(
    listing: Listing, held: Mapping[str, Mapping[str, Any]], in_s3_categories: Iterable[str]
) -> int:
    """Bytes the local backup still has to receive: the files it does not hold verified at their size.

    Files under a category's in_s3 roots are proved where they are and copied only when that
    proof fails, so they are left out (the space they might need is not known before the proof).
    """
    skip = set(in_s3_categories)
    total = 0
    for f in listing.files:
        if f.category in skip:
            continue
        rec = held.get(f.key) or {}
        if rec.get("sha256") and rec.get("s") == f.size:
            continue
        total += int(f.size)
    return total


def space_problem(dest: Path, needed: int, *, margin: float = 0.02) -> str | None:
    """Why `needed` bytes will not fit at dest's filesystem (with a small margin), or None."""
    if needed <= 0:
        return None
    where = _nearest_existing(dest)
    try:
        free = shutil.disk_usage(where).free
    except OSError as exc:
        return f"--backup-dir {dest}: free space unknown ({exc.strerror})"
    if needed * (1 + margin) > free:
        return (
            f"--backup-dir {dest}: {needed / 1e9:.2f} GB to copy from the node, {free / 1e9:.2f} GB free "
            f"on its filesystem ({where}): free space or give another --backup-dir"
        )
    return None


def node_problems(
    listing: Listing, manifest: Manifest, dest: Path, held: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """What one node's listing shows the run cannot do, one line each (step 1, before any stop)."""
    problems = []
    why = space_problem(dest, bytes_to_copy(listing, held, [c.name for c in manifest.categories if c.in_s3]))
    if why:
        problems.append(why)
    return problems


def s3_destinations(
    manifest: Manifest, backup_to: list[str], *, in_s3_to_backup_to: bool = False
) -> list[tuple[str, str]]:
    """Return (s3:// URL, how the operator named it) of every S3 location the run will use, once each.

    `--backup-to` (each target's URL) when a category is marked s3, or when in_s3 files not
    proved in place go there (`--in-s3-send-to=backup-to`) ("--backup-to s3://B/P"), and each
    category's `in_s3` locations ("in_s3 s3://B/P of category data").
    """
    out: list[tuple[str, str]] = []
    if any(c.s3 or (in_s3_to_backup_to and c.in_s3) for c in manifest.categories):
        out += [(url, f"--backup-to {url}") for url in dict.fromkeys(backup_to)]
    for cat in manifest.categories:
        out += [
            (url, f"in_s3 {url} of category {cat.name}") for url in dict.fromkeys(u for _, u in cat.in_s3)
        ]
    return out


def s3_problems(dests: list[tuple[str, str]], endpoint: str | None) -> list[str]:
    """Check that every destination can be read, before anything is stopped; one line per one that cannot.

    Each is asked what the run asks first (`location_problem`: HeadBucket, then a listing of one
    key under the prefix); nothing is written, so a bucket that lists but refuses writes is
    still found only by the upload itself.
    """
    problems = []
    for url, named in dests:
        why = location_problem(url, endpoint=endpoint)
        if why is not None:
            problems.append(printable(redact(f"{named}: {why}")).replace("\n", "\\n"))
    return problems

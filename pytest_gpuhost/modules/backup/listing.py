"""What the node holds: the backup_walk listing, its files, and the items that are not verified."""

from __future__ import annotations

import base64
import errno
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pytest_gpuhost.exec.agent import probe_backup as wire
from pytest_gpuhost.modules.backup.manifest import BackupError, Manifest

__all__ = ["Item", "Listing", "RemoteFile", "listing_from", "reason", "unname", "wire_name"]


class Item(NamedTuple):
    """A path in scope that is not verified in the backup, and why (one blocks safe-to-terminate)."""

    path: str
    why: str


def unname(item: dict[str, Any], key: str = "p", bkey: str = "pb") -> bytes:
    """Return the path bytes of a wire name ({"p": str} or {"pb": base64})."""
    if bkey in item:
        return base64.b64decode(item[bkey])
    return str(item[key]).encode("utf-8")


def wire_name(raw: bytes) -> dict[str, str]:
    """Return the wire form of a path given as bytes."""
    try:
        return {"p": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"pb": base64.b64encode(raw).decode("ascii")}


_REASONS = {
    wire.NOT_REGULAR: "changed type since the listing: no longer a regular file",
    wire.CHANGED: "changed while it was read (size, mtime or ctime moved)",
    wire.BAD_META: "left out: its size, mtime or mode cannot be carried (outside every wire format)",
    errno.ELOOP: "changed type since the listing: now a symlink",
    errno.ENOTDIR: "changed type since the listing: a directory on its path is not one now",
    errno.ENOENT: "vanished since the listing",
    errno.EACCES: "cannot open: permission denied",
    errno.EPERM: "cannot open: operation not permitted",
    errno.ENAMETOOLONG: "path too long",
}


def reason(code: int) -> str:
    """Return the reason for a node-side failure code (an errno, or a probe_backup BK_ code)."""
    return _REASONS.get(code) or (os.strerror(code) if code > 0 else f"failed (code {code})")


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One file or symlink on the node, as listed by backup_walk (slots: one of these per file)."""

    category: str
    path: bytes  # absolute path on the node, raw bytes
    kind: str  # "f" regular file, "l" symlink
    size: int
    mtime_ns: int
    mode: int
    link: bytes | None = None
    anchor_len: int = 0  # path[:anchor_len] is the operator's root: only below it is O_NOFOLLOW
    allocated: int | None = None  # bytes allocated on the node (less than size when sparse)
    ctime_ns: int | None = None  # the inode's change time: moves with any write, never set back
    ino: int | None = None
    _key: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def identity(self) -> tuple[int, int] | None:
        """(ctime_ns, inode) as listed, or None where the listing did not say."""
        return (self.ctime_ns, self.ino) if self.ctime_ns is not None and self.ino is not None else None

    @property
    def key(self) -> str:
        """Path inside the backup directory (str with surrogateescape for non-UTF-8 bytes)."""
        if self._key is not None:
            return self._key
        rel = self.path.lstrip(b"/")
        parts = rel.split(b"/")
        if not rel or any(part in (b"", b".", b"..") for part in parts):
            raise BackupError(f"refusing unsafe node path {self.path!r}")
        key = self.category + "/" + os.fsdecode(rel)
        object.__setattr__(self, "_key", key)  # computed once (frozen: set as a cache)
        return key

    def share_key(self, key: str | None) -> None:
        """Hold this equal key string instead of an own one (the state's: one string, not two)."""
        if key is not None and key == self.key:
            object.__setattr__(self, "_key", key)

    @property
    def display(self) -> str:
        return self.path.decode("utf-8", "backslashreplace")

    def wire(self) -> dict[str, Any]:
        """Return the path as backup_hash takes it (name and anchor)."""
        return dict(wire_name(self.path), a=self.anchor_len)


@dataclass
class Listing:
    """What the node holds for each category (one backup_walk round trip)."""

    files: list[RemoteFile]
    skipped: list[dict[str, Any]]  # left out by the manifest's rules (max_size, not a file or link)
    errors: list[dict[str, Any]]  # could not be listed: each is an unverified item
    duration: float
    # one record per (category, root named): kind (dir, file, link, missing, error), n entries,
    # k left out by the rules, e not listed, to (a link's target), real (a followed link's path)
    roots: list[dict[str, Any]] = field(default_factory=list)

    def totals(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for f in self.files:
            t = out.setdefault(f.category, {"files": 0, "links": 0, "bytes": 0, "allocated": 0})
            if f.kind == "l":
                t["links"] += 1
            else:
                t["files"] += 1
                t["bytes"] += f.size
                t["allocated"] += f.size if f.allocated is None else f.allocated
        return out

    def unlisted(self) -> list[Item]:
        """Return an item for each path in scope the node could not list."""
        return [Item(e["path"], str(e.get("error") or "cannot list")) for e in self.errors]


def _unb64(text: str) -> bytes:
    return base64.b64decode(text[1:], validate=True)


def _packed_files(category: str, blocks: list[str], files: list[RemoteFile]) -> None:
    """Read the walk's packed lines (probe_backup_walk.py), freeing each block once it is read.

    Numbers of up to five digits (sizes, modes, allocations of small files) are shared objects:
    a million small files hold a few thousand distinct ones, not three million.
    """
    nums: dict[str, int] = {}

    def num(tok: str) -> int:
        n = nums.get(tok)
        if n is None:
            n = int(tok)
            if len(tok) < 6:
                nums[tok] = n
        return n

    blocks.reverse()
    while blocks:
        block = blocks.pop()
        for line in block.split("\n"):
            t, s, m, o, b, c, i, a, lk, name = line.split(" ", 9)
            if t not in ("f", "l"):
                raise BackupError(f"the node's listing is not understood (kind {t[:10]!r})")
            files.append(
                RemoteFile(
                    category,
                    name.encode("utf-8") if name.startswith("/") else _unb64(name),
                    "f" if t == "f" else "l",
                    num(s),
                    int(m),
                    num(o),
                    None if lk == "-" else _unb64(lk),
                    num(a),
                    num(b),
                    int(c),
                    int(i),
                )
            )
        del block


def listing_from(manifest: Manifest, res: dict[str, Any]) -> Listing:
    """Turn a backup_walk result into a Listing (a path listed twice in one category: once).

    The result's listed entries are consumed (each block freed as it is read).
    """
    files: list[RemoteFile] = []
    skipped: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    roots: list[dict[str, Any]] = []
    for cat in manifest.categories:
        part = res["categories"].get(cat.name, {})
        _packed_files(cat.name, part.get("packed") or [], files)
        for e in part.get("entries", []):  # an entry as a dict (the listing's older form)
            link = None
            if e["t"] == "l":
                link = base64.b64decode(e["lb"]) if "lb" in e else str(e["l"]).encode("utf-8")
            files.append(
                RemoteFile(
                    cat.name,
                    unname(e),
                    e["t"],
                    int(e["s"]),
                    int(e["m"]),
                    int(e["o"]),
                    link,
                    int(e.get("a", 0)),
                    int(e["b"]) if "b" in e else None,
                    int(e["c"]) if "c" in e else None,
                    int(e["i"]) if "i" in e else None,
                )
            )
        for s in part.get("skipped", []):
            skipped.append(
                {
                    "category": cat.name,
                    "path": unname(s).decode("utf-8", "backslashreplace"),
                    "size": s.get("s"),
                    "why": s.get("why"),
                }
            )
        for r in part.get("roots", []):
            roots.append(
                {
                    "category": cat.name,
                    "root": unname(r).decode("utf-8", "backslashreplace"),
                    "kind": str(r.get("kind", "?")),
                    "n": int(r.get("n", 0)),
                    "k": int(r.get("k", 0)),
                    "e": int(r.get("e", 0)),
                    "x": int(r.get("x", 0)),
                    "xd": int(r.get("xd", 0)),
                    **{k: str(r[k]) for k in ("to", "real") if k in r},
                }
            )
        # a root the operator marked expected_empty may be absent: that is not an error of the walk
        absent = {
            unname(r) for r in part.get("roots", []) if r.get("kind") == "missing" and cat.expected_empty
        }
        for err in part.get("errors", []):
            if err.get("errno") == errno.ENOENT and unname(err) in absent:
                continue
            errors.append(
                {
                    "category": cat.name,
                    "path": unname(err).decode("utf-8", "backslashreplace"),
                    "errno": err.get("errno"),
                    "error": err.get("error"),
                }
            )
    seen: set[str] = set()
    unique = []
    for f in files:
        if f.key not in seen:
            seen.add(f.key)
            unique.append(f)
    del seen, files
    for f in unique:
        # each key is made again on first use, then shared with the state's (plan): a million
        # files never hold two strings of each key at once while the state is read
        object.__setattr__(f, "_key", None)
    return Listing(unique, skipped, errors, float(res.get("duration", 0.0)), roots)

"""What the backup can prove: every path in scope verified, or an item saying why not; SHA256SUMS."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pytest_gpuhost.modules.backup.listing import Item, Listing, RemoteFile

__all__ = ["same_local", "same_node", "sha256_file", "unverified", "write_checksums"]


def same_node(rec: dict[str, Any], f: RemoteFile) -> bool:
    """Whether the node's file is the inode, unchanged, that the record was verified from.

    Size and mtime are not enough: `cp -p`, `tar -x`, `rsync -t` and `touch -r` put an mtime
    back after changing the bytes. The ctime moves with every change of an inode and no tool can
    set it back (utimensat(2) sets only atime and mtime), so (ctime, inode) as listed must match.
    A record without them is not trusted.
    """
    if f.identity is None:
        return True  # a listing that does not say: size and mtime only (an agent without the fields)
    return (rec.get("c"), rec.get("i")) == f.identity


def same_local(rec: dict[str, Any], st: os.stat_result) -> bool:
    """Whether the local copy is the inode, unchanged, that was placed (see same_node)."""
    return (rec.get("lc"), rec.get("li")) == (st.st_ctime_ns, st.st_ino)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def unverified(
    listing: Listing,
    items: Mapping[str, dict[str, Any]],
    local: Callable[[RemoteFile], Path],
    *,
    seen_current: dict[str, Any],
    failures: dict[str, str],
    rehash_local: bool = False,
) -> list[Item]:
    """Return an Item for each path in scope that is not verified: unlisted, failed, or differing.

    items: the verified state; seen_current: the record (as items holds it, Records.held) of each
    file plan() found current moments ago, trusted without another stat while items still holds
    that very record and the listing the same size and mtime; failures: the last transfer's
    reason per key, said instead of "never copied".
    """
    held = getattr(items, "held", items.get)
    missing = listing.unlisted()
    for f in listing.files:
        rec = items.get(f.key)
        if rec is None:
            why = failures.get(f.key)
            missing.append(Item(f.display, f"not copied: {why}" if why else "never copied"))
            continue
        seen = seen_current.get(f.key)
        if (
            not rehash_local
            and seen is not None
            and seen is held(f.key)
            and rec.get("s") == f.size
            and rec.get("m") == f.mtime_ns
        ):
            continue
        path = local(f)
        try:
            lst = os.lstat(path)
        except OSError as exc:
            too_long = exc.errno == errno.ENAMETOOLONG
            missing.append(
                Item(f.display, "local path too long" if too_long else "missing in the backup directory")
            )
            continue
        if f.kind == "l":
            if not stat.S_ISLNK(lst.st_mode) or os.fsencode(os.readlink(path)) != f.link:
                missing.append(Item(f.display, "link differs"))
            continue
        if rec.get("s") != f.size or rec.get("m") != f.mtime_ns or not same_node(rec, f):
            why = failures.get(f.key) or "changed on the node since it was copied"
            missing.append(Item(f.display, why))
        elif (
            not stat.S_ISREG(lst.st_mode)
            or lst.st_size != f.size
            or lst.st_mtime_ns != rec.get("lm", f.mtime_ns)
        ):
            missing.append(Item(f.display, "local copy altered"))
        elif (rehash_local or not same_local(rec, lst)) and sha256_file(path) != rec.get("sha256"):
            # an edit of the copy with size and mtime put back moves its ctime: the bytes decide
            missing.append(Item(f.display, "local copy altered (SHA-256 differs from the node's)"))
    return missing


def write_checksums(dest: Path, listing: Listing, items: Mapping[str, dict[str, Any]]) -> Path:
    """Write DEST/SHA256SUMS (sha256sum -c compatible, node hashes) for the listed files."""
    out = dest / "SHA256SUMS"
    tmp = out.with_name(".SHA256SUMS.tmp")
    # written line by line (a buffered file), in the order of the keys: a million lines are never
    # held at once; only the order is (one reference per file)
    with open(tmp, "wb") as fh:
        for f in sorted(listing.files, key=lambda f: f.key):
            rec = items.get(f.key)
            if rec is None or f.kind != "f" or "sha256" not in rec:
                continue
            name = os.fsencode(f.key)
            if b"\\" in name or b"\n" in name or b"\r" in name:
                esc = name.replace(b"\\", b"\\\\").replace(b"\n", b"\\n").replace(b"\r", b"\\r")
                fh.write(b"\\" + rec["sha256"].encode() + b"  " + esc + b"\n")
            else:
                fh.write(rec["sha256"].encode() + b"  " + name + b"\n")
    os.replace(tmp, out)
    return out

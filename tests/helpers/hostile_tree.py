"""Ground truth for backup tests, computed without the engine: trees built, read and compared by fd.

A tree spec is a dict {name (bytes): node}; a node is ("f", content), ("l", link target),
("p", b"") for a FIFO or ("d", spec).  The test's own view of a tree (`snapshot`) and of a
backup (`read_at`, `compare_local`, `compare_s3`) walks with directory file descriptors and
O_NOFOLLOW, so paths over PATH_MAX and names with any byte but `/` and NUL are read as they are.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Snapshot",
    "Spec",
    "build",
    "compare_local",
    "compare_s3",
    "iter_spec",
    "read_at",
    "snapshot",
]

Spec = dict[bytes, tuple[str, Any]]
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG)


def iter_spec(spec: Spec, prefix: bytes = b"") -> Iterator[tuple[bytes, str, Any]]:
    """Yield (relative path, kind, payload) for every node of a spec, parents first."""
    for name, (kind, payload) in spec.items():
        rel = prefix + name
        yield rel, kind, payload
        if kind == "d":
            yield from iter_spec(payload, rel + b"/")


def build(dir_fd: int, spec: Spec) -> None:
    """Create a spec's nodes under an open directory (fd-relative: any depth, any name)."""
    for name, (kind, payload) in spec.items():
        if kind == "d":
            os.mkdir(name, 0o755, dir_fd=dir_fd)
            fd = os.open(name, _DIR, dir_fd=dir_fd)
            try:
                build(fd, payload)
            finally:
                os.close(fd)
        elif kind == "f":
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        elif kind == "l":
            os.symlink(payload, name, dir_fd=dir_fd)
        elif kind == "p":
            os.mkfifo(name, 0o644, dir_fd=dir_fd)
        else:
            raise ValueError(f"unknown node kind {kind!r}")


@dataclass
class Snapshot:
    """What a tree holds in a backup's scope: regular files and links (never followed), and its dirs."""

    entries: dict[bytes, tuple[str, bytes]] = field(default_factory=dict)  # rel -> ("f"|"l", bytes)
    dir_modes: dict[bytes, int] = field(default_factory=dict)  # rel ("" for the root) -> st_mode


def _open_chain(root: bytes, parts: list[bytes]) -> int:
    """Open root, then each part below it with O_NOFOLLOW; return the last directory's fd."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            nfd = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_fd(fd: int) -> bytes:
    chunks = []
    while block := os.read(fd, 1 << 20):
        chunks.append(block)
    return b"".join(chunks)


def snapshot(root: bytes) -> Snapshot:
    """Return the in-scope contents of the tree at root, read fd-relative (as the caller's user)."""
    snap = Snapshot()

    def walk(fd: int, prefix: bytes) -> None:
        for entry in os.scandir(fd):
            name = os.fsencode(entry.name)
            rel = prefix + name
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                snap.entries[rel] = ("l", os.readlink(name, dir_fd=fd))
            elif stat.S_ISREG(st.st_mode):
                ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
                try:
                    snap.entries[rel] = ("f", _read_fd(ffd))
                finally:
                    os.close(ffd)
            elif stat.S_ISDIR(st.st_mode):
                snap.dir_modes[rel] = st.st_mode
                dfd = os.open(name, _DIR, dir_fd=fd)
                try:
                    walk(dfd, rel + b"/")
                finally:
                    os.close(dfd)

    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        snap.dir_modes[b""] = os.fstat(fd).st_mode
        walk(fd, b"")
    finally:
        os.close(fd)
    return snap


def read_at(root: bytes, rel: bytes) -> tuple[str, bytes] | None:
    """Return ("f", content), ("l", target) or ("?", b"") for root/rel without following links; None if absent."""
    *parents, last = rel.split(b"/")
    try:
        fd = _open_chain(root, parents)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    try:
        st = os.stat(last, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            return ("l", os.readlink(last, dir_fd=fd))
        if not stat.S_ISREG(st.st_mode):
            return ("?", b"")
        ffd = os.open(last, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        try:
            return ("f", _read_fd(ffd))
        finally:
            os.close(ffd)
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    finally:
        os.close(fd)


def local_rel(category: str, src_root: bytes, rel: bytes) -> bytes:
    """Return a node file's path inside a backup directory: <category>/<absolute path without '/'>."""
    return category.encode() + b"/" + src_root.lstrip(b"/") + b"/" + rel


def compare_local(
    dest: bytes, category: str, src_root: bytes, expected: dict[bytes, tuple[str, bytes]]
) -> list[tuple[bytes, str]]:
    """Return (rel, why) for each expected entry that the backup directory does not hold byte for byte."""
    bad = []
    for rel, (kind, data) in expected.items():
        got = read_at(dest, local_rel(category, src_root, rel))
        if got is None:
            bad.append((rel, "absent"))
        elif got[0] != kind:
            bad.append((rel, f"a {got[0]!r} where a {kind!r} was expected"))
        elif got[1] != data:
            bad.append((rel, f"content differs ({len(got[1])} bytes, expected {len(data)})"))
    return bad


def s3_key(prefix: str, category: str, src_root: bytes, rel: bytes) -> str:
    """Return the S3 key of a node file: the engine's documented %XX escaping, written again here."""
    # UTF-8 sequences stay as they are; bytes that are not valid UTF-8, control characters and
    # `%` become %XX (the layout modules/backup/s3.py documents)
    text = []
    for ch in local_rel(category, src_root, rel).decode("utf-8", "surrogateescape"):
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:
            text.append(f"%{o - 0xDC00:02X}")
        elif o < 0x20 or o == 0x7F or ch == "%":
            text.append(f"%{o:02X}")
        else:
            text.append(ch)
    key = "".join(text)
    return f"{prefix}/{key}" if prefix else key


def compare_s3(
    client: Any,
    bucket: str,
    prefix: str,
    category: str,
    src_root: bytes,
    expected: dict[bytes, tuple[str, bytes]],
) -> list[tuple[bytes, str]]:
    """Return (rel, why) for each expected entry whose object is absent or differs, read back with boto3."""
    bad = []
    for rel, (kind, data) in expected.items():
        key = s3_key(prefix, category, src_root, rel)
        try:
            obj = client.get_object(Bucket=bucket, Key=key)
        except client.exceptions.NoSuchKey:
            bad.append((rel, f"no object {key!r}"))
            continue
        body = obj["Body"].read()
        is_link = obj.get("Metadata", {}).get("symlink") == "1"
        if is_link != (kind == "l"):
            bad.append((rel, f"object {key!r} is {'a link' if is_link else 'a file'}, expected a {kind!r}"))
        elif body != data:
            bad.append((rel, f"object {key!r} differs ({len(body)} bytes, expected {len(data)})"))
    return bad

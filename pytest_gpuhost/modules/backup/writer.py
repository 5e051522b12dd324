"""The local side of a backup: files take their final name only once both SHA-256 digests agree.

Every error here is about one file and is returned as its reason (a local path too long, a
directory in the way, a full disk): the caller records it and goes on with the next file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_gpuhost.exec.agent import probe_backup as wire
from pytest_gpuhost.modules.backup.listing import RemoteFile, reason, wire_name
from pytest_gpuhost.modules.backup.state import StateFile

__all__ = ["LocalWriter", "Piece", "link_record", "local_identity"]

Piece = bytes | int  # data, or the length of a hole (zero bytes not sent, not written)
_ZERO = memoryview(bytes(wire.CHUNK))  # slices of a memoryview are not copies
_PART_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW


def local_identity(st: os.stat_result) -> dict[str, int]:
    """The copy's own (ctime, inode) as recorded: an edit of the copy that puts size and mtime
    back still moves its ctime, so a later check hashes the copy again."""
    return {"lc": st.st_ctime_ns, "li": st.st_ino}


def link_record(f: RemoteFile) -> dict[str, Any]:
    """Return the state record of a symlink (its target is its content)."""
    target = f.link or b""
    return {
        "t": "l",
        "s": len(target),
        "m": f.mtime_ns,
        "sha256": hashlib.sha256(target).hexdigest(),
        **{("l" if k == "p" else "lb"): v for k, v in wire_name(target).items()},
    }


def hash_zeros(digest: Any, n: int) -> None:
    """Feed n zero bytes (a hole) to a digest."""
    while n:
        take = min(n, wire.CHUNK)
        digest.update(_ZERO[:take])
        n -= take


def write_all(fd: int, piece: bytes) -> None:
    view = memoryview(piece)
    while view:
        view = view[os.write(fd, view) :]


class LocalWriter:
    """Place verified files and links under dest; journal each in the state file."""

    def __init__(
        self, dest: Path, meta: Path, state: StateFile, placed: Callable[[RemoteFile, dict[str, Any]], None]
    ) -> None:
        self.dest = dest
        self.tmp = meta / "tmp"
        self.state = state
        self.placed = placed
        self._dirs_ok: set[str] = set()
        self.lock = threading.Lock()

    def local(self, f: RemoteFile) -> Path:
        return self.dest / f.key

    def clean_tmp(self) -> None:
        self.tmp.mkdir(exist_ok=True)
        for leftover in self.tmp.iterdir():
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover)  # a writer thread's directory
            else:
                leftover.unlink()

    def parent(self, path: Path) -> None:
        """Create the parent directories of path inside dest, refusing any symlink on the way."""
        parent = path.parent
        key = str(parent)
        if key in self._dirs_ok:
            return
        cur = self.dest
        for part in parent.relative_to(self.dest).parts:
            cur = cur / part
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                try:
                    os.mkdir(cur)
                except FileExistsError:  # another writer thread made it meanwhile
                    pass
                continue
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                # a node path that was a link (or file) last time and is a directory now
                with self.lock:
                    st = os.lstat(cur)
                    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                        os.unlink(cur)
                        os.mkdir(cur)
        self._dirs_ok.add(key)

    def make_link(self, f: RemoteFile) -> str | None:
        """Recreate a symlink (never followed); return why not, or None."""
        tmp = self.tmp / f"link-{os.getpid()}"
        try:
            local = self.local(f)
            self.parent(local)
            os.symlink(os.fsdecode(f.link or b""), tmp)
            if local.is_dir() and not local.is_symlink():
                os.unlink(tmp)
                return "a directory is in the way of the link in the backup"
            os.replace(tmp, local)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            return f"local link: {reason(exc.errno or 0)}"
        rec = link_record(f)
        with self.lock:
            self.state.record(f.key, rec)
        self.placed(f, rec)
        return None

    def open_part(self, path: Path) -> int:
        return os.open(path, _PART_FLAGS, 0o600)

    def store(self, f: RemoteFile, tmp: Path, trailer: tuple[Any, ...], digest: bytes, fd: int) -> str | None:
        """Check the digests, set mode and mtime, rename into place; return why not, or None.

        Closes fd; on failure the temporary file is removed.
        """
        code, size, mtime_ns, mode, changed, node_sha = trailer
        placed = False
        try:
            try:
                if code:
                    return f"not read on the node: {reason(code)}"
                if digest != node_sha:
                    return "SHA-256 on arrival differs from the node's"
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)  # a hole at the end of a sparse file
                os.fchmod(fd, mode & 0o777 | 0o200)
                # the mtime seen when the node opened the file: if it was being written meanwhile,
                # the next run sees a different mtime and hashes it again
                try:
                    os.utime(fd, ns=(mtime_ns, mtime_ns))
                except (OverflowError, ValueError, OSError) as exc:
                    # an mtime this filesystem cannot hold (beyond its range): the bytes are
                    # verified and kept; the copy's mtime is the arrival time, and the record
                    # keeps the node's, so the next run compares like with like
                    if isinstance(exc, OSError) and exc.errno not in (errno.EINVAL, errno.EOVERFLOW):
                        raise
                held = os.fstat(fd)
                local_mtime = held.st_mtime_ns  # the kernel clamps an mtime to the filesystem's range
                allocated = held.st_blocks * 512
            finally:
                os.close(fd)
            final = self.local(f)
            self.parent(final)
            os.replace(tmp, final)
            placed = True
            here = os.lstat(final)  # after the rename, which moves the copy's own ctime
        except OSError as exc:
            return f"writing the copy: {reason(exc.errno or 0)}"
        finally:
            if not placed:
                tmp.unlink(missing_ok=True)
        rec = {
            "t": "f",
            "s": size,
            "a": allocated,
            "m": mtime_ns if not changed else -1,
            "o": mode,
            "sha256": node_sha.hex(),
            **local_identity(here),
        }
        if local_mtime != mtime_ns:
            rec["lm"] = local_mtime  # the copy's own mtime, where this filesystem cannot hold the node's
        if f.identity is not None and not changed:
            rec["c"], rec["i"] = f.identity  # as listed; a change after it moves ctime: hashed again
        with self.lock:
            self.state.record(f.key, rec)
        if changed:
            return "changed on the node while it was copied"
        self.placed(f, rec)
        return None

    def write_small(
        self, f: RemoteFile, tmp: Path, pieces: list[Piece], trailer: tuple[Any, ...]
    ) -> str | None:
        """Hash, write and place one small file (runs in a writer thread, off the stream)."""
        try:
            fd = self.open_part(tmp)
        except OSError as exc:
            return f"writing the copy: {reason(exc.errno or 0)}"
        try:
            if all(isinstance(p, bytes) for p in pieces):
                data = b"".join(pieces)  # type: ignore[arg-type]
                write_all(fd, data)
                digest = hashlib.sha256(data).digest()
            else:
                h = hashlib.sha256()
                for p in pieces:
                    if isinstance(p, int):
                        os.lseek(fd, p, os.SEEK_CUR)
                        hash_zeros(h, p)
                    else:
                        write_all(fd, p)
                        h.update(p)
                digest = h.digest()
        except OSError as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            return f"writing the copy: {reason(exc.errno or 0)}"
        return self.store(f, tmp, trailer, digest, fd)

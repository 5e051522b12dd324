"""Back up a node's files to a local directory: one bulk stream, SHA-256 on both ends, resumable.

The node lists the manifest's categories in one agent round trip (`backup_walk`, fd-relative,
never following a link).  Files that are missing locally or differ (size, mtime, or SHA-256 when
only the mtime moved) travel over one raw channel running the bulk sender from
`exec/agent/probe_backup.py`: the node hashes each file while it reads it (holes of sparse files
are sent as lengths, not bytes), the controller hashes while it writes, and a file takes its final
name (atomic rename) only when both digests agree.  Each verified file is journalled at once, so
an interrupted run resumes where it stopped.  `verify()` returns an Item for every path in scope
that is not verified, including those the node could not list: nothing is dropped silently.

The parts of this package: `manifest` (manifests), `destination` (one folder or S3 prefix per
target), `listing` (listing, items), `state` (state journal, plan, results), `stream` (wire),
`transfer` (the stream), `writer` (local files; the SHA-256 comparison on arrival), `verdict`
(what the backup proves, SHA256SUMS), `s3` (upload and proof of each object).  Layout::

    DEST/<category>/<absolute path on the node without its leading slash>
    DEST/SHA256SUMS            sha256sum format, computed on the node, checked on arrival
    DEST/.gpuhost/             state.json + journal.jsonl (what is verified), tmp/ (one
                               directory per writer thread), lock
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from pytest_gpuhost.modules.backup.listing import Item, Listing, RemoteFile, listing_from, reason
from pytest_gpuhost.modules.backup.manifest import (
    META,
    BackupError,
    Category,
    Manifest,
    ManifestError,
    load_manifest,
    parse_size,
)
from pytest_gpuhost.modules.backup.state import (
    BackupPlan,
    Progress,
    StateFile,
    TransferResult,
    stderr_progress,
)
from pytest_gpuhost.modules.backup.stream import sender_argv
from pytest_gpuhost.modules.backup.transfer import transfer
from pytest_gpuhost.modules.backup.verdict import same_local, same_node, unverified, write_checksums
from pytest_gpuhost.modules.backup.writer import LocalWriter, link_record, local_identity

__all__ = [
    "AgentConnection",
    "Backup",
    "BackupError",
    "BackupPlan",
    "Category",
    "Item",
    "Listing",
    "Manifest",
    "ManifestError",
    "Progress",
    "RemoteFile",
    "StateFile",
    "TransferResult",
    "iter_categories",
    "load_manifest",
    "parse_size",
    "sender_argv",
    "stderr_progress",
]


class AgentConnection(Protocol):
    """What the backup needs from a target connection (pytest_gpuhost.exec.connection.Connection)."""

    def call(self, op: str, **params: Any) -> Any: ...

    def open_channel(self, argv: Sequence[str]) -> Any: ...


class Backup:
    """A node's manifest categories and their local backup directory."""

    def __init__(
        self,
        conn: AgentConnection,
        manifest: Manifest,
        dest: str | os.PathLike[str],
        *,
        progress: Callable[[Progress], None] | None = None,
        progress_interval: float = 1.0,
        stall_timeout: float = 60.0,
        op_timeout: float = 300.0,
        writers: int = 4,
    ) -> None:
        self.conn = conn
        self.writers = max(1, writers)
        self.op_timeout = op_timeout
        self.manifest = manifest
        self.dest = Path(dest)
        self._dest_s = os.fspath(self.dest)
        self.meta = self.dest / META
        self.progress = progress
        self.progress_interval = progress_interval
        self.stall_timeout = stall_timeout
        # The backup directory is made by the first write (a record, or `run`), never here: a
        # run that only reads (--check-only, or one refused before any change) leaves none.
        self.state = StateFile(self.meta, "state")
        self.writer = LocalWriter(self.dest, self.meta, self.state, self._placed)
        # called with (file, state record) for each file or link verified into place: the S3
        # side uses it to upload while the transfer runs
        self.on_placed: Callable[[RemoteFile, dict[str, Any]], None] | None = None
        # files plan() found verified and unchanged, with the (packed) state record it saw: verify()
        # can trust its own stat from moments ago instead of stat-ing them all again, while that
        # very record is still the state's
        self._seen_current: dict[str, Any] = {}
        # why each file of this object's last runs failed (key -> reason), for verify()'s items
        self.failures: dict[str, str] = {}
        self._failures_lock = threading.Lock()

    # -- listing

    def walk(self) -> Listing:
        """List every category on the node in one round trip."""
        res = self.conn.call(
            "backup_walk", categories=[c.wire() for c in self.manifest.categories], timeout=self.op_timeout
        )
        return self.listing_from(res)

    def listing_from(self, res: dict[str, Any]) -> Listing:
        """Turn a backup_walk result (e.g. from a batch) into a Listing."""
        return listing_from(self.manifest, res)

    # -- plan

    def _local(self, f: RemoteFile) -> Path:
        return self.dest / f.key

    def plan(self, listing: Listing) -> BackupPlan:
        """Compare the node's listing with the verified state and what is on disk here."""
        plan = BackupPlan(listing)
        for f in listing.files:
            rec = self.state.items.get(f.key)
            if rec is not None:
                f.share_key(self.state.items.own_key(f.key))
            local = os.path.join(self._dest_s, f.key)  # a str: a Path per file costs more than the lstat
            try:
                lst: os.stat_result | None = os.lstat(local)
            except OSError:
                lst = None
            if f.kind == "l":
                if (
                    lst is not None
                    and stat.S_ISLNK(lst.st_mode)
                    and os.fsencode(os.readlink(local)) == f.link
                ):
                    if rec is None or rec.get("t") != "l":
                        self.state.record(f.key, link_record(f))
                    plan.current.append(f)
                else:
                    plan.links.append(f)
                continue
            local_ok = (
                lst is not None
                and stat.S_ISREG(lst.st_mode)
                and lst.st_size == f.size
                and rec is not None
                and same_local(rec, lst)
            )
            if rec is None or rec.get("t") != "f" or not local_ok or rec["s"] != f.size:
                plan.copy.append(f)
            elif (
                rec["m"] == f.mtime_ns
                and lst is not None
                and lst.st_mtime_ns == rec.get("lm", f.mtime_ns)
                and same_node(rec, f)
            ):
                plan.current.append(f)
                self._seen_current[f.key] = self.state.items.held(f.key)
            else:
                plan.rehash.append(f)  # same size, mtime moved: the node's hash decides
        return plan

    # -- run

    def run(self, plan: BackupPlan) -> TransferResult:
        """Carry out a plan: links, node-side hash comparisons, then one bulk stream of contents."""
        result = TransferResult()
        started = time.monotonic()
        self.meta.mkdir(parents=True, exist_ok=True)
        lock = open(self.meta / "lock", "w")  # noqa: SIM115 - held for the whole run
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise BackupError(f"another backup is writing {self.dest}") from exc
            self.writer.clean_tmp()
            for f in plan.links:
                why = self.writer.make_link(f)
                if why is None:
                    result.links += 1
                else:
                    self._failed(f, why)
                    result.failed.append((f.display, why))
            copy = list(plan.copy)
            if plan.rehash:
                copy += self._rehash(plan.rehash, result)
            if copy:
                transfer(
                    self.conn,
                    self.writer,
                    copy,
                    result,
                    stall_timeout=self.stall_timeout,
                    writers=self.writers,
                    progress=self.progress,
                    progress_interval=self.progress_interval,
                    failed=self._failed,
                )
        finally:
            self.state.flush()
            result.duration = time.monotonic() - started
            lock.close()
        return result

    def _placed(self, f: RemoteFile, rec: dict[str, Any]) -> None:
        with self._failures_lock:
            self.failures.pop(f.key, None)
        if self.on_placed is not None:
            self.on_placed(f, rec)

    def _failed(self, f: RemoteFile, why: str) -> None:
        with self._failures_lock:
            self.failures[f.key] = why

    def _rehash(self, files: list[RemoteFile], result: TransferResult) -> list[RemoteFile]:
        """Hash files on the node; those whose hash still matches only get their mtime updated."""
        hashes = self.conn.call("backup_hash", paths=[f.wire() for f in files], timeout=self.op_timeout)
        changed = []
        for f, h in zip(files, hashes, strict=True):
            rec = self.state.items.get(f.key, {})
            if "sha256" not in h:
                why = f"not read on the node: {reason(int(h.get('errno') or 0))}"
                self._failed(f, why)
                result.failed.append((f.display, why))
            elif h["sha256"] == rec.get("sha256") and h["s"] == f.size:
                try:
                    local = self._local(f)
                    try:
                        os.utime(local, ns=(f.mtime_ns, f.mtime_ns), follow_symlinks=False)
                    except (OverflowError, ValueError):
                        pass  # an mtime beyond this filesystem's range: the record keeps the copy's
                    here = os.lstat(local)  # utime moved the copy's ctime
                except OSError:
                    changed.append(f)  # the local copy is gone meanwhile: copy it again
                    continue
                node = {"c": h["c"], "i": h["i"]} if "c" in h and "i" in h else {}
                new = dict(rec, m=f.mtime_ns, **node, **local_identity(here))
                new.pop("lm", None)
                if here.st_mtime_ns != f.mtime_ns:
                    new["lm"] = here.st_mtime_ns  # clamped by this filesystem
                self.state.record(f.key, new)
                with self._failures_lock:
                    self.failures.pop(f.key, None)
                result.rehashed_same += 1
            else:
                changed.append(f)
        return changed

    # -- verification and outputs

    def verify(self, listing: Listing, *, rehash_local: bool = False) -> list[Item]:
        """Return an Item (node path, why) for every path in scope not verified in the backup.

        Covers the walk too: each path the node could not list is an item, and a file whose last
        copy failed says why (permission, vanished, changed type, changed while copied, local
        path too long).  An empty list is the only "all verified".
        """
        return unverified(
            listing,
            self.state.items,
            self._local,
            seen_current=self._seen_current,
            failures=self.failures,
            rehash_local=rehash_local,
        )

    def write_checksums(self, listing: Listing) -> Path:
        """Write DEST/SHA256SUMS (sha256sum -c compatible, node hashes) for the listed files."""
        return write_checksums(self.dest, listing, self.state.items)

    def finish(self) -> None:
        self.state.compact()


def iter_categories(manifest: Manifest, names: Iterable[str]) -> list[Category]:
    """Return the manifest's categories with these names (for S3: those marked s3)."""
    wanted = set(names)
    return [c for c in manifest.categories if c.name in wanted]

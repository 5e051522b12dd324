"""Back up a node's files to a local directory: one bulk stream, SHA-256 on both ends, resumable.

The node lists the manifest's categories in one agent round trip (`backup_walk`).  Files that are
missing locally or differ (size, mtime, or SHA-256 when only the mtime moved) travel over one raw
channel running the bulk sender from `agent/probe_backup.py`: the node hashes each file while it
reads it, the controller hashes while it writes, and a file takes its final name (atomic rename)
only when both digests agree.  Each verified file is journalled at once, so an interrupted run
resumes where it stopped.  Layout of a backup directory::

    DEST/<category>/<absolute path on the node without its leading slash>
    DEST/SHA256SUMS            sha256sum format, computed on the node, checked on arrival
    DEST/.gpuhost/             state.json + journal.jsonl (what is verified), tmp/ (one
                               directory per writer thread), lock
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import IO, Any, Protocol

import yaml

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules.process import Selection, parse_selection

__all__ = [
    "AgentConnection",
    "Backup",
    "BackupError",
    "BackupPlan",
    "Category",
    "Manifest",
    "Progress",
    "RemoteFile",
    "TransferResult",
    "load_manifest",
    "parse_size",
    "sender_argv",
]

PROBE_SOURCE = Path(__file__).resolve().parent.parent / "exec" / "agent" / "probe_backup.py"
_TRAILER = struct.Struct(">iQqIB32s")
_U32 = struct.Struct(">I")
_END = 0xFFFFFFFF
_SMALL = 4 << 20  # files up to this size are assembled in memory and written by a writer thread
_META = ".gpuhost"


class BackupError(GpuhostError):
    """A backup could not be planned, transferred or verified."""


class AgentConnection(Protocol):
    """What the backup needs from a target connection (pytest_gpuhost.exec.connection.Connection)."""

    def call(self, op: str, **params: Any) -> Any: ...

    def open_channel(self, argv: Sequence[str]) -> Any: ...


# ---------------------------------------------------------------- manifest


@dataclass(frozen=True)
class Category:
    """One manifest category: where its files are and which of them count."""

    name: str
    roots: tuple[str, ...]
    include: tuple[str, ...] = ("**",)
    exclude: tuple[str, ...] = ()
    max_size: int | None = None
    s3: bool = False

    def wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "roots": list(self.roots),
            "include": list(self.include),
            "exclude": list(self.exclude),
            "max_size": self.max_size,
        }


@dataclass(frozen=True)
class Manifest:
    """A backup manifest: what to stop and which categories of files to keep (fixtures/manifests)."""

    name: str
    categories: tuple[Category, ...]
    stop: Selection
    path: str = ""
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # gpu_idle_mib, gpu_idle_timeout


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(value: int | str | None) -> int | None:
    """Parse 1048576, "10M", "1.5 GiB" (powers of 1024) into bytes; None stays None."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"not a size: {value!r} (use bytes or a number with K, M, G, T)")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * 1024**power)


_OPTION_KEYS = ("gpu_idle_mib", "gpu_idle_timeout")
_CATEGORY_KEYS = {"roots", "include", "exclude", "max_size", "s3", "description"}


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Load and validate a backup manifest; raise BackupError naming the bad key."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise BackupError(f"manifest {p}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("categories"), dict):
        raise BackupError(f"manifest {p}: needs a mapping 'categories: {{name: {{roots: [...]}}}}'")
    cats = []
    for name, spec in doc["categories"].items():
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(name)) or name in (_META, ".", ".."):
            raise BackupError(f"manifest {p}: category name {name!r} must be a plain folder name")
        if not isinstance(spec, dict) or not spec.get("roots"):
            raise BackupError(f"manifest {p}: category {name!r} needs 'roots' (absolute paths)")
        unknown = set(spec) - _CATEGORY_KEYS
        if unknown:
            raise BackupError(f"manifest {p}: category {name!r}: unknown keys {sorted(unknown)}")
        roots = [spec["roots"]] if isinstance(spec["roots"], str) else list(spec["roots"])
        for root in roots:
            if not str(root).startswith("/"):
                raise BackupError(f"manifest {p}: category {name!r}: root {root!r} is not absolute")
        try:
            max_size = parse_size(spec.get("max_size"))
        except ValueError as exc:
            raise BackupError(f"manifest {p}: category {name!r}: {exc}") from exc
        cats.append(
            Category(
                name=str(name),
                roots=tuple(os.path.normpath(str(r)) for r in roots),
                include=tuple(spec.get("include") or ("**",)),
                exclude=tuple(spec.get("exclude") or ()),
                max_size=max_size,
                s3=bool(spec.get("s3", False)),
            )
        )
    try:
        selection = parse_selection(doc.get("stop") or {})
    except ValueError as exc:
        raise BackupError(f"manifest {p}: stop: {exc}") from exc
    unknown = set(doc) - {"name", "description", "version", "stop", "categories", *_OPTION_KEYS}
    if unknown:
        raise BackupError(f"manifest {p}: unknown top-level keys {sorted(unknown)}")
    return Manifest(
        options={k: doc[k] for k in _OPTION_KEYS if k in doc},
        name=str(doc.get("name", p.stem)),
        categories=tuple(cats),
        stop=selection,
        path=str(p),
        description=str(doc.get("description", "")),
    )


# ---------------------------------------------------------------- listing and state


def _unname(item: dict[str, Any], key: str = "p", bkey: str = "pb") -> bytes:
    if bkey in item:
        return base64.b64decode(item[bkey])
    return str(item[key]).encode("utf-8")


def _wire_name(raw: bytes) -> dict[str, str]:
    try:
        return {"p": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"pb": base64.b64encode(raw).decode("ascii")}


@dataclass(frozen=True)
class RemoteFile:
    """One file or symlink on the node, as listed by backup_walk."""

    category: str
    path: bytes  # absolute path on the node, raw bytes
    kind: str  # "f" regular file, "l" symlink
    size: int
    mtime_ns: int
    mode: int
    link: bytes | None = None

    @cached_property
    def key(self) -> str:
        """Path inside the backup directory (str with surrogateescape for non-UTF-8 bytes)."""
        rel = self.path.lstrip(b"/")
        parts = rel.split(b"/")
        if not rel or any(part in (b"", b".", b"..") for part in parts):
            raise BackupError(f"refusing unsafe node path {self.path!r}")
        return self.category + "/" + os.fsdecode(rel)

    @property
    def display(self) -> str:
        return self.path.decode("utf-8", "backslashreplace")


@dataclass
class Listing:
    """What the node holds for each category (one backup_walk round trip)."""

    files: list[RemoteFile]
    skipped: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    duration: float

    def totals(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for f in self.files:
            t = out.setdefault(f.category, {"files": 0, "links": 0, "bytes": 0})
            if f.kind == "l":
                t["links"] += 1
            else:
                t["files"] += 1
                t["bytes"] += f.size
        return out


class StateFile:
    """A JSON map plus an append-only journal, so that every verified item survives a crash."""

    def __init__(self, directory: Path, name: str) -> None:
        self.path = directory / f"{name}.json"
        self.journal = directory / f"{name}.journal.jsonl"
        self.items: dict[str, dict[str, Any]] = {}
        self._fh: IO[str] | None = None
        self._last_flush = 0.0
        self._load()

    def _load(self) -> None:
        if self.path.exists():
            self.items = json.loads(self.path.read_text()).get("items", {})
        if self.journal.exists():
            for line in self.journal.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a killed run
                if rec.get("del"):
                    self.items.pop(rec["k"], None)
                else:
                    self.items[rec["k"]] = rec["v"]

    def record(self, key: str, value: dict[str, Any]) -> None:
        self.items[key] = value
        self._append({"k": key, "v": value})

    def forget(self, key: str) -> None:
        if self.items.pop(key, None) is not None:
            self._append({"k": key, "del": True})

    def _append(self, rec: dict[str, Any]) -> None:
        if self._fh is None:
            self._fh = open(self.journal, "a")  # noqa: SIM115 - closed in compact()
        self._fh.write(json.dumps(rec) + "\n")
        now = time.monotonic()
        if now - self._last_flush > 0.2:
            self._fh.flush()
            self._last_flush = now

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def compact(self) -> None:
        """Fold the journal into the map file (atomically) and start a new journal."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if not self.journal.exists() and self.path.exists():
            return  # nothing recorded since the last compaction
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": 1, "items": self.items}))
        os.replace(tmp, self.path)
        self.journal.unlink(missing_ok=True)


# ---------------------------------------------------------------- plan


@dataclass
class BackupPlan:
    """What a backup run will do: copy, relink, re-hash on the node, or leave alone."""

    listing: Listing
    copy: list[RemoteFile] = field(default_factory=list)
    links: list[RemoteFile] = field(default_factory=list)
    rehash: list[RemoteFile] = field(default_factory=list)
    current: list[RemoteFile] = field(default_factory=list)

    @property
    def copy_bytes(self) -> int:
        return sum(f.size for f in self.copy) + sum(f.size for f in self.rehash)

    def summary(self) -> str:
        return (
            f"{len(self.copy)} files ({self.copy_bytes / 1e6:.1f} MB) to copy, {len(self.links)} links to make, "
            f"{len(self.rehash)} to compare by node hash, {len(self.current)} up to date"
        )


@dataclass
class Progress:
    """A progress sample of a transfer."""

    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    elapsed: float
    what: str = "backup"

    @property
    def rate(self) -> float:
        return self.bytes_done / self.elapsed if self.elapsed > 0 else 0.0

    def line(self) -> str:
        return (
            f"{self.what}: {self.files_done}/{self.files_total} files, "
            f"{self.bytes_done / 1e6:.1f}/{self.bytes_total / 1e6:.1f} MB, {self.rate / 1e6:.1f} MB/s"
        )


@dataclass
class TransferResult:
    """What one backup run did."""

    copied_files: int = 0
    copied_bytes: int = 0
    links: int = 0
    rehashed_same: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    duration: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed and self.error is None


def sender_argv(stall_timeout: float = 120.0, python: str = "python3") -> list[str]:
    """Return the argv that runs the bulk sender on the node (python3 -c <probe source>)."""
    source = PROBE_SOURCE.read_text() + "\n_bk_send_main()\n"
    return ["env", f"GPUHOST_SEND_STALL={int(stall_timeout)}", python, "-c", source]


class _ChannelIO:
    """Adapt a raw channel (paramiko Channel, Popen, or file pair) to read/write/close."""

    def __init__(self, chan: Any, stall_timeout: float = 60.0) -> None:
        self.chan = chan
        if hasattr(chan, "recv") and hasattr(chan, "close_stdin"):  # pytest_gpuhost.exec.transport.RawChannel

            def recv(n: int) -> bytes:
                return bytes(chan.recv(stall_timeout))  # TimeoutError (an OSError) when stalled

            self._read = recv
            self._write = chan.send
        elif hasattr(chan, "recv") and hasattr(chan, "sendall"):
            self._read = chan.recv
            self._write = chan.sendall
        elif hasattr(chan, "stdout") and hasattr(chan, "stdin") and chan.stdout is not None:
            out = chan.stdout
            self._read = getattr(out, "read1", out.read)
            inp = chan.stdin

            def write(data: bytes) -> None:
                inp.write(data)
                inp.flush()

            self._write = write
        else:
            self._read = getattr(chan, "read1", chan.read)
            self._write = chan.write

    def read(self, n: int) -> bytes:
        return bytes(self._read(n))

    def write(self, data: bytes) -> None:
        self._write(data)

    def close(self) -> None:
        for name in ("close", "kill"):
            fn = getattr(self.chan, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - closing a dead channel is best effort
                    pass
                return


class _StreamReader:
    """Buffered exact reads from a channel, with a stall watchdog that closes a dead channel."""

    def __init__(self, io: _ChannelIO, stall_timeout: float) -> None:
        self.io = io
        self.buf = bytearray()
        self.last = time.monotonic()
        self.stalled = False
        self.done = threading.Event()
        self.received = 0
        self._watch = threading.Thread(target=self._watchdog, args=(stall_timeout,), daemon=True)
        self._watch.start()

    def _watchdog(self, limit: float) -> None:
        while not self.done.wait(min(1.0, limit / 4)):
            if time.monotonic() - self.last > limit:
                self.stalled = True
                self.io.close()
                return

    def _fill(self, want: int) -> None:
        while len(self.buf) < want:
            block = self.io.read(max(1 << 20, want - len(self.buf)))
            if not block:
                raise EOFError("stalled" if self.stalled else "stream ended")
            self.last = time.monotonic()
            self.received += len(block)
            self.buf += block

    def exact(self, n: int) -> bytes:
        if len(self.buf) < n:
            self._fill(n)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def u32(self) -> int:
        return int(_U32.unpack(self.exact(4))[0])

    def pipe(self, n: int, sinks: Sequence[Callable[[bytes], Any]]) -> None:
        """Pass the next n bytes to each sink in pieces, without joining or copying them twice."""
        while n:
            if self.buf:
                take = min(n, len(self.buf))
                piece = bytes(self.buf[:take])
                del self.buf[:take]
            else:
                block = self.io.read(1 << 20)
                if not block:
                    raise EOFError("stalled" if self.stalled else "stream ended")
                self.last = time.monotonic()
                self.received += len(block)
                if len(block) <= n:
                    piece, take = block, len(block)  # the common case for big files: no copy
                else:
                    piece, take = block[:n], n
                    self.buf += memoryview(block)[n:]
            for sink in sinks:
                sink(piece)
            n -= take


# ---------------------------------------------------------------- the backup


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
        self.meta = self.dest / _META
        self.progress = progress
        self.progress_interval = progress_interval
        self.stall_timeout = stall_timeout
        self.meta.mkdir(parents=True, exist_ok=True)
        self.state = StateFile(self.meta, "state")
        self._dirs_ok: set[str] = set()
        self._mkdir_lock = threading.Lock()
        # called with (file, state record) for each file or link verified into place: the S3
        # side uses it to upload while the transfer runs
        self.on_placed: Callable[[RemoteFile, dict[str, Any]], None] | None = None
        # files plan() found verified and unchanged, with the state record it saw: verify() can
        # trust its own stat from moments ago instead of stat-ing them all again
        self._seen_current: dict[str, tuple[dict[str, Any], int, int]] = {}

    # -- listing

    def walk(self) -> Listing:
        """List every category on the node in one round trip."""
        res = self.conn.call(
            "backup_walk", categories=[c.wire() for c in self.manifest.categories], timeout=self.op_timeout
        )
        return self.listing_from(res)

    def listing_from(self, res: dict[str, Any]) -> Listing:
        """Turn a backup_walk result (e.g. from a batch) into a Listing."""
        files: list[RemoteFile] = []
        skipped: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for cat in self.manifest.categories:
            part = res["categories"].get(cat.name, {})
            for e in part.get("entries", []):
                link = None
                if e["t"] == "l":
                    link = base64.b64decode(e["lb"]) if "lb" in e else str(e["l"]).encode("utf-8")
                files.append(
                    RemoteFile(cat.name, _unname(e), e["t"], int(e["s"]), int(e["m"]), int(e["o"]), link)
                )
            for s in part.get("skipped", []):
                skipped.append(
                    {
                        "category": cat.name,
                        "path": _unname(s).decode("utf-8", "backslashreplace"),
                        "size": s.get("s"),
                        "why": s.get("why"),
                    }
                )
            for err in part.get("errors", []):
                errors.append(
                    {
                        "category": cat.name,
                        "path": _unname(err).decode("utf-8", "backslashreplace"),
                        "errno": err.get("errno"),
                        "error": err.get("error"),
                    }
                )
        seen: set[str] = set()
        unique = []
        for f in files:  # a path listed by two categories is kept in each; within one, once
            if f.key not in seen:
                seen.add(f.key)
                unique.append(f)
        return Listing(unique, skipped, errors, float(res.get("duration", 0.0)))

    # -- plan

    def _local(self, f: RemoteFile) -> Path:
        return self.dest / f.key

    def plan(self, listing: Listing) -> BackupPlan:
        """Compare the node's listing with the verified state and what is on disk here."""
        plan = BackupPlan(listing)
        for f in listing.files:
            local = self._local(f)
            rec = self.state.items.get(f.key)
            try:
                lst = os.lstat(local)
            except OSError:
                lst = None
            if f.kind == "l":
                if (
                    lst is not None
                    and stat.S_ISLNK(lst.st_mode)
                    and os.fsencode(os.readlink(local)) == f.link
                ):
                    if rec is None or rec.get("t") != "l":
                        self.state.record(f.key, self._link_record(f))
                    plan.current.append(f)
                else:
                    plan.links.append(f)
                continue
            local_ok = lst is not None and stat.S_ISREG(lst.st_mode) and lst.st_size == f.size
            if rec is None or rec.get("t") != "f" or not local_ok or rec["s"] != f.size:
                plan.copy.append(f)
            elif rec["m"] == f.mtime_ns and lst is not None and lst.st_mtime_ns == f.mtime_ns:
                plan.current.append(f)
                self._seen_current[f.key] = (rec, f.size, f.mtime_ns)
            else:
                plan.rehash.append(f)  # same size, mtime moved: the node's hash decides
        return plan

    @staticmethod
    def _link_record(f: RemoteFile) -> dict[str, Any]:
        target = f.link or b""
        return {
            "t": "l",
            "s": len(target),
            "m": f.mtime_ns,
            "sha256": hashlib.sha256(target).hexdigest(),
            **{("l" if k == "p" else "lb"): v for k, v in _wire_name(target).items()},
        }

    # -- run

    def run(self, plan: BackupPlan) -> TransferResult:
        """Carry out a plan: links, node-side hash comparisons, then one bulk stream of contents."""
        result = TransferResult()
        started = time.monotonic()
        lock = open(self.meta / "lock", "w")  # noqa: SIM115 - held for the whole run
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise BackupError(f"another backup is writing {self.dest}") from exc
            self._clean_tmp()
            for f in plan.links:
                self._make_link(f, result)
            copy = list(plan.copy)
            if plan.rehash:
                copy += self._rehash(plan.rehash, result)
            if copy:
                self._transfer(copy, result)
        finally:
            self.state.flush()
            result.duration = time.monotonic() - started
            lock.close()
        return result

    def _clean_tmp(self) -> None:
        tmp = self.meta / "tmp"
        tmp.mkdir(exist_ok=True)
        for leftover in tmp.iterdir():
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover)  # a writer thread's directory (see _transfer)
            else:
                leftover.unlink()

    def _parent(self, path: Path) -> None:
        """Create the parent directories of path inside dest, refusing any symlink on the way."""
        parent = path.parent
        key = str(parent)
        if key in self._dirs_ok:
            return
        rel = parent.relative_to(self.dest)
        cur = self.dest
        for part in rel.parts:
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
                with self._mkdir_lock:
                    st = os.lstat(cur)
                    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                        os.unlink(cur)
                        os.mkdir(cur)
        self._dirs_ok.add(key)

    def _make_link(self, f: RemoteFile, result: TransferResult) -> None:
        local = self._local(f)
        self._parent(local)
        tmp = self.meta / "tmp" / f"link-{os.getpid()}"
        try:
            os.symlink(os.fsdecode(f.link or b""), tmp)
            if local.is_dir() and not local.is_symlink():
                result.failed.append((f.display, "a directory is in the way of the link"))
                os.unlink(tmp)
                return
            os.replace(tmp, local)
        except OSError as exc:
            result.failed.append((f.display, f"link: {exc.strerror}"))
            return
        rec = self._link_record(f)
        self.state.record(f.key, rec)
        self._placed(f, rec)
        result.links += 1

    def _placed(self, f: RemoteFile, rec: dict[str, Any]) -> None:
        if self.on_placed is not None:
            self.on_placed(f, rec)

    def _rehash(self, files: list[RemoteFile], result: TransferResult) -> list[RemoteFile]:
        """Hash files on the node; those whose hash still matches only get their mtime updated."""
        hashes = self.conn.call(
            "backup_hash", paths=[_wire_name(f.path) for f in files], timeout=self.op_timeout
        )
        changed = []
        for f, h in zip(files, hashes, strict=True):
            rec = self.state.items.get(f.key, {})
            if "sha256" in h and h["sha256"] == rec.get("sha256") and h["s"] == f.size:
                local = self._local(f)
                os.utime(local, ns=(f.mtime_ns, f.mtime_ns), follow_symlinks=False)
                self.state.record(f.key, dict(rec, m=f.mtime_ns))
                result.rehashed_same += 1
            else:
                changed.append(f)
        return changed

    def _store(
        self, f: RemoteFile, tmp: Path, trailer: tuple[Any, ...], digest: bytes, fd: int
    ) -> str | None:
        """Check the digests, set mode and mtime, rename into place; return why not, or None."""
        err, size, mtime_ns, mode, changed, node_sha = trailer
        try:
            if err:
                return os.strerror(err)
            if digest != node_sha:
                return "SHA-256 on arrival differs from the node's"
            os.fchmod(fd, mode & 0o777 | 0o200)
            # the mtime seen when the node opened the file: if it was being written meanwhile,
            # the next run sees a different mtime and copies it again
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)
        final = self._local(f)
        self._parent(final)
        os.replace(tmp, final)
        rec = {"t": "f", "s": size, "m": mtime_ns if not changed else -1, "o": mode, "sha256": node_sha.hex()}
        with self._mkdir_lock:
            self.state.record(f.key, rec)
        self._placed(f, rec)
        return None

    def _write_small(
        self, f: RemoteFile, tmp: Path, pieces: list[bytes], trailer: tuple[Any, ...]
    ) -> str | None:
        """Hash, write and place one small file (runs in a writer thread, off the stream)."""
        data = b"".join(pieces)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        placed = False
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            why = self._store(f, tmp, trailer, hashlib.sha256(data).digest(), fd)
            placed = why is None
            return why
        finally:
            if not placed:
                tmp.unlink(missing_ok=True)

    def _transfer(self, files: list[RemoteFile], result: TransferResult) -> None:
        """Stream the files' contents over one channel; small files are written by writer threads."""
        total_bytes = sum(f.size for f in files)
        python = str(getattr(getattr(self.conn, "opts", None), "python", "python3"))
        argv = sender_argv(max(self.stall_timeout * 2, 30), python)
        chan = _ChannelIO(self.conn.open_channel(argv), self.stall_timeout)
        reader = _StreamReader(chan, self.stall_timeout)
        started = time.monotonic()
        last_report = started
        done = [0, 0]  # files, bytes placed
        lock = threading.Lock()
        tmpdir = self.meta / "tmp"
        tmp_path: Path | None = None
        # Writer threads (4 by default) create the small files, off the stream.  Creating a file costs this machine's ext4 about
        # 0.5 ms of kernel time, and creates in one directory serialise on its lock, so each
        # writer makes its temporary files in a directory of its own (measured, 5,000 files:
        # one writer 600 us a file, two writers in separate directories 190, in one directory 520).
        pool = ThreadPoolExecutor(max_workers=self.writers, thread_name_prefix="backup-write")
        local = threading.local()

        def writer_dir() -> Path:
            d: Path | None = getattr(local, "dir", None)
            if d is None:
                d = local.dir = tmpdir / f"w{threading.get_ident()}"
                d.mkdir(exist_ok=True)
            return d

        inflight = threading.BoundedSemaphore(64)  # at most 64 small files (<= 256 MiB) in memory

        def placed(f: RemoteFile, why: str | None) -> None:
            with lock:
                if why is None:
                    done[0] += 1
                    done[1] += f.size
                else:
                    result.failed.append((f.display, why))

        def small_job(f: RemoteFile, index: int, pieces: list[bytes], trailer: tuple[Any, ...]) -> None:
            try:
                why = self._write_small(f, writer_dir() / f"{index}.part", pieces, trailer)
            except OSError as exc:
                why = f"writing the copy: {exc.strerror}"
            finally:
                inflight.release()
            placed(f, why)

        def report() -> None:
            if self.progress is not None:
                with lock:
                    files_done, bytes_done = done
                self.progress(
                    Progress(files_done, len(files), bytes_done, total_bytes, time.monotonic() - started)
                )

        try:
            req = [b"GHB1"]
            for f in files:
                req.append(_U32.pack(len(f.path)))
                req.append(f.path)
            req.append(_U32.pack(0))
            # the request goes from a thread: a long list must not deadlock against a full pipe
            sender = threading.Thread(target=chan.write, args=(b"".join(req),), daemon=True)
            sender.start()
            if reader.exact(4) != b"GHB1":
                raise BackupError("bulk sender did not start (is python3 on the node?)")
            while True:
                index = reader.u32()
                if index == _END:
                    reader.u32()
                    break
                if index >= len(files):
                    raise BackupError(f"bulk stream out of step (file index {index})")
                f = files[index]
                if f.size <= _SMALL:
                    pieces: list[bytes] = []
                    while n := reader.u32():
                        reader.pipe(n, (pieces.append,))
                    trailer = _TRAILER.unpack(reader.exact(_TRAILER.size))
                    if not inflight.acquire(timeout=self.stall_timeout):
                        raise BackupError(f"local writes stalled for {self.stall_timeout:.0f} s")
                    pool.submit(small_job, f, index, pieces, trailer)
                else:
                    tmp_path = tmpdir / f"{index}.part"
                    digest = hashlib.sha256()
                    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                    try:

                        def write(piece: bytes, fd: int = fd) -> None:
                            view = memoryview(piece)
                            while view:
                                view = view[os.write(fd, view) :]

                        while n := reader.u32():
                            reader.pipe(n, (digest.update, write))
                        trailer = _TRAILER.unpack(reader.exact(_TRAILER.size))
                    except BaseException:
                        os.close(fd)
                        raise
                    why = self._store(f, tmp_path, trailer, digest.digest(), fd)
                    if why is not None:
                        tmp_path.unlink(missing_ok=True)
                    tmp_path = None
                    placed(f, why)
                now = time.monotonic()
                if now - last_report >= self.progress_interval:
                    last_report = now
                    report()
        except (EOFError, OSError, struct.error) as exc:
            why = (
                f"no data for {self.stall_timeout:.0f} s"
                if reader.stalled
                else str(exc) or type(exc).__name__
            )
            result.error = f"transfer interrupted after {done[0]}/{len(files)} files: {why}"
        finally:
            reader.done.set()
            chan.close()
            # files that arrived whole are still written and verified; then nothing is in flight
            pool.shutdown(wait=True)
            if tmp_path is not None:
                tmp_path.unlink(missing_ok=True)
            for d in tmpdir.glob("w*"):
                try:
                    d.rmdir()  # empty once every write finished or was cleaned up
                except OSError:
                    pass
            self.state.flush()
            result.copied_files += done[0]
            result.copied_bytes += done[1]
            if result.error is None:
                report()

    # -- verification and outputs

    def verify(self, listing: Listing, *, rehash_local: bool = False) -> list[tuple[str, str]]:
        """List (node path, why) for every listed file that is not verified in the backup."""
        missing: list[tuple[str, str]] = []
        for f in listing.files:
            rec = self.state.items.get(f.key)
            local = self._local(f)
            if rec is None:
                missing.append((f.display, "never copied"))
                continue
            seen = self._seen_current.get(f.key)
            if not rehash_local and seen is not None and seen == (rec, f.size, f.mtime_ns):
                continue
            try:
                lst = os.lstat(local)
            except OSError:
                missing.append((f.display, "missing in the backup directory"))
                continue
            if f.kind == "l":
                if not stat.S_ISLNK(lst.st_mode) or os.fsencode(os.readlink(local)) != f.link:
                    missing.append((f.display, "link differs"))
                continue
            if rec.get("s") != f.size or rec.get("m") != f.mtime_ns:
                missing.append((f.display, "changed on the node since it was copied"))
            elif not stat.S_ISREG(lst.st_mode) or lst.st_size != f.size or lst.st_mtime_ns != f.mtime_ns:
                missing.append((f.display, "local copy altered"))
            elif rehash_local and _sha256_file(local) != rec.get("sha256"):
                missing.append((f.display, "local copy corrupt (SHA-256)"))
        return missing

    def write_checksums(self, listing: Listing) -> Path:
        """Write DEST/SHA256SUMS (sha256sum -c compatible, node hashes) for the listed files."""
        out = self.dest / "SHA256SUMS"
        lines = []
        for f in sorted(listing.files, key=lambda f: f.key):
            rec = self.state.items.get(f.key)
            if rec is None or f.kind != "f" or "sha256" not in rec:
                continue
            name = os.fsencode(f.key)
            if b"\\" in name or b"\n" in name or b"\r" in name:
                esc = name.replace(b"\\", b"\\\\").replace(b"\n", b"\\n").replace(b"\r", b"\\r")
                lines.append(b"\\" + rec["sha256"].encode() + b"  " + esc + b"\n")
            else:
                lines.append(rec["sha256"].encode() + b"  " + name + b"\n")
        tmp = out.with_name(".SHA256SUMS.tmp")
        tmp.write_bytes(b"".join(lines))
        os.replace(tmp, out)
        return out

    def finish(self) -> None:
        self.state.compact()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def stderr_progress(p: Progress) -> None:
    """Progress sink that writes one line to stderr."""
    sys.stderr.write(p.line() + "\n")
    sys.stderr.flush()


def iter_categories(manifest: Manifest, names: Iterable[str]) -> list[Category]:
    """Return the manifest's categories with these names (for S3: those marked s3)."""
    wanted = set(names)
    return [c for c in manifest.categories if c.name in wanted]

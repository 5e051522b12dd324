"""Backup bookkeeping: the verified-state journal, plans, progress samples and run results."""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pytest_gpuhost.modules.backup.listing import Listing, RemoteFile

__all__ = [
    "BackupPlan",
    "Progress",
    "Records",
    "StateFile",
    "TransferResult",
    "pack",
    "stderr_progress",
    "unpack",
]


_I64 = (-(1 << 63), 1 << 63)
# (keys, kinds) -> _shape(): one per shape of record, shared by every record of it
_SHAPES: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple[Any, ...]] = {}
_INT, _HEX, _ANY = 0, 1, 2  # how a field is held: packed int64, SHA-256 hex as 32 bytes, as is


def _is_hex64(v: str) -> bool:
    if len(v) != 64:
        return False
    try:
        return bytes.fromhex(v).hex() == v
    except ValueError:
        return False


def pack(rec: dict[str, Any]) -> tuple[Any, ...]:
    """Hold a record compactly: its int fields packed into one bytes, a SHA-256 hex as 32 bytes.

    A record as a dict costs about 700 bytes (the dict, ten int objects, a 64-character hex
    string); packed, about 250. unpack() gives back an equal dict, the same keys in the same order.
    """
    kinds: list[int] = []
    ints: list[int] = []
    rest: list[Any] = []
    for k, v in rec.items():
        if type(v) is int and _I64[0] <= v < _I64[1]:
            kinds.append(_INT)
            ints.append(v)
        elif k == "sha256" and type(v) is str and _is_hex64(v):
            kinds.append(_HEX)
            rest.append(bytes.fromhex(v))
        else:
            kinds.append(_ANY)
            rest.append(v)
    sig = (tuple(rec), tuple(kinds))
    shape = _SHAPES.get(sig)
    if shape is None:
        shape = _SHAPES.setdefault(sig, _shape(sig[0], sig[1], len(ints)))
    return (shape, shape[0].pack(*ints), *rest)


def _shape(keys: tuple[str, ...], kinds: tuple[int, ...], n_ints: int) -> tuple[Any, ...]:
    """(Struct of the ints, keys, where each key's value lies in ints + rest, the hex keys)."""
    where, i, r = [], 0, n_ints
    for kind in kinds:
        if kind == _INT:
            where.append(i)
            i += 1
        else:
            where.append(r)
            r += 1
    hexes = tuple(k for k, kind in zip(keys, kinds, strict=True) if kind == _HEX)
    return (struct.Struct(f"<{n_ints}q"), keys, tuple(where), hexes)


def unpack(held: tuple[Any, ...], at: int = 0) -> dict[str, Any]:
    """The record as a dict again; `at`: where pack()'s tuple starts in held."""
    st, keys, where, hexes = held[at]
    values = st.unpack(held[at + 1]) + held[at + 2 :]
    out = dict(zip(keys, [values[w] for w in where], strict=True))
    for k in hexes:
        out[k] = out[k].hex()
    return out


class Records(MutableMapping[str, dict[str, Any]]):
    """The verified state's items, each held packed (see pack); read as dicts.

    A dict read from it is a copy: a change is kept only through `state[key] = record`. Each
    held record starts with its own key, so a listing can share that string (own_key) instead
    of holding an equal one of its own.
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[Any, ...]] = {}

    def __getitem__(self, key: str) -> dict[str, Any]:
        return unpack(self._held[key], 1)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        held = self._held.get(key)
        return default if held is None else unpack(held, 1)

    def held(self, key: str) -> tuple[Any, ...] | None:
        """The packed record itself: the same object until the record is replaced or removed."""
        return self._held.get(key)

    def own_key(self, key: str) -> str | None:
        """The key string this map holds for `key` (equal to it), or None."""
        held = self._held.get(key)
        return None if held is None else held[0]

    def __setitem__(self, key: str, value: dict[str, Any]) -> None:
        self._held[key] = (key, *pack(value))

    def __delitem__(self, key: str) -> None:
        del self._held[key]

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def pop(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        held = self._held.pop(key, None)
        return default if held is None else unpack(held, 1)


class StateFile:
    """A map file plus an append-only journal, so that every verified item survives a crash.

    Both are read a line at a time and the items are held packed (Records), so a state of a
    million files never sits in memory as JSON text or as a million dicts. The map file is JSON
    lines, a header `{"version": 2}` then one `{"k": key, "v": record}` per item; a version 1
    file (one JSON object) is still read.
    """

    def __init__(self, directory: Path, name: str) -> None:
        self.path = directory / f"{name}.json"
        self.journal = directory / f"{name}.journal.jsonl"
        self._items: Records | None = None
        self._fh: IO[str] | None = None
        self._last_flush = 0.0
        self._append_lock = threading.Lock()  # records come from several upload threads

    @property
    def items(self) -> Records:
        """The verified items, read from disk on first use: a backup lists the node first, so the
        listing's reply and a large state are never both in memory at their largest."""
        if self._items is None:
            with self._append_lock:
                if self._items is None:
                    self._items = self._load()
        return self._items

    def _load(self) -> Records:
        self._items = items = Records()
        try:
            self._read()
        except BaseException:
            self._items = None
            raise
        return items

    def _read(self) -> None:
        if self.path.exists():
            with open(self.path, "rb") as f:
                head = f.readline()
                try:
                    first = json.loads(head)
                except ValueError:
                    first = None
                if isinstance(first, dict) and first.get("version") == 2 and "items" not in first:
                    for line in f:
                        rec = json.loads(line)
                        self.items[rec["k"]] = rec["v"]
                else:  # version 1: one JSON object
                    old = json.loads(head + f.read()).get("items", {})
                    for k in list(old):
                        self.items[k] = old.pop(k)
        if self.journal.exists():
            self._replay()

    def _replay(self) -> None:
        size = self.journal.stat().st_size
        with open(self.journal, "rb") as f:
            good = 0  # bytes up to the end of the last whole line
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a run cut mid-line: a torn tail, dropped below
                good += len(line)
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn line from a killed run
                if rec.get("del"):
                    self.items.pop(rec["k"], None)
                else:
                    self.items[rec["k"]] = rec["v"]
        if good != size:
            # drop the torn tail, or the next record appended would be glued onto it and lost on
            # replay (a delete among them: a forgotten item back)
            with open(self.journal, "r+b") as f:
                f.truncate(good)

    @staticmethod
    def peek(directory: Path, name: str) -> Records:
        """The items of a state without opening it for writing ({} when there is none)."""
        if not (directory / f"{name}.json").exists() and not (directory / f"{name}.journal.jsonl").exists():
            return Records()
        return StateFile(directory, name).items

    def record(self, key: str, value: dict[str, Any]) -> None:
        self.items[key] = value
        self._append({"k": key, "v": value})

    def forget(self, key: str) -> None:
        if self.items.pop(key, None) is not None:
            self._append({"k": key, "del": True})

    def _append(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec) + "\n"
        with self._append_lock:
            if self._fh is None:
                # made on the first record, not before: a run that only reads (--check-only, or one
                # refused by its preflight) leaves no directory behind
                self.journal.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.journal, "a")  # noqa: SIM115 - closed in compact()
            self._fh.write(line)
            now = time.monotonic()
            if now - self._last_flush > 0.2:
                self._fh.flush()
                self._last_flush = now

    def flush(self) -> None:
        with self._append_lock:
            if self._fh is not None:
                self._fh.flush()

    def compact(self) -> None:
        """Fold the journal into the map file (atomically) and start a new journal."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if not self.journal.exists() and (self.path.exists() or not self.items):
            return  # nothing recorded since the last compaction (or ever)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:  # a line per item, written as it goes: never the whole text at once
            f.write('{"version": 2}\n')
            for k in self.items:
                f.write(json.dumps({"k": k, "v": self.items[k]}) + "\n")
        os.replace(tmp, self.path)
        self.journal.unlink(missing_ok=True)


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


def stderr_progress(p: Progress) -> None:
    """Progress sink that writes one line to stderr."""
    sys.stderr.write(p.line() + "\n")
    sys.stderr.flush()

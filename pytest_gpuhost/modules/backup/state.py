"""Backup bookkeeping: the verified-state journal, plans, progress samples and run results."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pytest_gpuhost.modules.backup.listing import Listing, RemoteFile

__all__ = ["BackupPlan", "Progress", "StateFile", "TransferResult", "stderr_progress"]


class StateFile:
    """A JSON map plus an append-only journal, so that every verified item survives a crash."""

    def __init__(self, directory: Path, name: str) -> None:
        self.path = directory / f"{name}.json"
        self.journal = directory / f"{name}.journal.jsonl"
        self.items: dict[str, dict[str, Any]] = {}
        self._fh: IO[str] | None = None
        self._last_flush = 0.0
        self._append_lock = threading.Lock()  # records come from several upload threads
        self._load()

    def _load(self) -> None:
        if self.path.exists():
            self.items = json.loads(self.path.read_text()).get("items", {})
        if self.journal.exists():
            text = self.journal.read_text()
            if text and not text.endswith("\n"):
                # a run cut mid-line: drop the torn tail, or the next record appended would be
                # glued onto it and lost on replay (a delete among them: a forgotten item back)
                keep = text.rfind("\n") + 1
                with open(self.journal, "r+") as f:
                    f.truncate(len(text[:keep].encode()))
                text = text[:keep]
            for line in text.splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line from a killed run
                if rec.get("del"):
                    self.items.pop(rec["k"], None)
                else:
                    self.items[rec["k"]] = rec["v"]

    @staticmethod
    def peek(directory: Path, name: str) -> dict[str, dict[str, Any]]:
        """The items of a state without opening it for writing ({} when there is none)."""
        if not (directory / f"{name}.json").exists() and not (directory / f"{name}.journal.jsonl").exists():
            return {}
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
        tmp.write_text(json.dumps({"version": 1, "items": self.items}))
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

"""The local writer's arrival check: a file takes its final name only when both SHA-256 digests agree."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pytest_gpuhost.modules.backup.listing import RemoteFile
from pytest_gpuhost.modules.backup.state import StateFile
from pytest_gpuhost.modules.backup.writer import LocalWriter


def _writer(tmp_path: Path) -> tuple[LocalWriter, list[str]]:
    dest, meta = tmp_path / "dest", tmp_path / "meta"
    dest.mkdir()
    meta.mkdir()
    placed: list[str] = []

    def on_placed(f: RemoteFile, rec: dict[str, Any]) -> None:
        placed.append(f.key)

    w = LocalWriter(dest, meta, StateFile(meta, "state"), on_placed)
    w.clean_tmp()
    return w, placed


def _store(
    tmp_path: Path, arrived: bytes, node_bytes: bytes
) -> tuple[str | None, LocalWriter, list[str], RemoteFile]:
    w, placed = _writer(tmp_path)
    f = RemoteFile("data", b"/data/shard-00001.arrow", "f", len(node_bytes), 1_700_000_000_000_000_000, 0o644)
    trailer = (0, len(node_bytes), f.mtime_ns, f.mode, False, hashlib.sha256(node_bytes).digest())
    why = w.write_small(f, w.tmp / "part", [arrived], trailer)
    return why, w, placed, f


def test_bytes_that_differ_from_the_nodes_never_take_the_final_name(tmp_path: Path) -> None:
    why, w, placed, f = _store(tmp_path, b"bytes that arrived bent", b"bytes the node hashed!!")
    assert why == "SHA-256 on arrival differs from the node's"
    assert not w.local(f).exists() and placed == [] and f.key not in w.state.items
    assert list(w.tmp.iterdir()) == []  # the temporary file is gone too


def test_bytes_that_match_are_placed_with_the_nodes_digest(tmp_path: Path) -> None:
    data = b"the same bytes on both ends"
    why, w, placed, f = _store(tmp_path, data, data)
    assert why is None and w.local(f).read_bytes() == data and placed == [f.key]
    assert w.state.items[f.key]["sha256"] == hashlib.sha256(data).hexdigest()

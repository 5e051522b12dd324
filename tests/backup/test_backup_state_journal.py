"""The verified-state journal replays a cut run's records, its deletes included.

A run cut after it forgot an item (the local copy was found altered, an upload it started was
aborted) leaves a journal with the record and, after it, the delete; the next run's replay must
end without the item, or the copy would count as verified again. Each case is a real cut: the
journal is written and flushed, the StateFile dropped without compact(), a new one loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from pytest_gpuhost.modules.backup.state import StateFile


def _cut(state: StateFile) -> None:
    """A run killed after its last flush: the journal stays, the map file is not rewritten."""
    state.flush()
    if state._fh is not None:
        state._fh.close()
        state._fh = None


def test_a_delete_after_a_cut_is_replayed(tmp_path: Path) -> None:
    s = StateFile(tmp_path, "state")
    s.record("data/a", {"sha256": "1" * 64, "s": 1})
    s.record("data/b", {"sha256": "2" * 64, "s": 2})
    s.compact()  # both in the map file
    s.forget("data/a")
    s.record("data/c", {"sha256": "3" * 64, "s": 3})
    _cut(s)
    again = StateFile(tmp_path, "state")
    assert set(again.items) == {"data/b", "data/c"}


def test_a_record_after_its_delete_wins_and_a_torn_line_is_dropped(tmp_path: Path) -> None:
    s = StateFile(tmp_path, "state")
    s.record("k", {"v": 1})
    s.forget("k")
    s.record("k", {"v": 2})
    s.forget("other-never-recorded")  # nothing to forget: nothing journalled
    _cut(s)
    with open(tmp_path / "state.journal.jsonl", "a") as f:
        f.write(json.dumps({"k": "k", "del": True})[:9])  # the cut tore the last line
    again = StateFile(tmp_path, "state")
    assert again.items == {"k": {"v": 2}}
    again.forget("k")
    _cut(again)
    assert StateFile(tmp_path, "state").items == {}

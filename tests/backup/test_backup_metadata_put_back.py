"""Changes that put size and mtime back still reach the backup: ctime and the inode decide.

`cp -p`, `tar -x`, `rsync -t` and `touch -r` change a file's bytes and set its mtime back; no
tool can set the ctime back (utimensat(2) sets only atime and mtime). Each case here passed as
"verified" with the old bytes when the quick checks read size and mtime only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_gpuhost.exec.agent.probe_backup import END, TRAILER, reader_thread, unpack_trailer
from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.backup.local import Backup, Category, Manifest
from pytest_gpuhost.modules.process import Selection

MiB = 1024 * 1024


def _put_back(path: Path, at: int, data: bytes) -> None:
    """Overwrite bytes in place, then set atime and mtime back as `touch -r` would."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


@pytest.fixture
def backed(tmp_path: Path):
    src = tmp_path / "node" / "data"
    src.mkdir(parents=True)
    (src / "completions.jsonl").write_bytes(b'{"id": 1, "text": "old"}\n' * 1000)
    (src / "shard.arrow").write_bytes(os.urandom(3 * MiB))
    conn = open_connection(parse_host_url("local://"))
    b = Backup(conn, Manifest("t", (Category("data", (str(src),)),), Selection()), tmp_path / "dest")
    listing = b.walk()
    assert b.run(b.plan(listing)).ok and b.verify(listing) == []
    yield b, src
    conn.close()


def test_a_node_file_changed_with_its_mtime_put_back_is_copied_again(backed) -> None:
    b, src = backed
    _put_back(src / "completions.jsonl", 13, b"new")
    listing = b.walk()
    plan = b.plan(listing)
    changed = [f.display for f in plan.rehash + plan.copy]
    assert changed == [str(src / "completions.jsonl")], plan.summary()
    assert b.run(plan).ok and b.verify(listing) == []
    local = b.dest / "data" / str(src).lstrip("/") / "completions.jsonl"
    assert local.read_bytes() == (src / "completions.jsonl").read_bytes()


def test_the_local_copy_altered_with_its_mtime_put_back_is_not_verified(backed) -> None:
    b, src = backed
    local = b.dest / "data" / str(src).lstrip("/") / "shard.arrow"
    _put_back(local, 100, b"\0" * 8)
    listing = b.walk()
    assert [(p, why) for p, why in b.verify(listing)] == [
        (str(src / "shard.arrow"), "local copy altered (SHA-256 differs from the node's)")
    ]
    plan = b.plan(listing)
    assert [f.display for f in plan.copy] == [str(src / "shard.arrow")]
    assert b.run(plan).ok and b.verify(listing) == []
    assert local.read_bytes() == (src / "shard.arrow").read_bytes()


def test_a_rewrite_during_the_read_with_mtime_put_back_is_reported_changed(tmp_path: Path) -> None:
    path = tmp_path / "shard.arrow"
    path.write_bytes(os.urandom(8 * MiB))
    out: list[bytes] = []
    rewritten = []

    def put(block: bytes | None) -> None:
        if block is not None:
            out.append(block)
        if not rewritten and sum(len(b) for b in out) >= MiB:  # the first MiB is on its way
            _put_back(path, 7 * MiB, os.urandom(MiB))
            rewritten.append(True)

    reader_thread([(os.fsencode(path), len(os.fsencode(tmp_path)))], put)
    stream = b"".join(out)
    assert stream[-8:-4] == END.to_bytes(4, "big")
    code, size, _mtime, _mode, changed, _sha = unpack_trailer(stream[-8 - TRAILER.size : -8])
    assert rewritten and code == 0 and size == 8 * MiB
    assert changed == 1, "a file that never existed on the node would be placed as verified"

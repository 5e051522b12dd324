"""No file can stop the others: any mtime, size or name the filesystem holds is carried.

The bulk sender's trailer carried the mtime as one i64 of nanoseconds (1677-2262); ext4 holds
mtimes to 2446 and before 1901, and a file with one (a clock or a tool gone wrong) made the
sender's struct.pack raise, its thread die and the whole category stall on every run. Each file
here sits beside ordinary ones, which must still arrive and verify on the first run, and a rerun
must find everything up to date (convergence).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from pytest_gpuhost.exec.agent.probe_backup import BAD_META, pack_trailer, unpack_trailer
from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.backup.local import Backup, Category, Manifest
from pytest_gpuhost.modules.process import Selection

SEC = 1_000_000_000
YEAR = 365 * 24 * 3600 * SEC
# mtimes ext4 holds (256-byte inodes: 1901-12-13 .. 2446-05-10) that one i64 of ns does not
ODD_MTIMES = {
    "year-2300": 330 * YEAR + 123,
    "year-2440": 470 * YEAR,
    "year-1901": -(68 * YEAR),  # fits i64 ns, but negative: carried as it is
    "one-ns-before-1970": -1,
    "epoch": 0,
}


@pytest.mark.parametrize(
    "mtime_ns", [0, -1, 2**63 - 1, -(2**63), 2**63, 10**20, -(10**20), 253402300799 * SEC + 999_999_999]
)
def test_the_trailer_carries_any_mtime(mtime_ns: int) -> None:
    data = pack_trailer(0, 5, mtime_ns, 0o644, 0, b"\1" * 32)
    assert unpack_trailer(data) == (0, 5, mtime_ns, 0o644, 0, b"\1" * 32)


def test_an_mtime_beyond_every_format_is_a_named_error_not_a_stall() -> None:
    with pytest.raises(struct.error):
        pack_trailer(0, 0, 2**64 * SEC, 0, 0, b"\0" * 32)
    assert unpack_trailer(pack_trailer(BAD_META, 0, 0, 0, 0, b"\0" * 32))[0] == BAD_META


@pytest.fixture
def node(tmp_path: Path):
    src = tmp_path / "node" / "data"
    src.mkdir(parents=True)
    for name, mtime in ODD_MTIMES.items():
        p = src / f"{name}.bin"
        p.write_bytes(name.encode() * 100)
        os.utime(p, ns=(mtime, mtime))
        if p.stat().st_mtime_ns != mtime:
            pytest.skip(f"this filesystem cannot hold {name}")
    for i in range(20):
        (src / f"plain-{i}.txt").write_bytes(os.urandom(1000 + i))
    (src / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    os.utime(src / "big.bin", ns=(ODD_MTIMES["year-2300"],) * 2)
    conn = open_connection(parse_host_url("local://"))
    b = Backup(conn, Manifest("t", (Category("data", (str(src),)),), Selection()), tmp_path / "dest")
    yield b, src
    conn.close()


def test_odd_mtimes_are_carried_and_the_rest_go_on(node) -> None:
    b, src = node
    listing = b.walk()
    assert len(listing.files) == len(ODD_MTIMES) + 21
    res = b.run(b.plan(listing))
    assert res.ok, (res.error, res.failed)
    assert b.verify(listing) == []
    for name, mtime in ODD_MTIMES.items():
        local = b.dest / "data" / str(src).lstrip("/") / f"{name}.bin"
        assert local.read_bytes() == (src / f"{name}.bin").read_bytes()
        assert local.stat().st_mtime_ns == mtime, name
    # converges: a rerun has nothing to copy or hash
    listing = b.walk()
    plan = b.plan(listing)
    assert not plan.copy and not plan.rehash, plan.summary()

"""The backup engine over a real local:// connection: the agent's ops and the bulk sender process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.backup.local import (
    Backup,
    BackupError,
    Category,
    Manifest,
    Progress,
    load_manifest,
)
from pytest_gpuhost.modules.process import Selection

HOSTILE = [
    b"space name.txt",
    b"quote'and\"double.txt",
    b"new\nline.txt",
    b"$(touch PWNED).sh",
    b"back\\slash.txt",
    b"latin1-\xe9\xff.bin",
    b"-dash-first",
    "unicode-\u00e9\u4e2d.txt".encode(),
]


@pytest.fixture
def conn():
    c = open_connection(parse_host_url("local://"))
    yield c
    c.close()


def make_tree(root: Path, small: int = 300, pad: int = 0) -> dict[bytes, bytes]:
    """Write a tree with many small files, two larger ones, hostile names and a link to /etc."""
    files: dict[bytes, bytes] = {}
    for i in range(small):
        files[f"many/d{i % 7}/f{i}.log".encode()] = (f"line {i}\n" * (i % 50)).encode() + os.urandom(pad)
    files[b"big/one.bin"] = os.urandom(3 * 1024 * 1024 + 17)
    files[b"big/two.bin"] = os.urandom(1024 * 1024)
    for name in HOSTILE:
        files[b"hostile/" + name] = b"content of " + name
    files[b"empty"] = b""
    for rel, data in files.items():
        path = os.fsencode(root) + b"/" + rel
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.symlink("/etc", os.fsencode(root) + b"/etc-link")
    os.symlink("../empty", os.fsencode(root) + b"/many/rel-link")
    os.mkfifo(os.fsencode(root) + b"/a-fifo")
    return files


def manifest_for(root: Path, **kw) -> Manifest:
    return Manifest("t", (Category("data", (str(root),), **kw),), Selection())


def local_path(dest: Path, root: Path, rel: bytes) -> bytes:
    return os.fsencode(dest) + b"/data" + os.fsencode(root) + b"/" + rel


def test_copies_verifies_and_keeps_links(conn, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    files = make_tree(src)
    seen: list[Progress] = []
    b = Backup(conn, manifest_for(src), dest, progress=seen.append, progress_interval=0)
    listing = b.walk()
    assert len([f for f in listing.files if f.kind == "f"]) == len(files)
    assert any("not a regular file" in s["why"] for s in listing.skipped)  # the fifo
    res = b.run(b.plan(listing))
    assert res.ok, res
    assert res.copied_files == len(files) and res.links == 2
    for rel, data in files.items():
        with open(local_path(dest, src, rel), "rb") as f:
            assert f.read() == data, rel
    link = local_path(dest, src, b"etc-link")
    assert os.path.islink(link) and os.readlink(link) == b"/etc"
    assert not (dest / "data" / "etc").exists()
    assert os.readlink(local_path(dest, src, b"many/rel-link")) == b"../empty"
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()
    assert b.verify(listing, rehash_local=True) == []
    assert seen and seen[-1].files_done == len(files)
    sums = b.write_checksums(listing)
    check = subprocess.run(["sha256sum", "--quiet", "-c", sums.name], cwd=dest, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # nothing left under a temporary name
    assert list((dest / ".gpuhost" / "tmp").iterdir()) == []


def test_rerun_copies_nothing_and_changes_are_copied(conn, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    make_tree(src, small=50)
    b = Backup(conn, manifest_for(src), dest)
    assert b.run(b.plan(b.walk())).ok
    b.finish()
    b = Backup(conn, manifest_for(src), dest)  # a new run reads the compacted state
    plan = b.plan(b.walk())
    assert not plan.copy and not plan.links and not plan.rehash
    # one file changed, one only touched (same bytes, new mtime): node hash decides
    (src / "many/d1/f1.log").write_bytes(b"changed on the node\n")
    os.utime(src / "big/two.bin", ns=(1, 1_000_000_000))
    plan = b.plan(b.walk())
    assert [f.display for f in plan.copy] == [str(src / "many/d1/f1.log")]
    assert [f.display for f in plan.rehash] == [str(src / "big/two.bin")]
    res = b.run(plan)
    assert res.ok and res.copied_files == 1 and res.rehashed_same == 1
    assert (dest / "data" / str(src).lstrip("/") / "many/d1/f1.log").read_bytes() == b"changed on the node\n"
    assert b.verify(b.walk()) == []


def test_interrupted_transfer_resumes(conn, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    files = make_tree(src, small=400, pad=32 * 1024)
    cuts = [2]

    class Cutter:
        """Close the bulk channel mid-stream (after 30 files of a run), as a cut link would."""

        def __init__(self, b: Backup) -> None:
            self.b = b
            self.done = False

        def __call__(self, p: Progress) -> None:
            if cuts[0] and not self.done and p.files_done >= 30:
                cuts[0] -= 1
                self.done = True
                for ch in getattr(self.b, "_channels", []):
                    ch.close()

    results = []
    for _ in range(3):
        b = Backup(conn, manifest_for(src), dest, progress_interval=0, stall_timeout=10)
        b.progress = Cutter(b)
        orig = conn.open_channel

        def opener(argv, _b=b, _orig=orig):
            ch = _orig(argv)
            _b._channels = [*getattr(_b, "_channels", []), ch]  # type: ignore[attr-defined]
            return ch

        conn.open_channel = opener
        try:
            results.append(b.run(b.plan(b.walk())))
        finally:
            del conn.open_channel
    assert results[0].error and results[1].error and results[2].ok, results
    copied = sum(r.copied_files for r in results)
    assert copied < len(files) + 50  # resumed: at most the files in flight were sent twice
    b = Backup(conn, manifest_for(src), dest)
    assert b.verify(b.walk(), rehash_local=True) == []
    assert list((dest / ".gpuhost" / "tmp").iterdir()) == []


def test_max_size_and_excludes(conn, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    make_tree(src, small=20)
    b = Backup(conn, manifest_for(src, exclude=("hostile/**", "many/d3/**"), max_size=2 * 1024 * 1024), dest)
    listing = b.walk()
    names = {f.display for f in listing.files}
    assert not any("/hostile/" in n or "/many/d3/" in n for n in names)
    assert [s["path"] for s in listing.skipped if "max_size" in s["why"]] == [str(src / "big/one.bin")]


def test_manifest_errors_name_the_key(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("categories:\n  logs: {roots: [relative/path]}\n")
    with pytest.raises(
        BackupError, match=r"categories\.logs\.roots: .relative/path. \(expected an absolute path\)"
    ):
        load_manifest(bad)
    bad.write_text("categories:\n  logs: {roots: [/x], colour: red}\n")
    with pytest.raises(BackupError, match="colour"):
        load_manifest(bad)
    bad.write_text("categories:\n  logs: {roots: [/x]}\nstop: {match: [{argv0: '('}]}\n")
    with pytest.raises(BackupError, match="argv0"):
        load_manifest(bad)
    m = load_manifest(Path(__file__).parents[2] / "fixtures/manifests/b200-node-backup.yaml")
    assert [c.name for c in m.categories if c.s3] == ["data", "other"]

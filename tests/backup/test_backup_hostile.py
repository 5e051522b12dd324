"""The backup under hostile conditions: nothing in scope is dropped silently, nothing outside is read.

Real local:// connections; where the agent must not be root, it runs as `nobody` through a
stand-in `sudo` (setpriv) on the target's PATH, so permissions apply to it as to any user.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest

from pytest_gpuhost.exec.agent.probe_backup_walk import glob_compile, glob_match
from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.backup.local import (
    Backup,
    Category,
    Manifest,
    ManifestError,
    load_manifest,
)
from pytest_gpuhost.modules.process import Selection

NOBODY = 65534


def manifest_for(root: Path | str, **kw) -> Manifest:
    return Manifest("t", (Category("data", (str(root),), **kw),), Selection())


@pytest.fixture
def conn():
    c = open_connection(parse_host_url("local://"))
    yield c
    c.close()


@pytest.fixture
def world_dir():
    """A directory outside root's private pytest tmp, so that `nobody` can reach it."""
    d = Path(tempfile.mkdtemp(prefix="gpuhost-hostile-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def nobody_conn(tmp_path):
    """A local:// connection whose agent (and bulk sender) runs as nobody, not root."""
    setpriv = shutil.which("setpriv")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or setpriv is None or python is None:
        pytest.skip("needs root, setpriv and a system python3 to run the agent as nobody")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sudo").write_text(
        f'#!/bin/sh\nshift 2\nexec {setpriv} --reuid={NOBODY} --regid={NOBODY} --clear-groups "$@"\n'
    )
    (bindir / "python3").symlink_to(python)
    (bindir / "sudo").chmod(0o755)
    c = open_connection(parse_host_url(f"local://?path={bindir}:/usr/bin:/bin&sudo=1"))
    assert c.run(["id", "-u"]).stdout.strip() == str(NOBODY)
    yield c
    c.close()


def test_unreadable_paths_are_items_and_excludes_drop_them(nobody_conn, world_dir, tmp_path):
    src = world_dir / "src"
    (src / "ok").mkdir(parents=True)
    (src / "ok" / "a.txt").write_bytes(b"a")
    (src / "secret").mkdir(mode=0o700)
    (src / "secret" / "s.txt").write_bytes(b"s")
    (src / "locked.txt").write_bytes(b"locked")
    (src / "locked.txt").chmod(0o600)
    for d in (src, src / "ok"):
        d.chmod(0o755)
    (src / "ok" / "a.txt").chmod(0o644)
    b = Backup(nobody_conn, manifest_for(src), tmp_path / "dest")
    listing = b.walk()
    res = b.run(b.plan(listing))
    assert res.error is None and res.copied_files == 1
    items = dict(b.verify(listing))
    assert set(items) == {str(src / "secret"), str(src / "locked.txt")}, items
    assert "Permission denied" in items[str(src / "secret")]
    assert (
        items[str(src / "locked.txt")] == "not copied: not read on the node: cannot open: permission denied"
    )
    # the operator drops them explicitly: then the backup is complete
    b = Backup(nobody_conn, manifest_for(src, exclude=("secret", "locked.txt")), tmp_path / "dest")
    listing = b.walk()
    assert b.run(b.plan(listing)).ok
    assert b.verify(listing) == []


def test_a_file_that_vanishes_after_the_listing_is_an_item_until_the_rerun(conn, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    (src / "stays.txt").write_bytes(b"stays")
    (src / "gone.txt").write_bytes(b"gone")
    b = Backup(conn, manifest_for(src), dest)
    listing = b.walk()
    (src / "gone.txt").unlink()  # after the listing, before the copy
    b.run(b.plan(listing))
    items = dict(b.verify(listing))
    assert items == {str(src / "gone.txt"): "not copied: not read on the node: vanished since the listing"}, (
        items
    )
    # the next listing does not hold it: nothing is owed for a file that is no longer there
    b = Backup(conn, manifest_for(src), dest)
    listing = b.walk()
    assert b.run(b.plan(listing)).ok
    assert b.verify(listing) == []


def test_directory_swapped_for_symlink_reads_nothing_outside(conn, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "hosts").write_bytes(b"mine\n")
    (src / "sub" / "big").write_bytes(b"x" * (5 << 20))
    (src / "file-then-link").write_bytes(b"f")
    (src / "file-then-fifo").write_bytes(b"f")
    (src / "stays.txt").write_bytes(b"stays")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "hosts").write_bytes(b"SECRET outside the tree\n")
    (outside / "big").write_bytes(b"S" * (5 << 20))
    b = Backup(conn, manifest_for(src), dest)
    listing = b.walk()
    plan = b.plan(listing)
    # after the listing: the directory becomes a link out of the tree, files change type
    os.rename(src / "sub", tmp_path / "sub-moved")
    os.symlink(outside, src / "sub")
    os.unlink(src / "file-then-link")
    os.symlink(outside / "hosts", src / "file-then-link")
    os.unlink(src / "file-then-fifo")
    os.mkfifo(src / "file-then-fifo")  # a reader that opened it without O_NONBLOCK would hang
    started = time.monotonic()
    res = b.run(plan)
    assert time.monotonic() - started < 30
    assert res.error is None
    failed = dict(res.failed)
    assert set(failed) == {str(src / p) for p in ("sub/hosts", "sub/big", "file-then-link", "file-then-fifo")}
    assert "changed type since the listing: a directory on its path" in failed[str(src / "sub/hosts")]
    assert "changed type since the listing: now a symlink" in failed[str(src / "file-then-link")]
    assert "no longer a regular file" in failed[str(src / "file-then-fifo")]
    # nothing from outside arrived anywhere in the backup
    for path in dest.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert b"SECRET" not in path.read_bytes() and not path.read_bytes().startswith(b"SS")
    assert (dest / "data" / str(src).lstrip("/") / "stays.txt").read_bytes() == b"stays"
    items = dict(b.verify(listing))
    assert set(items) == set(failed) and "changed type" in items[str(src / "sub/hosts")]
    # the next listing sees the link as a link (kept as such), never what it points to
    listing = b.walk()
    assert [f.kind for f in listing.files if f.display == str(src / "sub")] == ["l"]
    assert not any(f.display.startswith(str(src / "sub") + "/") for f in listing.files)
    # put things back: a rerun copies only what failed, and then everything is verified
    os.unlink(src / "sub")
    os.rename(tmp_path / "sub-moved", src / "sub")
    os.unlink(src / "file-then-link")
    os.unlink(src / "file-then-fifo")
    (src / "file-then-link").write_bytes(b"f")
    (src / "file-then-fifo").write_bytes(b"f")
    listing = b.walk()
    res = b.run(b.plan(listing))
    assert res.ok and res.copied_files == 4, res
    assert b.verify(listing, rehash_local=True) == []


def test_ancestors_of_a_root_are_followed_and_a_root_link_is_a_link(conn, tmp_path):
    real = tmp_path / "real"
    (real / "data").mkdir(parents=True)
    (real / "data" / "x.txt").write_bytes(b"x")
    os.symlink(real, tmp_path / "via")  # the operator's path to the data goes through a link
    os.symlink(real / "data", tmp_path / "root-link")
    m = Manifest(
        "t",
        (Category("a", (str(tmp_path / "via" / "data"),)), Category("b", (str(tmp_path / "root-link"),))),
        Selection(),
    )
    b = Backup(conn, m, tmp_path / "dest")
    listing = b.walk()
    assert sorted((f.category, f.display, f.kind) for f in listing.files) == [
        ("a", str(tmp_path / "via" / "data" / "x.txt"), "f"),
        ("b", str(tmp_path / "root-link"), "l"),
    ]
    assert b.run(b.plan(listing)).ok and b.verify(listing) == []


def test_rehash_of_a_file_that_became_a_fifo_does_not_block(conn, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    b = Backup(conn, manifest_for(src), dest)
    assert b.run(b.plan(b.walk())).ok
    os.utime(src / "f", ns=(1, 2_000_000_000))  # same size, new mtime: the node's hash decides
    listing = b.walk()
    plan = b.plan(listing)
    assert [f.display for f in plan.rehash] == [str(src / "f")]
    os.unlink(src / "f")
    os.mkfifo(src / "f")
    res = b.run(plan)
    assert [why for _, why in res.failed] == [
        "not read on the node: changed type since the listing: no longer a regular file"
    ]
    assert dict(b.verify(listing))[str(src / "f")].startswith("not read on the node")


def _deep(root: Path, levels: int, name_len: int = 200) -> bytes:
    """Make a directory chain whose absolute path is longer than PATH_MAX (fd-relative mkdir)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    path = os.fsencode(root)
    try:
        for i in range(levels):
            name = (f"{i:03d}" + "d" * name_len).encode()
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
            path += b"/" + name
        for fname, data in ((b"small.txt", b"deep small"), (b"big.bin", b"B" * (5 << 20))):
            wfd = os.open(fname, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
            os.write(wfd, data)
            os.close(wfd)
    finally:
        os.close(fd)
    return path


def test_node_path_over_path_max_is_copied_and_a_long_local_path_is_an_item(conn, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a")
    deep = _deep(src, 15)  # about 3,000 bytes on the node: fine there, too long under dest
    (src / "z.txt").write_bytes(b"z")
    assert len(deep) < 4000 and len(os.fsencode(dest)) + len(deep) > 3000
    b = Backup(conn, manifest_for(src), dest)
    listing = b.walk()
    assert {f.display for f in listing.files} >= {str(src / "a.txt"), str(src / "z.txt")}
    assert len(listing.files) == 4 and not listing.errors
    res = b.run(b.plan(listing))
    assert res.error is None  # the long local paths did not end the transfer
    assert res.copied_files >= 2 and (dest / "data" / str(src).lstrip("/") / "z.txt").read_bytes() == b"z"
    long_local = [p for p, _ in res.failed]
    items = dict(b.verify(listing))
    assert set(items) == set(long_local)
    for p in long_local:
        assert len(os.fsencode(dest)) + len(os.fsencode(p)) > 4000
        assert "path too long" in items[p]


def test_node_path_over_path_max_is_listed_and_read(conn, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    deep = _deep(src, 22)  # > 4,096 bytes: only fd-relative opens reach it
    assert len(deep) > 4096
    b = Backup(conn, manifest_for(src), tmp_path / "dest")
    listing = b.walk()
    assert not listing.errors and len(listing.files) == 2
    res = b.run(b.plan(listing))
    assert res.error is None
    assert {why for _, why in res.failed} == {"writing the copy: path too long"}  # local side only


def test_sparse_files_stay_sparse_and_hash_as_a_whole(conn, tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    shapes = {
        "big.img": (64 << 20, [(10 << 20, 1 << 20), (40 << 20, 4096)]),
        "small.img": (3 << 20, [(1 << 20, 4096)]),
    }
    shapes["tail-hole.img"] = (16 << 20, [(0, 8192)])
    for name, (size, extents) in shapes.items():
        with open(src / name, "wb") as f:
            f.truncate(size)
            for off, n in extents:
                f.seek(off)
                f.write(os.urandom(n))
    if os.stat(src / "big.img").st_blocks * 512 >= 64 << 20:
        pytest.skip("this file system does not keep holes")
    b = Backup(conn, manifest_for(src), dest)
    listing = b.walk()
    assert {f.display: f.allocated for f in listing.files}[str(src / "big.img")] < 2 << 20
    res = b.run(b.plan(listing))
    assert res.ok, res
    for name, (size, _) in shapes.items():
        local = dest / "data" / str(src).lstrip("/") / name
        st = os.stat(local)
        assert st.st_size == size and st.st_blocks * 512 < size // 2, name
        assert (
            hashlib.sha256(local.read_bytes()).digest() == hashlib.sha256((src / name).read_bytes()).digest()
        )
        rec = b.state.items[f"data/{str(src).lstrip('/')}/{name}"]
        assert rec["s"] == size and rec["a"] == st.st_blocks * 512
    assert b.verify(listing, rehash_local=True) == []


def test_manifest_problems_all_reported_one_line_each(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text(
        "gpu_idle_mib: abc\n"
        "gpu_idle_timeout: .nan\n"
        "colour: red\n"
        "stop:\n"
        "  term_timeout: 1.0e+300\n"
        "  match: [{args: '--port'}]\n"
        "categories:\n"
        "  a: {roots: [/x], s3: 'false', max_size: -5}\n"
        "  b: {roots: 5, include: 3}\n"
        '  c: {roots: ["/x\\0y"], exclude: ["ok/**", 7]}\n'
    )
    with pytest.raises(ManifestError) as info:
        load_manifest(bad)
    problems = info.value.problems
    expected = [
        "gpu_idle_mib: 'abc'",
        "gpu_idle_timeout: nan",
        "colour: 'red'",
        "stop.term_timeout: 1e+300",
        "stop.match[0].args: '--port' (expected a list of",
        "categories.a.s3: 'false' (expected true or false",
        "categories.a.max_size: -5",
        "categories.b.roots: 5",
        "categories.b.include: 3",
        "categories.c.roots[0]: '/x\\x00y' (expected no NUL byte",
        "categories.c.exclude[1]: 7 (expected a string)",
    ]
    for start in expected:
        assert sum(p.startswith(f"{bad}: {start}") for p in problems) == 1, (start, problems)
    assert len(problems) == len(expected), problems
    assert str(bad) in str(info.value)
    bad.write_bytes(b"name: caf\xe9\ncategories: {a: {roots: [/x]}}\n")
    with pytest.raises(ManifestError, match="not UTF-8"):
        load_manifest(bad)


def test_globs_are_linear_in_the_path_length():
    pattern = "**/" * 60 + "x"
    globs = [glob_compile(pattern), glob_compile("a*a*a*a*a*a*b")]
    path = "/".join(["a"] * 2000) + "/y"
    started = time.monotonic()
    assert not glob_match(globs, path)
    assert glob_match(globs, path[:-1] + "x")
    assert time.monotonic() - started < 2.0
    assert glob_match([glob_compile("**/__pycache__/**")], "a/__pycache__/b.pyc")
    assert glob_match([glob_compile("*.md")], "NOTES.md")
    assert not glob_match([glob_compile("*.md")], "sub/NOTES.md")
    assert glob_match([glob_compile("**/.*.sw?")], "a/b/.x.swp")
    assert glob_match([glob_compile("f[!0-4].log")], "f7.log")
    assert not glob_match([glob_compile("f[!0-4].log")], "f3.log")


def test_mode_of_special_files_is_listed_not_read(conn, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "fifo")
    listing = Backup(conn, manifest_for(src), tmp_path / "dest").walk()
    assert [(s["path"], s["why"]) for s in listing.skipped] == [
        (str(src / "fifo"), "not a regular file or link")
    ]
    assert stat.S_ISFIFO(os.lstat(src / "fifo").st_mode)

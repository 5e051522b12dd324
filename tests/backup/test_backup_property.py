"""Property: the decommission verdict is true if and only if every in-scope byte is verified everywhere.

Hypothesis generates small trees with hostile names (spaces, newlines, `$(...)`, quotes,
non-UTF-8 bytes, 255-byte names) and faults: an unreadable directory or file (the agent runs as
`nobody`, as in test_backup_hostile), a directory swapped for a link out of the tree after the
listing, a file vanished or turned into a FIFO after the listing, a file growing or rewritten
in place (mtime put back) while it is copied, a local path too long, a node file or its local copy changed between runs with its size
and mtime put back, and two nodes whose destinations come from one template.  The
verdict is the suite's own (`suites.decommission.notes.verdict`, a pure function) fed as its
safe-to-terminate step feeds it: a fresh listing, `Backup.verify`, and for S3 the local items,
`S3Upload.verify` and the open multipart uploads.  The ground truth is the test's own: it reads
the source tree and the backup directory with directory fds and O_NOFOLLOW and compares bytes,
and reads S3 objects back with boto3.  Each case runs the backup twice, as an operator rerunning
the suite would, and the property must hold after each run.

GPUHOST_PROPERTY_EXAMPLES sets the number of cases (200 by default, and 1/25 of it per template
for two nodes); GPUHOST_PROPERTY_SHRINK=1 shrinks a failing case before printing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the dev extra")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pytest_gpuhost.exec.targets import open_connection, parse_host_url  # noqa: E402
from pytest_gpuhost.modules.backup.destination import DestinationError, per_target  # noqa: E402
from pytest_gpuhost.modules.backup.local import Backup, Category, Manifest, RemoteFile  # noqa: E402
from pytest_gpuhost.modules.backup.s3 import S3Upload, items_from_backup, parse_s3_url  # noqa: E402
from pytest_gpuhost.modules.process import Selection  # noqa: E402
from suites.decommission.notes import STEPS  # noqa: E402
from suites.decommission.notes import verdict as suite_verdict  # noqa: E402
from tests.helpers.hostile_tree import (  # noqa: E402
    Spec,
    build,
    compare_local,
    compare_s3,
    iter_spec,
    snapshot,
)

NOBODY = 65534
EXAMPLES = int(os.environ.get("GPUHOST_PROPERTY_EXAMPLES", "200"))
SECRET = b"SECRET-OUTSIDE-THE-TREE"
CATEGORY = "data"
RUN_BOUND_S = 30.0  # a FIFO or a blocked read would hold a run until the stall timeout

PROFILE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases on every CI run; a failure prints its reproducer
    database=None,
    print_blob=True,
    # no explain phase, and shrinking only on request: each reruns a failing case hundreds of
    # times (minutes here); the failing case is printed either way
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    + ([Phase.shrink] if os.environ.get("GPUHOST_PROPERTY_SHRINK") else []),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------- generated trees and faults

HOSTILE_NAMES = [
    b"space name",
    b"new\nline",
    b"$(touch PWNED)",
    b"`id`",
    b"it's",
    b'say "hi"',
    b"back\\slash",
    b"latin1-\xe9\xff",
    b"\xff\xfe",
    "unicode-\u00e9\u4e2d".encode(),
    b"-rf",
    b"*",
    b"?[!a]",
    b"%41%2F",
    b"tab\there",
    b"cr\r",
    b"...",
    b" lead",
    b"trail ",
    b".hidden",
    b"a;b|c&d>e",
    b"n" * 255,
    b"SHA256SUMS",
    b".gpuhost",
]


def _clean(raw: bytes) -> bytes:
    return raw.replace(b"/", b"_").replace(b"\0", b"_")


names = st.one_of(
    st.sampled_from(HOSTILE_NAMES),
    st.binary(min_size=1, max_size=12).map(_clean).filter(lambda n: n not in (b".", b"..")),
)


def _pattern(n: int) -> bytes:
    block = hashlib.sha256(str(n).encode()).digest()
    return (block * (n // len(block) + 1))[:n]


contents = st.one_of(
    st.binary(max_size=300),
    st.integers(min_value=1000, max_value=400_000).map(_pattern),
)
link_targets = st.one_of(
    st.sampled_from([b"/etc", b"/etc/shadow", b"..", b"../../..", b"dangling", b"$(id)", b"\xff\n"]),
    names,
)


@st.composite
def specs(draw: st.DrawFn, depth: int = 0) -> Spec:
    """Draw a small tree: 1-4 entries at the top, fewer below, at most three levels."""
    spec: Spec = {}
    for _ in range(draw(st.integers(min_value=1 if depth == 0 else 0, max_value=4 - depth))):
        name = draw(names)
        if name in spec:
            continue
        kinds = ["f", "f", "f", "l", "p"] + (["d", "d"] if depth < 2 else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "f":
            spec[name] = ("f", draw(contents))
        elif kind == "l":
            spec[name] = ("l", draw(link_targets))
        elif kind == "p":
            spec[name] = ("p", b"")
        else:
            spec[name] = ("d", draw(specs(depth + 1)))
    return spec


CHAIN_TOP = b"00" + b"c" * 200


def _chain(levels: int = 9, width: int = 200) -> tuple[bytes, Spec]:
    """Return the top name and spec of a directory chain about levels*width bytes deep."""
    inner: Spec = {b"deep.txt": ("f", b"deep"), b"deep-link": ("l", b"../x")}
    for i in reversed(range(1, levels)):
        inner = {(f"{i:02d}" + "c" * width).encode(): ("d", inner)}
    return CHAIN_TOP, inner


def one_in(n: int) -> st.SearchStrategy[bool]:
    """Draw True about once in n (st.integers favours its bounds, sampled_from does not)."""
    return st.sampled_from([False] * (n - 1) + [True])  # False first: what shrinking favours


@dataclass
class Case:
    """One generated node: its tree, the faults to inject, and where its copies go."""

    spec: Spec
    unreadable_dirs: list[bytes] = field(default_factory=list)
    unreadable_files: list[bytes] = field(default_factory=list)
    swapped: list[bytes] = field(default_factory=list)  # dir -> link out of the tree, after the listing
    vanished: list[bytes] = field(default_factory=list)  # unlinked after the listing
    fifos: list[bytes] = field(default_factory=list)  # file -> FIFO after the listing
    grown: list[bytes] = field(default_factory=list)  # appended after the listing and while copied
    rewritten: list[bytes] = field(default_factory=list)  # rewritten in place while copied, mtime put back
    put_back: list[bytes] = field(default_factory=list)  # rewritten between runs, size and mtime put back
    local_altered: list[bytes] = field(default_factory=list)  # its copy edited between runs, likewise
    too_long: bool = False  # a chain whose local path is over PATH_MAX
    s3: bool = False


def _holds_scope(payload: Spec) -> bool:
    return any(kind in ("f", "l") for _, kind, _ in iter_spec(payload))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Draw a tree and, each with about one chance in four, each kind of fault on distinct paths."""
    spec = draw(specs())
    case = Case(spec, too_long=draw(one_in(6)), s3=draw(one_in(5)))
    if case.too_long:
        top, inner = _chain()
        spec[top] = ("d", inner)
    files = [rel for rel, kind, _ in iter_spec(spec) if kind == "f" and not rel.startswith(CHAIN_TOP)]
    # an unreadable or swapped directory is one holding something in scope; an empty unreadable
    # one also fails the verdict (the node cannot tell it is empty), and the truth says so too
    dirs = [rel for rel, kind, sub in iter_spec(spec) if kind == "d" and _holds_scope(sub)]
    files = draw(st.permutations(files))
    dirs = draw(st.permutations(dirs))

    def take(pool: list[bytes], wanted: bool) -> list[bytes]:
        return [pool.pop()] if pool and wanted else []

    case.unreadable_dirs = take(dirs, draw(one_in(4)))
    case.swapped = take(dirs, draw(one_in(4)))
    case.unreadable_files = take(files, draw(one_in(4)))
    case.vanished = take(files, draw(one_in(4)))
    case.fifos = take(files, draw(one_in(4)))
    case.grown = take(files, draw(one_in(4)))
    case.rewritten = take(files, draw(one_in(4)))
    case.put_back = take(files, draw(one_in(4)))
    case.local_altered = take(files, draw(one_in(4)))
    return case


# ---------------------------------------------------------------- the verdict and the truth


def verdict(backup: Backup, up: S3Upload | None) -> list[str]:
    """Return what the suite's safe-to-terminate would list (empty: safe), read as its step reads.

    The steps before the verdict are taken as passed and no server as running: what varies here
    is the backup, gathered as `step_safe_to_terminate` gathers it and judged by the suite's own
    pure `verdict()`.
    """
    listing = backup.walk()
    s3_missing: list[tuple[str, str]] = []
    open_uploads: list[str] = []
    if up is not None:
        items, unverified = items_from_backup(backup, listing)
        s3_missing = [*unverified, *up.verify(items)]
        open_uploads = [k for k, _ in up.open_uploads()]
    return suite_verdict(
        dict.fromkeys(STEPS, "passed") | ({} if up is not None else {"data in s3": "skipped"}),
        running=[],
        local_missing=backup.verify(listing),
        s3_categories=[CATEGORY] if up is not None else [],
        s3_configured=up is not None,
        s3_missing=s3_missing,
        open_uploads=open_uploads,
    )


@dataclass
class World:
    """What every case shares: one agent connection, a world-readable base, the S3 endpoint."""

    conn: Any
    nobody: bool
    base: Path
    s3_client: Any
    bucket: str


def truth(world: World, src: bytes, dest: bytes, prefix: str | None) -> list[str]:
    """Return what keeps the source from being wholly verified, found by the test alone (empty: all is)."""
    snap = snapshot(src)
    bad = [f"local: {rel!r}: {why}" for rel, why in compare_local(dest, CATEGORY, src, snap.entries)]
    if prefix is not None:
        bad += [
            f"s3: {rel!r}: {why}"
            for rel, why in compare_s3(world.s3_client, world.bucket, prefix, CATEGORY, src, snap.entries)
        ]
    if world.nobody:
        # a directory `nobody` may not list or enter: what is in it cannot be known, so not verified
        bad += [f"unlistable: {rel!r}" for rel, mode in snap.dir_modes.items() if mode & 0o005 != 0o005]
    return bad


def outside_reads(dest: bytes, world: World, prefix: str | None) -> list[str]:
    """Return every copy (local file or S3 object) holding bytes from outside the tree."""
    found = [f"local {rel!r}" for rel, (_, data) in snapshot(dest).entries.items() if SECRET in data]
    if prefix is not None:
        pages = world.s3_client.get_paginator("list_objects_v2").paginate(
            Bucket=world.bucket, Prefix=prefix + "/"
        )
        for page in pages:
            for obj in page.get("Contents", []):
                body = world.s3_client.get_object(Bucket=world.bucket, Key=obj["Key"])["Body"].read()
                if SECRET in body:
                    found.append(f"s3 {obj['Key']!r}")
    return found


# ---------------------------------------------------------------- fixtures (one of each per module)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: Any) -> Iterator[World]:
    """Yield the shared agent (as nobody when root can arrange it), base directory and bucket."""
    base = Path(tempfile.mkdtemp(prefix="gpuhost-prop-", dir="/tmp"))
    base.chmod(0o755)
    setpriv = shutil.which("setpriv")
    python = shutil.which("python3", path="/usr/bin:/bin")
    nobody = os.geteuid() == 0 and setpriv is not None and python is not None
    if nobody:
        assert setpriv is not None and python is not None
        bindir = tmp_path_factory.mktemp("bin")
        (bindir / "sudo").write_text(
            f'#!/bin/sh\nshift 2\nexec {setpriv} --reuid={NOBODY} --regid={NOBODY} --clear-groups "$@"\n'
        )
        (bindir / "sudo").chmod(0o755)
        (bindir / "python3").symlink_to(python)
        conn = open_connection(parse_host_url(f"local://?path={bindir}:/usr/bin:/bin&sudo=1"))
        assert conn.run(["id", "-u"]).stdout.strip() == str(NOBODY)
    else:
        conn = open_connection(parse_host_url("local://"))
    client = s3_endpoint.client()
    try:
        yield World(conn, nobody, base, client, s3_endpoint.make_bucket("prop"))
    finally:
        conn.close()
        shutil.rmtree(base)


def _case_dir(world: World) -> Path:
    d = Path(tempfile.mkdtemp(prefix="c", dir=world.base))
    d.chmod(0o755)
    return d


def _make_src(d: Path, spec: Spec) -> bytes:
    src = d / "src"
    src.mkdir(mode=0o755)
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    try:
        build(fd, spec)
    finally:
        os.close(fd)
    return os.fsencode(src)


def _long_dest(d: Path) -> bytes:
    """Return a backup directory about 2,500 bytes deep: the chain's files land past PATH_MAX under it."""
    parts = [(f"{i}" + "L" * 240) for i in range(10)]
    dest = d.joinpath(*parts)
    dest.mkdir(parents=True)
    return os.fsencode(dest)


# ---------------------------------------------------------------- faults


def _after_listing(case: Case, src: bytes, d: Path) -> None:
    """Inject the faults that strike between the listing and the copy."""
    for rel in case.vanished:
        os.unlink(src + b"/" + rel)
    for rel in case.fifos:
        os.unlink(src + b"/" + rel)
        os.mkfifo(src + b"/" + rel)  # a reader without O_NONBLOCK would hang here
    for rel in case.grown:
        with open(src + b"/" + rel, "ab") as f:
            f.write(b"+grown after the listing")
    for i, rel in enumerate(case.swapped):
        outside = os.fsencode(d) + b"/outside%d" % i
        os.mkdir(outside, 0o755)
        # the names the directory held, now full of bytes from outside the tree
        for rel2, kind, _ in iter_spec(case.spec):
            if kind == "f" and rel2.startswith(rel + b"/") and b"/" not in rel2[len(rel) + 1 :]:
                with open(outside + b"/" + rel2[len(rel) + 1 :], "wb") as f:
                    f.write(SECRET * 4)
        os.rename(src + b"/" + rel, os.fsencode(d) + b"/moved%d" % i)
        os.symlink(outside, src + b"/" + rel)


def _put_back(path: bytes, mask: int = 0x5A) -> None:
    """Flip the first byte of a non-empty file in place (XOR mask), then set atime and mtime back
    (`touch -r`)."""
    try:
        st_before = os.stat(path, follow_symlinks=False)
    except OSError:
        return  # not there (never copied, or gone): nothing to alter
    if not stat.S_ISREG(st_before.st_mode) or st_before.st_size == 0:
        return
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ mask]))
    os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns), follow_symlinks=False)


def _between_runs(case: Case, src: bytes, dest: bytes) -> None:
    """Inject the faults that strike after a run: changes that put size and mtime back."""
    for rel in case.put_back:
        _put_back(src + b"/" + rel)
    for rel in case.local_altered:
        _put_back(dest + b"/" + CATEGORY.encode() + src + b"/" + rel)


def _grower(case: Case, src: bytes) -> Any:
    """Return an on_placed hook that, while other files land (3 times), appends to the growing
    file and rewrites the rewritten one in place with its size and mtime put back: before its
    read, during it, or after it was placed, which only its ctime tells)."""
    budget = [3]

    def on_placed(f: RemoteFile, rec: dict[str, Any]) -> None:
        if budget[0] > 0:
            budget[0] -= 1
            for rel in case.grown:
                with open(src + b"/" + rel, "ab") as out:
                    out.write(b"+grown while copied")
            # masks 1, 3, 7: the byte becomes b^1, b^2, b^5, never a state it had (no ABA)
            for rel in case.rewritten:
                _put_back(src + b"/" + rel, mask=(1, 3, 7)[2 - budget[0]])

    return on_placed


def _covered(path: str, items: set[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in items)


# ---------------------------------------------------------------- the properties


def _one_pass(
    world: World, case: Case, b: Backup, up: S3Upload | None, src: bytes, d: Path, first: bool
) -> None:
    listing = b.walk()
    plan = b.plan(listing)
    if first:
        _after_listing(case, src, d)
        if case.grown or case.rewritten:
            b.on_placed = _grower(case, src)
    started = time.monotonic()
    try:
        res = b.run(plan)
    finally:
        b.on_placed = None
    assert time.monotonic() - started < RUN_BOUND_S, "a run was held (FIFO or blocked read?)"
    assert res.error is None, res.error  # one bad file never ends the transfer
    if first:
        # nothing dropped silently: every path a fault struck is named (or a directory above or
        # below it) in the items of the listing the run worked from; links are recreated from the
        # listing without reading the node, so a swapped directory counts by its regular files
        named = {p for p, _ in b.verify(listing)}
        struck = case.vanished + case.fifos + case.swapped
        if world.nobody:
            struck += case.unreadable_dirs + case.unreadable_files
        for rel in struck:
            path = (src + b"/" + rel).decode("utf-8", "backslashreplace")
            listed_below = any(
                f.kind == "f" and (f.display.startswith(path + "/") or f.display == path)
                for f in listing.files
            )
            if listed_below or rel in case.unreadable_dirs:
                assert _covered(path, named) or any(p.startswith(path + "/") for p in named), (path, named)
    if up is not None:
        items, _ = items_from_backup(b, b.walk())
        up.run(up.plan(items))


def _check(world: World, b: Backup, up: S3Upload | None, src: bytes, dest: bytes, prefix: str | None) -> bool:
    problems = verdict(b, up)
    missing = truth(world, src, dest, prefix)
    assert (not problems) == (not missing), (
        f"verdict {'SAFE' if not problems else 'NOT safe'} but the truth says "
        f"{'all verified' if not missing else 'not verified'}:\n  verdict: {problems}\n  truth: {missing}"
    )
    assert outside_reads(dest, world, prefix) == []
    return not problems


def _manifest(src: bytes, s3: bool) -> Manifest:
    return Manifest("prop", (Category(CATEGORY, (os.fsdecode(src),), s3=s3),), Selection())


def _events(case: Case, nobody: bool) -> None:
    """Record which faults a case holds (shown by --hypothesis-show-statistics)."""
    for kind in (
        "unreadable_dirs",
        "unreadable_files",
        "swapped",
        "vanished",
        "fifos",
        "grown",
        "rewritten",
        "put_back",
        "local_altered",
    ):
        if getattr(case, kind):
            hypothesis.event(
                f"fault: {kind}{'' if nobody or 'unreadable' not in kind else ' (agent is root)'}"
            )
    if case.too_long:
        hypothesis.event("fault: too_long")
    if case.s3:
        hypothesis.event("destination: local and S3")
    if any(n in HOSTILE_NAMES for rel, _, _ in iter_spec(case.spec) for n in rel.split(b"/")):
        hypothesis.event("hostile name")


@PROFILE
@given(case=cases())
def test_verdict_iff_every_byte_verified(world: World, case: Case) -> None:
    d = _case_dir(world)
    try:
        src = _make_src(d, case.spec)
        if os.geteuid() == 0:  # otherwise the test could not read its own ground truth either
            for rel in case.unreadable_files + case.unreadable_dirs:
                os.chmod(src + b"/" + rel, 0)
        else:
            case.unreadable_files, case.unreadable_dirs = [], []
        _events(case, world.nobody)
        dest = _long_dest(d) if case.too_long else os.fsencode(d / "dest")
        prefix = os.path.basename(d) if case.s3 else None
        b = Backup(world.conn, _manifest(src, case.s3), os.fsdecode(dest), stall_timeout=20.0)
        up = None
        if prefix is not None:
            up = S3Upload(
                os.fsdecode(dest),
                parse_s3_url(f"s3://{world.bucket}/{prefix}"),
                client=world.s3_client,
                workers=2,
            )
        for first in (True, False):
            _one_pass(world, case, b, up, src, d, first)
            safe = _check(world, b, up, src, dest, prefix)
            if first:
                _between_runs(case, src, dest)
        # a rerun converges: after faults that pass (vanished, FIFO, grown, rewritten, swapped) the
        # node is safe;
        # those that stay (unreadable to the agent, a local path too long) keep it unsafe, which
        # the truth above already demands.  A swapped directory whose links were recreated in the
        # backup before the swap stays too: the backup refuses to put the new link where its
        # directory is ("a directory is in the way of the link in the backup"), an item, not a loss
        links_copied = any(
            kind == "l" and rel.startswith(s + b"/")
            for s in case.swapped
            for rel, kind, _ in iter_spec(case.spec)
        )
        if not (
            case.too_long
            or links_copied
            or (world.nobody and (case.unreadable_dirs or case.unreadable_files))
        ):
            assert safe, case
    finally:
        shutil.rmtree(d)


# ---------------------------------------------------------------- two nodes, one template

HOST_NAMES = [
    "gpu-01",
    "gpu-02",
    "..",
    ".",
    "A",
    "a",
    "GPU-01",
    "node b",
    "\uff47\uff50\uff55-01",
    "a/b",
    "a_b",
    "-rf",
]
LOCAL_TEMPLATES = [
    "{base}/{host}",
    "{base}/n-{host}-x/backup",
    "{base}/./{host}",
    "{base}/backups",  # no {host}: must be refused with two targets
    "{base}/{host}/..",  # '..' after {host} folds the nodes together: must be refused
]
S3_TEMPLATES = ["s3://{bucket}/{case}/{host}", "s3://{bucket}/{case}", "s3://{bucket}/{case}-{host}/x"]


def _node_b(src: bytes, snap: dict[bytes, tuple[str, bytes]]) -> None:
    """Turn the tree into another node's: the same paths, sizes and mtimes, other bytes."""
    for rel, (kind, data) in snap.items():
        if kind != "f" or not data:
            continue
        path = src + b"/" + rel
        st_before = os.stat(path, follow_symlinks=False)
        with open(path, "r+b") as f:
            f.write(bytes(b ^ 0xA5 for b in data))
        os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns), follow_symlinks=False)


def _shared(template: str) -> bool:
    """True when the template gives several hosts one place: no {host}, or '..'/'.' after it."""
    if "{host}" not in template:
        return True
    after = template.split("{host}", 1)[1].split("/")[1:]
    return any(part in (".", "..") for part in after)


@pytest.mark.parametrize("template", LOCAL_TEMPLATES)
@settings(PROFILE, max_examples=max(4, EXAMPLES // 25))
@given(
    spec=specs(),
    model=st.binary(min_size=1, max_size=2000),
    hosts=st.lists(st.sampled_from(HOST_NAMES), min_size=2, max_size=2, unique=True),
    s3_template=st.one_of(st.none(), st.sampled_from(S3_TEMPLATES)),
)
def test_two_nodes_refused_or_both_kept(
    world: World, template: str, spec: Spec, model: bytes, hosts: list[str], s3_template: str | None
) -> None:
    """Two nodes with the same paths, sizes and mtimes: refused, or each node's bytes kept and verified."""
    d = _case_dir(world)
    try:
        spec[b"model.bin"] = ("f", model)  # at least one file whose bytes differ between the nodes
        tpl = template.replace("{base}", os.fsdecode(d))
        s3_tpl = (
            None
            if s3_template is None
            else s3_template.format(bucket=world.bucket, case=d.name, host="{host}")
        )
        try:
            dests = per_target(tpl, hosts, option="--backup-dir")
            s3_dests = None if s3_tpl is None else per_target(s3_tpl, hosts, option="--backup-to")
        except DestinationError:
            hypothesis.event("refused")
            assert _shared(tpl) or (s3_tpl is not None and _shared(s3_tpl))
            assert sorted(os.listdir(d)) == []  # refused before anything was written
            return
        assert not _shared(tpl) and (s3_tpl is None or not _shared(s3_tpl)), (
            "a shared destination was accepted"
        )
        hypothesis.event("accepted" + (" with S3" if s3_tpl else ""))
        src = _make_src(d, spec)
        kept: list[tuple[str, dict[bytes, tuple[str, bytes]], bool]] = []
        for n, host in enumerate(hosts):
            if n:
                _node_b(src, kept[0][1])
            dest = os.fsencode(dests[host])
            prefix = None if s3_dests is None else parse_s3_url(s3_dests[host]).prefix
            b = Backup(world.conn, _manifest(src, prefix is not None), dests[host], stall_timeout=20.0)
            up = None
            if s3_dests is not None:
                up = S3Upload(dests[host], parse_s3_url(s3_dests[host]), client=world.s3_client, workers=2)
            res = b.run(b.plan(b.walk()))
            assert res.error is None
            if up is not None:
                items, _ = items_from_backup(b, b.walk())
                up.run(up.plan(items))
            safe = _check(world, b, up, src, dest, prefix)
            kept.append((host, snapshot(src).entries, safe))
        # the first node's verdict still holds after the second node's backup
        (host_a, snap_a, safe_a), _ = kept
        dest_a = os.fsencode(dests[host_a])
        prefix_a = None if s3_dests is None else parse_s3_url(s3_dests[host_a]).prefix
        lost = compare_local(dest_a, CATEGORY, src, snap_a)
        if prefix_a is not None:
            lost += compare_s3(world.s3_client, world.bucket, prefix_a, CATEGORY, src, snap_a)
        assert not (safe_a and lost), f"{host_a!r} was called safe, then lost {lost}"
        assert all(safe for _, _, safe in kept)  # nothing else stands in the way here
    finally:
        shutil.rmtree(d)


# ---------------------------------------------------------------- fleets: whose data, every root
#
# Fleets of two or three nodes run one after the other, each with destinations drawn from small
# pools so that they overlap as an operator's mistakes make them: one backup directory shared or
# nested, S3 prefixes equal, nested (p, p/x) or only string-related (p, px), a --backup-to inside
# another node's in_s3 location, owner records lost or corrupted between runs, machines cloned
# from one image (one machine-id). Roots are plain, links (followed or not), empty (expected or
# not) and filtered. Each node's run is gated by the suite's own decision (`claim_problems` on
# `s3_evidence`, as Decommission.claim calls them), then runs the real engine (Backup, S3Upload)
# and judges itself as the verdict does (`Backup.verify`, `S3Upload.verify`, `root_problems`).
# The truth is the test's own, from the bytes: each file of each root of each node called safe,
# read from its source, must be byte-identical in its backup directory and (s3) under its
# prefix, read back with boto3, or be left out by the category's exclude rule and counted
# there; and that must still hold after every later node of the fleet ran. No object may land
# under an in_s3 location. GPUHOST_FLEET_CASES sets the count (300); a failure names its seed.

FLEET_CASES = int(os.environ.get("GPUHOST_FLEET_CASES", "300"))
FLEET_SEED = int(os.environ.get("GPUHOST_FLEET_SEED", "0"))


@dataclass
class FleetNode:
    name: str
    me: dict[str, str]
    dest: Path
    url: str | None
    in_s3: str | None
    roots: list[Path]
    follow: bool
    expected_empty: bool
    sources: dict[Path, bytes] = field(default_factory=dict)  # file -> bytes, as the truth sees them
    skipped: set[Path] = field(default_factory=set)  # files the exclude glob leaves out


def _fleet(rng: Any, d: Path, bucket: str, seed: int) -> list[FleetNode]:
    from pytest_gpuhost.modules.backup.ownership import node_identity

    n = rng.choice((2, 3))
    base_mid = f"{seed:08x}" + "0" * 24
    dir_pool = ["shared", "shared/sub", "own{k}", "own{k}", "sharedx"]
    url_pool = [None, "p", "p/x", "px", "own{k}", "own{k}", "pipe/b"]
    nodes = []
    for k in range(n):
        cloned = k > 0 and rng.random() < 0.25
        mid = base_mid if cloned else f"{seed:08x}{k:024x}"
        key = "k" * 32 if cloned and rng.random() < 0.5 else f"{k:032x}"
        me = node_identity(f"n{k}", "ubuntu", mid, "t", host_key=key)
        dest = d / rng.choice(dir_pool).format(k=k)
        u = rng.choice(url_pool)
        url = None if u is None else f"s3://{bucket}/c{seed}/{u.format(k=k)}"
        in_s3 = f"s3://{bucket}/c{seed}/pipe" if rng.random() < 0.3 else None
        src = d / f"src{k}"
        data = src / "data"
        data.mkdir(parents=True)
        node = FleetNode(f"n{k}", me, dest, url, in_s3, [data], rng.random() < 0.5, rng.random() < 0.5)
        for i in range(rng.randint(1, 3)):
            p = data / f"f{i}.bin"
            p.write_bytes(f"{seed}/{k}/{i}/".encode() + rng.randbytes(rng.randint(0, 300)))
            node.sources[p] = p.read_bytes()
        if rng.random() < 0.4:  # a file the category's exclude leaves out
            p = data / "scratch.skip"
            p.write_bytes(b"tmp")
            node.skipped.add(p)
        if rng.random() < 0.35:  # a root that is a link to more data
            real = src / "real"
            real.mkdir()
            (real / "g.bin").write_bytes(f"{seed}/{k}/linked".encode())
            (src / "link").symlink_to(real)
            node.roots.append(src / "link")
            node.sources[real / "g.bin"] = (real / "g.bin").read_bytes()
        if rng.random() < 0.3:  # a root that yields nothing
            (src / "empty").mkdir()
            node.roots.append(src / "empty")
        nodes.append(node)
    return nodes


def _fleet_event(rng: Any, node: FleetNode, client: Any, bucket: str) -> str:
    """Between runs: lose or corrupt an earlier node's owner record (local or S3)."""
    roll = rng.random()
    rec = node.dest / ".gpuhost" / "node.json"
    if roll < 0.15 and rec.exists():
        rec.unlink()
        return f"{node.name}: local record lost"
    if roll < 0.25 and rec.exists():
        rec.write_text("{torn")
        return f"{node.name}: local record corrupt"
    if roll < 0.35 and node.url is not None:
        prefix = parse_s3_url(node.url).prefix
        client.delete_object(Bucket=bucket, Key=f"{prefix}/.gpuhost/node.json")
        return f"{node.name}: S3 record lost"
    return ""


def _fleet_run(world_conn: Any, client: Any, endpoint: str, node: FleetNode) -> tuple[bool, str]:
    """One node's run: the claim decision, then (when allowed) the real backup and its verdict."""
    from pytest_gpuhost.modules.backup.ownership import claim_problems, run_places, s3_evidence
    from pytest_gpuhost.modules.backup.roots import root_problems
    from pytest_gpuhost.modules.backup.s3 import state_tag

    cat = Category(
        CATEGORY,
        tuple(str(r) for r in node.roots),
        exclude=("*.skip",),
        s3=node.url is not None,
        follow_root_links=node.follow,
        expected_empty=node.expected_empty,
    )
    manifest = Manifest("fleet", (cat,), Selection())
    places = run_places(
        [node.name],
        {node.name: str(node.dest)},
        {node.name: node.url} if node.url else {},
        [(node.in_s3, CATEGORY)] if node.in_s3 else [],
        in_s3_writes=False,
    )
    record, foreign, above = None, False, []
    if node.url is not None:
        loc = parse_s3_url(node.url)
        journal = f"s3-{state_tag(endpoint, node.url)}"
        record, foreign, above = s3_evidence(client, loc.bucket, loc.prefix, node.dest, journal)
    problems, s3_judged = claim_problems(
        node.me, places, node.dest, s3_url=node.url, s3_record=record, s3_foreign=foreign, s3_above=above
    )
    if problems:
        return False, "refused: " + "; ".join(problems)
    own = node.dest / ".gpuhost" / "node.json"
    if not own.exists():
        own.parent.mkdir(parents=True, exist_ok=True)
        own.write_text(json.dumps(node.me))
    with open(node.dest / ".gpuhost" / "timeline.jsonl", "a") as f:
        f.write(json.dumps({"t": "t", "target": node.name, "event": "run"}) + "\n")
    b = Backup(world_conn, manifest, node.dest)
    listing = b.walk()
    res = b.run(b.plan(listing))
    if res.error:
        return False, f"backup error {res.error}"
    why = [f"{p}: {w}" for p, w in b.verify(listing)] + root_problems(manifest, listing)
    if node.url is not None:
        loc = parse_s3_url(node.url)
        if s3_judged is not None and s3_judged.status != "mine":
            client.put_object(
                Bucket=loc.bucket, Key=f"{loc.prefix}/.gpuhost/node.json", Body=json.dumps(node.me)
            )
        up = S3Upload(node.dest, loc, client=client, workers=2)
        items, unverified = items_from_backup(b, listing)
        up.run(up.plan(items))
        up.finish()
        why += [f"{p}: {w}" for p, w in [*unverified, *up.verify(items)]]
        why += [f"open upload {k}" for k, _ in up.open_uploads()]
    return not why, "; ".join(why[:5])


def _fleet_truth(client: Any, bucket: str, node: FleetNode) -> list[str]:
    """What the bytes say of a node called safe: each file of its roots kept in every destination."""
    lost = []
    for path, body in node.sources.items():
        local = node.dest / CATEGORY / str(path).lstrip("/")
        try:
            if local.read_bytes() != body:
                lost.append(f"{local}: other bytes")
        except OSError as exc:
            lost.append(f"{local}: {exc.strerror}")
        if node.url is not None:
            loc = parse_s3_url(node.url)
            key = f"{loc.prefix}/{CATEGORY}/{str(path).lstrip('/')}"
            try:
                got = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            except Exception as exc:  # noqa: BLE001 - the truth names it
                lost.append(f"s3://{bucket}/{key}: {type(exc).__name__}")
                continue
            if got != body:
                lost.append(f"s3://{bucket}/{key}: other bytes")
    for path in node.skipped:  # left out by the rule: never copied
        if (node.dest / CATEGORY / str(path).lstrip("/")).exists():
            lost.append(f"{path}: excluded, but copied")
    return lost


FLEET_WORKERS = 8  # cases run side by side, each worker on its own agent connection: mostly waits


@pytest.fixture(scope="module")
def fleet_world(s3_endpoint: Any) -> Iterator[tuple[list[Any], Any, str, str]]:
    conns = [open_connection(parse_host_url("local://")) for _ in range(FLEET_WORKERS)]
    client = s3_endpoint.client()
    try:
        yield conns, client, s3_endpoint.make_bucket("fleet"), str(client.meta.endpoint_url)
    finally:
        for c in conns:
            c.close()


def _fleet_case(conn: Any, client: Any, bucket: str, endpoint: str, seed: int, stats: dict[str, int]) -> None:
    """One fleet, seeded: build, run each node in turn, check the properties from the bytes."""
    import random

    rng = random.Random(seed)
    d = Path(tempfile.mkdtemp(prefix=f"fleet{seed}-"))
    story: list[str] = []
    try:
        nodes = _fleet(rng, d, bucket, seed)
        safe: list[FleetNode] = []
        for i, node in enumerate(nodes):
            if i:
                story.append(_fleet_event(rng, rng.choice(nodes[:i]), client, bucket))
            ok, why = _fleet_run(conn, client, endpoint, node)
            story.append(
                f"{node.name} dest={node.dest.relative_to(d)} url={node.url} in_s3={node.in_s3} "
                f"roots={[r.name for r in node.roots]} follow={node.follow} "
                f"empty_ok={node.expected_empty} mid={node.me['machine_id'][-4:]}: {'safe' if ok else why[:300]}"
            )
            stats["safe" if ok else "refused" if why.startswith("refused") else "not safe"] += 1
            if not ok:
                continue
            safe.append(node)
            for s in safe:  # the properties, from the bytes, for every node called safe so far
                lost = _fleet_truth(client, bucket, s)
                assert not lost, f"{s.name} was called safe, then {lost}\n" + "\n".join(story)
            names = [r.name for r in node.roots]
            # a link root not followed, or an empty root not expected, is never safe
            assert node.follow or "link" not in names, "a link root not followed was safe\n" + "\n".join(
                story
            )
            assert node.expected_empty or "empty" not in names, "an empty root was safe\n" + "\n".join(story)
            if node.url and node.in_s3:  # no run writes inside its own in_s3 location
                inside = (node.url.rstrip("/") + "/").startswith(node.in_s3.rstrip("/") + "/")
                assert not inside, f"{node.name} wrote inside its in_s3\n" + "\n".join(story)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_fleets_touch_only_their_own_data_and_account_for_every_root(fleet_world: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    conns, client, bucket, endpoint = fleet_world
    started = time.monotonic()
    stats = {"safe": 0, "refused": 0, "not safe": 0}
    seeds = list(range(FLEET_SEED, FLEET_SEED + FLEET_CASES))
    failures: list[str] = []

    def worker(w: int) -> None:
        for seed in seeds[w::FLEET_WORKERS]:
            try:
                _fleet_case(conns[w], client, bucket, endpoint, seed, stats)
            except AssertionError as exc:
                failures.append(f"seed {seed} (GPUHOST_FLEET_SEED={seed} GPUHOST_FLEET_CASES=1): {exc}")

    with ThreadPoolExecutor(max_workers=FLEET_WORKERS) as pool:
        list(pool.map(worker, range(FLEET_WORKERS)))
    took = time.monotonic() - started
    print(f"fleet cases: {FLEET_CASES}, nodes {stats}, {took:.1f} s")
    assert not failures, f"{len(failures)} of {FLEET_CASES} fleets broke a property; first:\n{failures[0]}"
    assert stats["safe"] and stats["refused"], stats  # both sides of the gate were taken

"""A run touches only its own node's data: ownership as a proof, places compared by components.

Pure functions of pytest_gpuhost/modules/backup/ownership.py first, then the decommission suite
on `local://` (a corrupt, lost or cloned owner record; overlapping places), each refused in one
line before the first step with nothing written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from pytest_gpuhost.modules.backup.ownership import (
    CLASH,
    FREE,
    MINE,
    OTHER,
    UNKNOWN,
    judge,
    local_ownership,
    node_identity,
    overlap_problems,
    place_of,
)
from tests.decommission.test_decommission_notes import NVIDIA_SMI_OK, _node
from tests.decommission.test_decommission_preflight import _s3_manifest, _suite

ME = node_identity("gpu-01", "ubuntu", "a" * 32, "2026-01-01T00:00:00Z", host_key="k" * 32)


@pytest.mark.parametrize(
    ("theirs", "status"),
    [
        (None, FREE),
        (dict(ME), MINE),
        (dict(ME, claimed="later"), MINE),
        (dict(ME, machine_id="b" * 32), OTHER),
        (dict(ME, machine_id="b" * 32, target="gpu-02"), OTHER),
        # one image cloned onto two machines: the same machine-id, another name or host key
        (dict(ME, target="gpu-02"), CLASH),
        (dict(ME, host_key="h" * 32), CLASH),
        (dict(ME, node_name="rack3-7"), MINE),  # a field only one side has is not compared
        ({"target": "gpu-01", "hostname": "ubuntu"}, MINE),  # an old record without machine-id
        ({"target": "gpu-02", "hostname": "ubuntu"}, OTHER),
        ({"note": "hello"}, UNKNOWN),
        ([1, 2], UNKNOWN),
        ("text", UNKNOWN),
    ],
)
def test_identity_is_every_field_both_records_carry(theirs, status) -> None:
    assert judge(theirs, ME).status == status


def test_node_name_differs_is_another_node_or_a_clash() -> None:
    me = dict(ME, node_name="rack1-1")
    assert judge(dict(ME, node_name="rack1-2"), me).status == CLASH
    assert judge(dict(ME, node_name="rack1-2", machine_id="c" * 32), me).status == OTHER


def _backup_dir(tmp_path: Path, record: object = None, timeline: list[str] | None = None) -> Path:
    d = tmp_path / "b"
    (d / ".gpuhost").mkdir(parents=True)
    (d / "data").mkdir()
    (d / "data" / "f").write_text("x")
    (d / ".gpuhost" / "state.json").write_text('{"version": 1, "items": {}}')
    if record is not None:
        (d / ".gpuhost" / "node.json").write_text(record if isinstance(record, str) else json.dumps(record))
    if timeline is not None:
        (d / ".gpuhost" / "timeline.jsonl").write_text(
            "".join(json.dumps({"t": "x", "target": t, "event": "e"}) + "\n" for t in timeline)
        )
    return d


def test_absent_or_empty_is_free_and_a_stranger_directory_is_not(tmp_path: Path) -> None:
    assert local_ownership(tmp_path / "none", ME).status == FREE
    (tmp_path / "empty").mkdir()
    assert local_ownership(tmp_path / "empty", ME).status == FREE
    (tmp_path / "stranger").mkdir()
    (tmp_path / "stranger" / "report.pdf").write_text("x")
    own = local_ownership(tmp_path / "stranger", ME)
    assert own.status == UNKNOWN and "no backup run made" in own.why


@pytest.mark.parametrize("record", ["{not json", "", "\x00\x01", "[]"])
def test_a_corrupt_owner_record_is_not_no_owner(tmp_path: Path, record: str) -> None:
    d = _backup_dir(tmp_path, record, timeline=["gpu-01"])
    own = local_ownership(d, ME)
    assert own.status == UNKNOWN and not own.usable, own


def test_an_unreadable_owner_record_is_not_no_owner(tmp_path: Path) -> None:
    d = _backup_dir(tmp_path, dict(ME), timeline=["gpu-01"])
    (d / ".gpuhost" / "node.json").unlink()
    (d / ".gpuhost" / "node.json").mkdir()  # EISDIR: readable by nobody
    own = local_ownership(d, ME)
    assert own.status == UNKNOWN and "cannot be read" in own.why


def test_a_lost_record_is_judged_by_the_timeline_and_state(tmp_path: Path) -> None:
    assert local_ownership(_backup_dir(tmp_path / "1", timeline=["gpu-01"]), ME).status == MINE
    other = local_ownership(_backup_dir(tmp_path / "2", timeline=["gpu-02", "gpu-02"]), ME)
    assert other.status == OTHER and "gpu-02" in other.why
    assert local_ownership(_backup_dir(tmp_path / "3", timeline=["gpu-01", "gpu-02"]), ME).status == OTHER
    assert local_ownership(_backup_dir(tmp_path / "4"), ME).status == UNKNOWN  # state, no timeline
    d = _backup_dir(tmp_path / "5", timeline=["gpu-01"])
    (d / ".gpuhost" / "timeline.jsonl").write_text('garbage\n{"target": "gpu-01"}\n')
    assert local_ownership(d, ME).status == UNKNOWN


@pytest.mark.parametrize(
    ("a", "b", "overlap"),
    [
        ("s3://b/p", "s3://b/p/x", True),
        ("s3://b/p", "s3://b/px", False),
        ("s3://b/p/", "s3://b/p", True),
        ("s3://b//p", "s3://b/p/", True),
        ("s3://b", "s3://b/anything", True),
        ("s3://b/p", "s3://c/p", False),
        ("s3://b/p/x/y", "s3://b/p/x", True),
        ("/srv/a", "/srv/a/b", True),
        ("/srv/a", "/srv/ab", False),
        ("/srv/a/../a/b", "/srv/a", True),
        ("/srv/a", "s3://srv/a", False),
    ],
)
def test_places_overlap_by_components_not_strings(a: str, b: str, overlap: bool) -> None:
    pa, pb = place_of(a, a, writes=True), place_of(b, b, writes=False)
    assert pa.overlaps(pb) is overlap and pb.overlaps(pa) is overlap
    assert bool(overlap_problems([pa, pb])) is overlap


def test_a_symlinked_backup_dir_is_the_directory_it_names(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    a = place_of(str(tmp_path / "link" / "n1"), "a", writes=True)
    b = place_of(str(tmp_path / "real"), "b", writes=True)
    assert a.overlaps(b)


def test_two_readers_do_not_overlap_a_reader_and_a_writer_do() -> None:
    r1 = place_of("s3://pipe/data", "in_s3 x", writes=False, target="a")
    r2 = place_of("s3://pipe/data", "in_s3 x", writes=False, target="b")
    assert overlap_problems([r1, r2]) == []
    w = place_of("s3://pipe/data/backup", "--backup-to", writes=True, target="a")
    assert overlap_problems([r1, r2, w]) and "contains" in overlap_problems([r1, w])[0]


# ---------------------------------------------------------------- the suite, on local://


def _s3_node(tmp_path: Path, s3_endpoint, bucket: str) -> tuple[Path, dict[str, str], tuple[str, ...]]:
    manifest, env = _node(tmp_path, NVIDIA_SMI_OK, ())
    doc = yaml.safe_load(manifest.read_text())
    doc["categories"]["stuff"]["s3"] = True
    manifest.write_text(yaml.safe_dump(doc))
    args = (f"--manifest={manifest}", f"--backup-to=s3://{bucket}/node", f"--s3-endpoint={s3_endpoint.url}")
    return manifest, {**env, **s3_endpoint.env}, args


def _tree(d: Path) -> list[tuple[str, bytes]]:
    return sorted((str(p.relative_to(d)), p.read_bytes() if p.is_file() else b"") for p in d.rglob("*"))


def test_a_corrupt_owner_record_is_refused_not_claimed(s3_endpoint, tmp_path) -> None:
    bucket = s3_endpoint.make_bucket("corrupt")
    _, env, args = _s3_node(tmp_path, s3_endpoint, bucket)
    r = _suite(tmp_path, env, *args)
    assert r.returncode == 0, r.stdout[-3000:]
    owner = tmp_path / "backup" / ".gpuhost" / "node.json"
    owner.write_text('{"target": "gpu-a", "machine_id": "01234')  # torn: another node's, cut
    before = _tree(tmp_path / "backup")
    r = _suite(tmp_path, env, *args)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "is not JSON (corrupt)" in out and "Traceback" not in out, out[-3000:]
    assert _tree(tmp_path / "backup") == before  # not claimed: nothing written, the record as it was


def test_a_lost_record_of_another_node_is_refused(s3_endpoint, tmp_path) -> None:
    bucket = s3_endpoint.make_bucket("lost")
    _, env, args = _s3_node(tmp_path, s3_endpoint, bucket)
    assert _suite(tmp_path, env, *args).returncode == 0
    meta = tmp_path / "backup" / ".gpuhost"
    (meta / "node.json").unlink()
    # the same node again: its timeline names only it, so the record is written back
    r = _suite(tmp_path, env, *args)
    assert r.returncode == 0 and (meta / "node.json").exists(), r.stdout[-3000:]
    (meta / "node.json").unlink()
    lines = (meta / "timeline.jsonl").read_text().splitlines()
    (meta / "timeline.jsonl").write_text(
        "".join(json.dumps(dict(json.loads(x), target="gpu-a")) + "\n" for x in lines)
    )
    before = _tree(tmp_path / "backup")
    r = _suite(tmp_path, env, *args)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "has no owner record; its timeline names gpu-a" in out, out[-3000:]
    assert _tree(tmp_path / "backup") == before


def test_a_cloned_machine_is_refused_by_its_other_name(s3_endpoint, tmp_path) -> None:
    """The same machine-id (one image, two machines) but another target name: a clash, refused,
    for the backup directory and for the --backup-to prefix alike."""
    bucket = s3_endpoint.make_bucket("clone")
    _, env, args = _s3_node(tmp_path, s3_endpoint, bucket)
    assert _suite(tmp_path, env, *args).returncode == 0
    owner = tmp_path / "backup" / ".gpuhost" / "node.json"
    twin = dict(json.loads(owner.read_text()), target="gpu-twin")
    owner.write_text(json.dumps(twin))
    r = _suite(tmp_path, env, *args)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "the same machine-id as this node but another target" in out, out[-3000:]
    client = s3_endpoint.client()
    client.put_object(Bucket=bucket, Key="node2/.gpuhost/node.json", Body=json.dumps(twin).encode())
    client.put_object(Bucket=bucket, Key="node2/stuff/x", Body=b"twin's")
    r = _suite(
        tmp_path, env, *args[:1], f"--backup-to=s3://{bucket}/node2", args[2],
        f"--backup-dir={tmp_path / 'backup-2'}",
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1 and f"--backup-to s3://{bucket}/node2 holds the backup of gpu-twin" in out, out[
        -3000:
    ]
    assert client.get_object(Bucket=bucket, Key="node2/stuff/x")["Body"].read() == b"twin's"


def test_objects_without_an_owner_record_are_not_claimed(s3_endpoint, tmp_path) -> None:
    bucket = s3_endpoint.make_bucket("noowner")
    _, env, args = _s3_node(tmp_path, s3_endpoint, bucket)
    client = s3_endpoint.client()
    client.put_object(Bucket=bucket, Key="node/stuff/other.bin", Body=b"someone's")
    r = _suite(tmp_path, env, *args)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "holds objects but no owner record" in out, out[-3000:]
    assert [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]] == ["node/stuff/other.bin"]
    # a sibling prefix that only shares the string is not an overlap: nodeX is not node
    client.delete_object(Bucket=bucket, Key="node/stuff/other.bin")
    client.put_object(Bucket=bucket, Key="nodeX/stuff/other.bin", Body=b"someone's")
    assert _suite(tmp_path, env, *args).returncode == 0


def test_backup_to_inside_an_in_s3_location_is_refused_before_anything(s3_endpoint, tmp_path) -> None:
    bucket = s3_endpoint.make_bucket("overlap")
    env = {**os.environ, **s3_endpoint.env}
    manifest = _s3_manifest(tmp_path, f"s3://{bucket}/pipeline")
    r = _suite(
        tmp_path, env, f"--manifest={manifest}", f"--backup-to=s3://{bucket}/pipeline/backup",
        f"--s3-endpoint={s3_endpoint.url}",
    )  # fmt: skip
    err = r.stderr
    assert (
        r.returncode == 4
        and f"--backup-to s3://{bucket}/pipeline/backup lies inside in_s3 s3://{bucket}/pipeline of" in err
    ), r.stdout[-2000:] + err
    assert not (tmp_path / "backup").exists()
    r = _suite(
        tmp_path, env, f"--manifest={manifest}", f"--backup-to=s3://{bucket}/pipelinex",
        f"--s3-endpoint={s3_endpoint.url}",
    )  # fmt: skip
    assert r.returncode != 4 and "a run would write where" not in r.stderr, r.stderr  # the steps run


def test_an_object_at_an_in_s3_location_is_overwritten_only_when_this_node_wrote_it(s3_endpoint) -> None:
    from pytest_gpuhost.modules.backup.ownership import object_owner_tag
    from pytest_gpuhost.modules.backup.s3 import S3Item
    from suites.decommission.in_s3 import not_ours

    bucket = s3_endpoint.make_bucket("notours")
    client = s3_endpoint.client()
    mine, other = object_owner_tag(ME), object_owner_tag(dict(ME, target="gpu-02"))
    client.put_object(Bucket=bucket, Key="p/pipeline.bin", Body=b"the pipeline's")
    client.put_object(Bucket=bucket, Key="p/mine.bin", Body=b"x", Metadata={"gpuhost-owner": mine})
    client.put_object(Bucket=bucket, Key="p/other.bin", Body=b"y", Metadata={"gpuhost-owner": other})
    items = [
        S3Item(n, "0" * 64, 1, key=f"p/{n}") for n in ("pipeline.bin", "mine.bin", "other.bin", "gone.bin")
    ]
    ok, refused = not_ours(client, bucket, items, mine)
    assert [i.key for i in ok] == ["p/mine.bin", "p/gone.bin"]
    assert refused == ["p/pipeline.bin", "p/other.bin"]
    assert mine != other and object_owner_tag(dict(ME, host_key="h" * 32)) != mine  # a clone is not me

"""suites/decommission with the node's data already in S3 (manifest in_s3), on the b200-nvl8 lab host.

The node's pipeline put /data/data in the bucket with `aws s3 sync` before the hand-back, as on
the seed's node. The suite proves it there from the node's bytes and copies none of it; what is
missing or changed in the bucket is sent back to its own key; an object nothing can prove (SSE-KMS
without a checksum) keeps the node from being "safe", named.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from pytest_gpuhost.exec.s3io import make_client

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "fixtures" / "manifests" / "b200-node-backup.yaml"


@pytest.fixture(scope="module")
def b200(lab):
    return lab.host("b200-nvl8", data_scale="small")


def _pull(h, src: str, into: Path) -> None:
    """Copy a directory of the lab node here over real SSH (tar), as the pipeline's own copy."""
    r = subprocess.run([*h.ssh_argv(), f"tar -C {src} -cf - ."], capture_output=True, timeout=120, check=True)
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as t:
        t.extractall(into, filter="data")


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str, dict[str, int]]:
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|fixed|failed|skipped|would fix|error)", tail)}
    return r.returncode, r.stdout[-20000:] + r.stderr[-3000:], counts


def test_data_already_in_s3_is_proved_there_not_copied(b200, s3_endpoint, tmp_path, monkeypatch):
    h = b200
    h.reset()
    env = {**os.environ, **s3_endpoint.env}
    bucket = s3_endpoint.make_bucket("dflash")
    pipeline = tmp_path / "pipeline"
    _pull(h, "/data/data", pipeline)
    files = sorted(p for p in pipeline.rglob("*") if p.is_file())
    assert len(files) > 10
    aws = str(Path(sys.executable).with_name("aws"))
    subprocess.run(
        [aws, "--endpoint-url", s3_endpoint.url, "s3", "sync", str(pipeline), f"s3://{bucket}/dflash/"],
        env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    client = s3_endpoint.client()
    gone, changed = (str(p.relative_to(pipeline)) for p in files[:2])
    client.delete_object(Bucket=bucket, Key=f"dflash/{gone}")
    size = (pipeline / changed).stat().st_size
    client.put_object(Bucket=bucket, Key=f"dflash/{changed}", Body=os.urandom(size))  # same size, other bytes

    doc = yaml.safe_load(MANIFEST.read_text())
    doc["categories"]["data"] = {"roots": ["/data/data"], "in_s3": f"s3://{bucket}/dflash/"}
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    dest = tmp_path / "backup"
    argv = [
        sys.executable, "-m", "pytest", str(ROOT / "suites" / "decommission"), *h.pytest_args(),
        f"--manifest={manifest}", f"--backup-dir={dest}", f"--backup-to=s3://{bucket}/node",
        f"--s3-endpoint={s3_endpoint.url}", f"--report-dir={tmp_path / 'reports'}", "-p", "no:cacheprovider",
        "-q", "-o", "decommission_stall_timeout=10", "-o", "decommission_s3_part_mib=5",
    ]  # fmt: skip

    rc, out, counts = _run(argv, env)
    # the changed object is the pipeline's, not this node's: it is never overwritten (the node is
    # not safe, and says why); the missing one is absent, so it is sent back
    assert rc != 0 and "not overwritten: the object there is not this node's" in out, out
    body = client.get_object(Bucket=bucket, Key=f"dflash/{changed}")["Body"].read()
    assert body != (pipeline / changed).read_bytes()
    # only the missing and the changed file were copied off the node; the rest was proved in place
    local = sorted(
        p.relative_to(dest / "data" / "data" / "data") for p in (dest / "data").rglob("*") if p.is_file()
    )
    assert [str(p) for p in local] == sorted([gone, changed]), local
    body = client.get_object(Bucket=bucket, Key=f"dflash/{gone}")["Body"].read()
    assert body == (pipeline / gone).read_bytes()
    assert client.head_object(Bucket=bucket, Key=f"dflash/{gone}")["Metadata"]["gpuhost-owner"]
    # the pipeline puts its object right; the run then proves it in place
    client.put_object(Bucket=bucket, Key=f"dflash/{changed}", Body=(pipeline / changed).read_bytes())
    rc, out, counts = _run(argv, env)
    assert rc == 0, out
    notes = (dest / "NOTES.md").read_text()
    assert f"## Verified where it already was in S3 ({len(files)} of {len(files)})" in notes, notes
    assert "MD5 ETag (single-part upload)" in notes
    # nothing of data went under --backup-to
    assert client.list_objects_v2(Bucket=bucket, Prefix="node/data/").get("KeyCount", 0) == 0

    rc, out, counts = _run(argv, env)
    assert rc == 0 and counts.get("passed") == 8, out

    # an object that nothing can prove: same bytes, but SSE-KMS (ETag not an MD5) and no checksum
    kms = str(files[3].relative_to(pipeline))
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    raw = make_client(s3_endpoint.url)  # sends no checksum unless asked
    raw.put_object(
        Bucket=bucket, Key=f"dflash/{kms}", Body=(pipeline / kms).read_bytes(), ServerSideEncryption="aws:kms"
    )
    rc, out, counts = _run(argv, env)
    assert rc != 0, out
    assert "NOT safe to terminate" in out and kms in out and "aws:kms" in out, out

    # --in-s3-send-to=backup-to: what is not proved in place (the KMS object, one more deleted)
    # goes under --backup-to as a category marked s3 would, and the pipeline's bucket is untouched
    also_gone = str(files[4].relative_to(pipeline))
    client.delete_object(Bucket=bucket, Key=f"dflash/{also_gone}")
    rc, out, counts = _run([*argv, "--in-s3-send-to=backup-to"], env)
    assert rc == 0, out
    node_keys = {
        o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="node/data/").get("Contents", [])
    }
    assert node_keys == {f"node/data/data/data/{kms}", f"node/data/data/data/{also_gone}"}, node_keys
    for rel in (kms, also_gone):
        head = client.head_object(Bucket=bucket, Key=f"node/data/data/data/{rel}", ChecksumMode="ENABLED")
        assert head["ChecksumSHA256"], head
    assert client.head_object(Bucket=bucket, Key=f"dflash/{kms}").get("ServerSideEncryption") == "aws:kms"
    assert "KeyCount" in client.list_objects_v2(Bucket=bucket, Prefix=f"dflash/{also_gone}")
    assert client.list_objects_v2(Bucket=bucket, Prefix=f"dflash/{also_gone}")["KeyCount"] == 0
    notes = (dest / "NOTES.md").read_text()
    assert f"sent under --backup-to s3://{bucket}/node" in notes and "aws:kms" in notes, notes
    # the same run once more sends nothing: everything is proved, in place or under --backup-to
    rc, out, counts = _run([*argv, "--in-s3-send-to=backup-to"], env)
    assert rc == 0 and counts.get("passed") == 8, out
    # and without the flag the node is not safe again: the bucket still lacks the file
    rc, out, counts = _run(argv, env)
    assert rc != 0 and kms in out, out


def test_misses_go_under_backup_to_when_asked_on_local(s3_endpoint, tmp_path):
    """`--in-s3-send-to=backup-to` on local://: the file missing from the pipeline's bucket is sent
    under --backup-to and proved there; the pipeline's bucket is not written."""
    from tests.decommission.test_decommission_notes import NVIDIA_SMI_OK, _node
    from tests.decommission.test_decommission_preflight import _suite

    manifest, env = _node(tmp_path, NVIDIA_SMI_OK, (), kept=("b.txt",))
    root = tmp_path / "node"
    pipe, bk = s3_endpoint.make_bucket("pipe"), s3_endpoint.make_bucket("bk")
    client = s3_endpoint.client()
    client.put_object(Bucket=pipe, Key="p/small.txt", Body=(root / "small.txt").read_bytes())
    doc = yaml.safe_load(manifest.read_text())
    doc["categories"]["stuff"]["in_s3"] = f"s3://{pipe}/p/"
    manifest.write_text(yaml.safe_dump(doc))
    env = {**env, **s3_endpoint.env}
    args = (f"--manifest={manifest}", f"--backup-to=s3://{bk}/node", f"--s3-endpoint={s3_endpoint.url}")
    r = _suite(tmp_path, env, *args, "--in-s3-send-to=backup-to")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bk, Prefix="node/").get("Contents", [])]
    assert keys == ["node/.gpuhost/node.json", f"node/stuff{root}/b.txt"], keys
    assert [o["Key"] for o in client.list_objects_v2(Bucket=pipe)["Contents"]] == ["p/small.txt"]
    notes = (tmp_path / "backup" / "NOTES.md").read_text()
    assert f"sent under --backup-to s3://{bk}/node" in notes, notes

"""S3 side of the backup against moto's server on loopback (a real HTTP endpoint), through boto3."""

from __future__ import annotations

import hashlib
import json
import os

import boto3
import botocore.credentials
import pytest

from pytest_gpuhost.exec.s3io import make_client
from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.backup.local import Backup, Category, Manifest
from pytest_gpuhost.modules.backup.s3 import S3Upload, items_from_backup, key_for, parse_s3_url
from pytest_gpuhost.modules.process import Selection
from tests.helpers.s3server import start_moto, stop_moto


@pytest.fixture
def aws_env(s3_endpoint, monkeypatch):
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    return s3_endpoint


@pytest.fixture
def backed_up(tmp_path):
    """A verified local backup of a small tree with a large file, hostile names and a link."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(40):
        (src / "d" / f"f{i}.txt").write_bytes(os.urandom(100 + i))
    (src / "big.bin").write_bytes(os.urandom(7 * 1024 * 1024 + 3))
    with open(os.fsencode(src) + b"/new\nline \xff %41.txt", "wb") as f:
        f.write(b"hostile")
    os.symlink("/etc", src / "etc-link")
    conn = open_connection(parse_host_url("local://"))
    m = Manifest("t", (Category("data", (str(src),), s3=True),), Selection())
    b = Backup(conn, m, tmp_path / "dest")
    listing = b.walk()
    assert b.run(b.plan(listing)).ok
    yield b, listing
    conn.close()


def test_key_escaping_is_reversible_and_safe():
    assert key_for("data/a b$(x)'q\".txt") == "data/a b$(x)'q\".txt"
    assert key_for(os.fsdecode(b"data/new\nline \xff %41")) == "data/new%0Aline %FF %2541"


def test_upload_verify_rerun_and_multipart_hygiene(aws_env, backed_up):
    b, listing = backed_up
    bucket = aws_env.make_bucket("bk")
    loc = parse_s3_url(f"s3://{bucket}/node-a")
    client = aws_env.client()
    # an upload left open by an interrupted run of this backup (its journal names the upload id)
    stale = client.create_multipart_upload(Bucket=bucket, Key="node-a/data/stale", ChecksumAlgorithm="SHA256")
    up = S3Upload(b.dest, loc, endpoint=aws_env.url, workers=4, part_size=5 * 1024 * 1024)
    up._record_upload("node-a/data/stale", stale["UploadId"])
    # uploads this backup did not start: another tool's under the prefix, a sibling prefix's
    theirs = client.create_multipart_upload(Bucket=bucket, Key="node-a/data/theirs")
    sibling = client.create_multipart_upload(Bucket=bucket, Key="node-ab/data/x")
    items, unverified = items_from_backup(b, listing)
    assert not unverified and len(items) == 43
    res = up.run(up.plan(items))
    assert res.ok, res.failed
    assert res.uploaded == 43 and res.aborted_uploads == ["node-a/data/stale"]
    left = {
        (u["Key"], u["UploadId"]) for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    }
    assert left == {("node-a/data/theirs", theirs["UploadId"]), ("node-ab/data/x", sibling["UploadId"])}
    for key, uid in left:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=uid)
    # the first single-request upload went through boto3, the other 41 (hostile names too) through
    # SignedPut; the checks below read every object back through boto3
    assert up.fast_puts == 41
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert up.verify(items, deep=True) == []
    # what is in the bucket is what the node had
    for f in listing.files:
        key = loc.key(key_for(f.key))
        obj = client.get_object(Bucket=bucket, Key=key)
        body = obj["Body"].read()
        if f.kind == "l":
            assert body == b"/etc" and obj["Metadata"]["symlink"] == "1"
        else:
            assert hashlib.sha256(body).hexdigest() == b.state.items[f.key]["sha256"]
            assert obj["Metadata"]["sha256"] == b.state.items[f.key]["sha256"]
    up.finish()
    del stale
    # a rerun uploads nothing
    up2 = S3Upload(b.dest, loc, endpoint=aws_env.url)
    plan = up2.plan(items)
    assert plan.upload == [] and len(plan.current) == 43
    # an object replaced behind our back is found and uploaded again
    big = next(i for i in items if i.rel.endswith("big.bin"))
    client.put_object(Bucket=bucket, Key=loc.key(key_for(big.rel)), Body=b"not the file")
    assert [p for p, _ in up2.verify(items)] == [big.rel]
    plan = up2.plan(items)
    assert [i.rel for i in plan.upload] == [big.rel]
    assert up2.run(plan).ok and up2.verify(items) == []


def test_signed_put_is_accepted_by_a_server_that_checks_signatures(backed_up, tmp_path, monkeypatch):
    """SignedPut's requests carry a valid SigV4 signature: moto checks it once auth is on.

    moto checks signatures after INITIAL_NO_AUTH_ACTION_COUNT requests; the first four make a
    user, its key, its policy and the bucket.  moto's own check refuses keys with spaces or
    non-ASCII characters, and listings, even from boto3, so only plain names are uploaded here;
    the hostile names are covered (without signature checks) by the test above.
    """
    b, listing = backed_up
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "4")
    moto, url = start_moto(tmp_path / "moto.log")
    try:
        admin = dict(endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing")  # fmt: skip
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="backup")
        key = iam.create_access_key(UserName="backup")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="backup", PolicyName="all", PolicyDocument=json.dumps(policy))
        boto3.client("s3", **admin).create_bucket(Bucket="signed")
        # the client S3Upload makes for itself, with the new user's key
        client = boto3.client(
            "s3",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id=key["AccessKeyId"],
            aws_secret_access_key=key["SecretAccessKey"],
            config=make_client(url, sign_payload=False).meta.config,
        )
        items, _ = items_from_backup(b, listing)
        plain = [i for i in items if i.rel.rsplit("/", 2)[1] == "d"]
        assert len(plain) == 40
        up = S3Upload(b.dest, parse_s3_url("s3://signed/n"), client=client)
        # one object after the other, as an upload worker does (moto's signature check also
        # refuses boto3's own listings, so run() with its listings cannot be used here)
        for item in plain:
            rec = up._upload_one(item, lambda n: None)
            body = client.get_object(Bucket="signed", Key=rec["key"])["Body"].read()
            assert hashlib.sha256(body).hexdigest() == item.sha256
        assert up.fast_puts == 39
        # the server does check: the same path with a wrong secret is refused, and turns itself off
        fast = up._fast
        assert fast is not None and fast.enabled
        monkeypatch.setattr(fast, "_creds", botocore.credentials.Credentials(key["AccessKeyId"], "wrong"))
        assert fast.put("n/refused", b"x", {}) is None and not fast.enabled
    finally:
        stop_moto(moto)


def test_local_copy_corrupted_after_verification_is_refused(aws_env, backed_up):
    b, listing = backed_up
    bucket = aws_env.make_bucket("bk")
    items, _ = items_from_backup(b, listing)
    victim = next(i for i in items if i.rel.endswith("f3.txt"))
    with open(b.dest / victim.rel, "r+b") as f:
        f.write(b"X")
    up = S3Upload(b.dest, parse_s3_url(f"s3://{bucket}/p"), endpoint=aws_env.url)
    res = up.run(up.plan(items))
    assert [p for p, _ in res.failed] == [victim.rel]
    assert "no longer matches" in res.failed[0][1]
    assert [p for p, _ in up.verify(items)] == [victim.rel]


def test_sparse_file_is_sparse_locally_and_whole_in_s3(aws_env, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "disk.img", "wb") as f:
        f.truncate(12 * 1024 * 1024)
        f.seek(6 * 1024 * 1024)
        f.write(os.urandom(4096))
    conn = open_connection(parse_host_url("local://"))
    try:
        m = Manifest("t", (Category("data", (str(src),), s3=True),), Selection())
        b = Backup(conn, m, tmp_path / "dest")
        listing = b.walk()
        assert b.run(b.plan(listing)).ok
    finally:
        conn.close()
    (f,) = listing.files
    rec = b.state.items[f.key]
    assert rec["s"] == 12 * 1024 * 1024 and rec["a"] < 1024 * 1024  # a hole here too
    bucket = aws_env.make_bucket("sparse")
    loc = parse_s3_url(f"s3://{bucket}/n")
    up = S3Upload(b.dest, loc, endpoint=aws_env.url, part_size=5 * 1024 * 1024)
    items, _ = items_from_backup(b, listing)
    assert up.run(up.plan(items)).ok
    body = aws_env.client().get_object(Bucket=bucket, Key=loc.key(key_for(f.key)))["Body"].read()
    assert len(body) == 12 * 1024 * 1024 and body == (src / "disk.img").read_bytes()
    assert hashlib.sha256(body).hexdigest() == rec["sha256"]


def test_an_object_this_backup_did_not_verify_is_not_counted(aws_env, backed_up):
    """An object with the right key and size that no run of ours checked against the node's SHA-256."""
    b, listing = backed_up
    bucket = aws_env.make_bucket("foreign")
    loc = parse_s3_url(f"s3://{bucket}/node-a")
    client = aws_env.client()
    items, _ = items_from_backup(b, listing)
    item = next(i for i in items if i.rel.endswith("f3.txt"))
    client.put_object(Bucket=bucket, Key=loc.key(key_for(item.rel)), Body=b"x" * item.size)
    up = S3Upload(b.dest, loc, endpoint=aws_env.url)
    found = dict(up.verify([item]))
    assert found == {item.rel: "in the bucket but not verified against the node's SHA-256"}

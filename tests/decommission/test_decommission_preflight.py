"""S3 destinations of suites/decommission checked before anything is stopped, and told in one line.

`location_problem` (pytest_gpuhost/exec/s3io.py) against moto's server: a missing bucket, wrong
credentials (moto checks them only with its IAM authentication on: `INITIAL_NO_AUTH_ACTION_COUNT=0`,
a server of its own here), no credentials, an endpoint where nothing listens. Then the suite itself
on `local://`: refused as a usage error before the first step, and a bucket that vanishes under the
run is a problem line of the verdict, never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from botocore.stub import Stubber

from pytest_gpuhost.exec.s3io import location_problem, s3_problem
from suites.decommission.notes import STEPS, verdict
from suites.decommission.preflight import space_problem
from tests.decommission.test_decommission_notes import NVIDIA_SMI_OK, _node
from tests.helpers.s3server import FAKE_ENV, start_moto, stop_moto

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _client(url: str, key: str = "testing", secret: str = "testing") -> Any:
    return boto3.client(
        "s3", endpoint_url=url, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1"
    )


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3's credential chain gives moto's fake credentials (as the suite's environment does)."""
    for k, v in FAKE_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def moto_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A moto server that checks access keys against its IAM users (it has none: every key is wrong)."""
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    try:
        proc, url = start_moto(tmp_path_factory.mktemp("moto-auth") / "moto.log")
    finally:
        del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
    try:
        yield url
    finally:
        stop_moto(proc)


def test_a_readable_location_is_fine_and_nothing_is_written(s3_endpoint, aws_env) -> None:
    bucket = s3_endpoint.make_bucket("pre")
    assert location_problem(f"s3://{bucket}/node/b200", endpoint=s3_endpoint.url) is None
    assert location_problem(f"s3://{bucket}", endpoint=s3_endpoint.url) is None
    assert s3_endpoint.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_no_such_bucket_is_one_line(s3_endpoint, aws_env) -> None:
    why = location_problem("s3://no-such-bucket-here/p", endpoint=s3_endpoint.url)
    assert why == "no such bucket (NoSuchBucket)"


def test_wrong_credentials_are_named_with_what_to_check(moto_with_auth) -> None:
    """moto refuses HeadBucket with a bare 403 (as S3 does); the listing's code says which key is wrong."""
    client = _client(moto_with_auth, key="AKIAWRONGWRONGWRONG1", secret="wrong")
    why = location_problem("s3://any-bucket/p", client=client)
    assert why == "access denied (InvalidAccessKeyId): check AWS_ACCESS_KEY_ID / the profile"


def test_no_credentials_at_all(s3_endpoint, monkeypatch, tmp_path) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # it caches the credentials it found earlier
    why = location_problem("s3://b/p", endpoint=s3_endpoint.url)
    assert why is not None and why.startswith(
        "no usable credentials (NoCredentialsError): set AWS_ACCESS_KEY_ID"
    )


def test_an_endpoint_where_nothing_listens_answers_in_seconds(aws_env) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    why = location_problem("s3://b/p", endpoint=url)
    assert (
        why == f"cannot reach {url} (EndpointConnectionError): check --s3-endpoint, the network and proxies"
    )
    assert time.monotonic() - started < 20


def test_a_listing_allowed_where_headbucket_is_refused_is_fine() -> None:
    """A policy granting s3:ListBucket only under an `s3:prefix`: HeadBucket 403, the listing works."""
    client = _client("http://127.0.0.1:9")
    with Stubber(client) as stub:
        stub.add_client_error("head_bucket", "403", "Forbidden", 403)
        stub.add_response("list_objects_v2", {"KeyCount": 0, "IsTruncated": False})
        assert location_problem("s3://b/p", client=client) is None
    with Stubber(client) as stub:
        stub.add_client_error("head_bucket", "403", "Forbidden", 403)
        stub.add_client_error("list_objects_v2", "SignatureDoesNotMatch", "The signature...", 403)
        why = location_problem("s3://b/p", client=client)
        assert why == "access denied (SignatureDoesNotMatch): check AWS_SECRET_ACCESS_KEY / the profile"
    with Stubber(client) as stub:
        stub.add_client_error("head_bucket", "301", "Moved Permanently", 301)
        stub.add_client_error("list_objects_v2", "PermanentRedirect", "The bucket...\nmore", 301)
        why = location_problem("s3://b/p", client=client)
        assert why is not None and why.startswith("the bucket is in another region (PermanentRedirect)")


def test_every_problem_is_one_line() -> None:
    class Odd(Exception):
        response = {"Error": {"Code": "SlowDown", "Message": "Please\nreduce \x1b[2J your rate"}}

    assert s3_problem(Odd()) == "refused (SlowDown): Please"
    assert s3_problem(ValueError("a\nb")) == "ValueError: a"


def test_room_at_the_backup_dir_is_the_bytes_to_copy_against_its_filesystems_free_space(tmp_path) -> None:
    """Step 1's room check: more bytes than the filesystem has free is one line; what fits is none."""
    dest = tmp_path / "not-made-yet" / "node"  # asked of the nearest folder that exists
    free = shutil.disk_usage(tmp_path).free
    why = space_problem(dest, free * 2)
    assert why is not None and "GB free on its filesystem" in why and str(dest) in why, why
    assert "\n" not in why
    assert space_problem(dest, 1) is None
    assert space_problem(dest, 0) is None


def test_the_verdict_lists_an_unreadable_destination_as_one_problem() -> None:
    problems = verdict(
        dict.fromkeys(STEPS, "passed"),
        running=[],
        local_missing=[],
        s3_categories=["data"],
        s3_unreadable=["--backup-to s3://b/p: no such bucket (NoSuchBucket)"],
    )
    assert problems == ["S3 not readable: --backup-to s3://b/p: no such bucket (NoSuchBucket)"]


def _suite(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(ROOT / "suites" / "decommission"),
            "--host=local://",
            f"--backup-dir={tmp_path / 'backup'}",
            "--report-dir=none",
            "-p",
            "no:cacheprovider",
            "-q",
            *args,
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _s3_manifest(tmp_path: Path, in_s3: str) -> Path:
    """One category marked s3 and one already in S3 (in_s3), both over one temporary root."""
    root = tmp_path / "node"
    root.mkdir(exist_ok=True)
    (root / "a.txt").write_text("a")
    doc = {
        "name": "preflight",
        "stop": {"match": [{"name": "nothing", "argv0": "no-such-server-binary"}]},
        "categories": {
            "kept": {"roots": [str(root)], "s3": True},
            "there": {"roots": [str(root)], "in_s3": in_s3},
        },
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_suite_refuses_unreadable_destinations_before_the_first_step(s3_endpoint, tmp_path) -> None:
    """Each destination that cannot be read is one line of a usage error; nothing runs, nothing is made."""
    bucket = s3_endpoint.make_bucket("pre")
    env = {**os.environ, **s3_endpoint.env}
    manifest = _s3_manifest(tmp_path, "s3://no-such-pipeline-bucket/dflash/")
    r = _suite(
        tmp_path, env, f"--manifest={manifest}", "--backup-to=s3://no-such-backup-bucket/node",
        f"--s3-endpoint={s3_endpoint.url}",
    )  # fmt: skip
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        "ERROR: gpuhost: --backup-to s3://no-such-backup-bucket/node: no such bucket (NoSuchBucket)",
        "gpuhost: in_s3 s3://no-such-pipeline-bucket/dflash/ of category there: no such bucket (NoSuchBucket)",
    ], r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "botocore" not in r.stdout + r.stderr
    assert not (tmp_path / "backup").exists()
    # only the wrong one is named
    r = _suite(
        tmp_path,
        env,
        f"--manifest={manifest}",
        f"--backup-to=s3://{bucket}/node",
        f"--s3-endpoint={s3_endpoint.url}",
    )
    assert r.returncode == 4 and r.stderr.count("gpuhost:") == 1 and "of category there" in r.stderr, r.stderr


def test_the_suite_refuses_wrong_credentials_in_one_line(moto_with_auth, tmp_path) -> None:
    env = {**os.environ, **FAKE_ENV, "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG1"}
    manifest = _s3_manifest(tmp_path, "s3://pipeline/dflash/")
    doc = yaml.safe_load(manifest.read_text())
    del doc["categories"]["there"]
    manifest.write_text(yaml.safe_dump(doc))
    r = _suite(
        tmp_path, env, f"--manifest={manifest}", "--backup-to=s3://b/node", f"--s3-endpoint={moto_with_auth}"
    )
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        "ERROR: gpuhost: --backup-to s3://b/node: access denied (InvalidAccessKeyId): "
        "check AWS_ACCESS_KEY_ID / the profile"
    ], r.stderr
    assert not (tmp_path / "backup").exists()


BUCKET_GONE = '''
"""Empty and delete the run's bucket just before the verdict: S3 fails under a running suite."""
import json
import os

import boto3


def pytest_runtest_setup(item):
    if item.name.startswith(os.environ.get("GONE_BEFORE", "test_safe_to_terminate")):
        c = boto3.client("s3", endpoint_url=os.environ["GONE_ENDPOINT"])
        bucket = os.environ["GONE_BUCKET"]
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                c.delete_object(Bucket=bucket, Key=o["Key"])
        c.delete_bucket(Bucket=bucket)
'''


def _bucket_gone_node(s3_endpoint, tmp_path: Path, bucket: str, **extra: str) -> tuple[Path, dict[str, str]]:
    """A local:// node with one category marked s3, and a plugin (bucket_gone.py) in its run that
    deletes the bucket before the test named by GONE_BEFORE (default: the verdict)."""
    manifest, env = _node(tmp_path, NVIDIA_SMI_OK, ())
    doc = yaml.safe_load(manifest.read_text())
    doc["categories"]["stuff"]["s3"] = True
    manifest.write_text(yaml.safe_dump(doc))
    (tmp_path / "bucket_gone.py").write_text(BUCKET_GONE)
    env = {
        **env,
        **s3_endpoint.env,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}",
        "GONE_ENDPOINT": s3_endpoint.url,
        "GONE_BUCKET": bucket,
        **extra,
    }
    return manifest, env


def test_the_verdict_names_a_bucket_gone_under_the_run_in_one_line(s3_endpoint, tmp_path) -> None:
    """Every step passes and uploads; the bucket is deleted before the verdict: one problem line."""
    bucket = s3_endpoint.make_bucket("gone")
    manifest, env = _bucket_gone_node(s3_endpoint, tmp_path, bucket)
    r = _suite(
        tmp_path, env, f"--manifest={manifest}", f"--backup-to=s3://{bucket}/node",
        f"--s3-endpoint={s3_endpoint.url}", "-p", "bucket_gone",
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-5000:]
    assert r.stdout.strip().splitlines()[-1].startswith("1 failed"), out[-5000:]  # the verdict only
    assert f"S3 not readable: --backup-to s3://{bucket}/node: no such bucket (NoSuchBucket)" in out, out[
        -5000:
    ]
    assert "Traceback" not in out and "botocore" not in out and "ClientError" not in out, out[-5000:]
    notes = (tmp_path / "backup" / "NOTES.md").read_text()
    assert "## Not safe to terminate" not in notes  # step 6 wrote it; the verdict leaves it


def test_a_bucket_gone_before_the_s3_step_is_one_line_there_too(s3_endpoint, tmp_path) -> None:
    """The bucket is deleted after the backup, before step 5 asks it what to upload."""
    bucket = s3_endpoint.make_bucket("gone5")
    manifest, env = _bucket_gone_node(s3_endpoint, tmp_path, bucket, GONE_BEFORE="test_data_in_s3")
    r = _suite(
        tmp_path, env, f"--manifest={manifest}", f"--backup-to=s3://{bucket}/node",
        f"--s3-endpoint={s3_endpoint.url}", "-p", "bucket_gone",
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-5000:]
    assert "Traceback" not in out and "botocore" not in out and "ClientError" not in out, out[-5000:]
    assert f"--backup-to s3://{bucket}/node: no such bucket (NoSuchBucket)" in out, out[-5000:]
    assert "NOT safe to terminate" in out, out[-5000:]


def test_a_destination_of_another_node_is_refused_before_anything_stops(s3_endpoint, tmp_path) -> None:
    """Node A's run wrote the backup directory and the --backup-to prefix; node B's run, later,
    with the same places, is refused in one line naming A, and writes nothing there."""
    bucket = s3_endpoint.make_bucket("own")
    manifest, env = _node(tmp_path, NVIDIA_SMI_OK, ())
    doc = yaml.safe_load(manifest.read_text())
    doc["categories"]["stuff"]["s3"] = True
    manifest.write_text(yaml.safe_dump(doc))
    env = {**env, **s3_endpoint.env}
    args = (f"--manifest={manifest}", f"--backup-to=s3://{bucket}/node", f"--s3-endpoint={s3_endpoint.url}")
    r = _suite(tmp_path, env, *args)
    assert r.returncode == 0, r.stdout[-3000:]
    owner = tmp_path / "backup" / ".gpuhost" / "node.json"
    mine = json.loads(owner.read_text())
    assert mine["machine_id"] == Path("/etc/machine-id").read_text().strip() and mine["target"] == "local"
    client = s3_endpoint.client()
    assert json.loads(client.get_object(Bucket=bucket, Key="node/.gpuhost/node.json")["Body"].read()) == mine
    r = _suite(tmp_path, env, *args)  # the same node again: its own places
    assert r.returncode == 0 and "8 passed" in r.stdout, r.stdout[-3000:]

    # the backup directory now holds another node's backup (its run wrote this record)
    other = dict(mine, target="gpu-a", hostname="gpu-a", machine_id="0123456789abcdef0123456789abcdef")
    owner.write_text(json.dumps(other))
    before = sorted(p.name for p in (tmp_path / "backup").rglob("*"))
    r = _suite(tmp_path, env, *args)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "6 skipped, 2 errors" in r.stdout, out[-3000:]
    assert "During handling" not in out
    assert (
        f"--backup-dir {tmp_path / 'backup'} holds the backup of gpu-a (hostname gpu-a, machine-id 0123456789ab"
        in out
    )
    assert "Traceback" not in out
    assert sorted(p.name for p in (tmp_path / "backup").rglob("*")) == before  # nothing written

    # a new backup directory, but the --backup-to prefix is the other node's
    owner.write_text(json.dumps(mine))
    client.put_object(Bucket=bucket, Key="node/.gpuhost/node.json", Body=json.dumps(other).encode())
    r = _suite(tmp_path, env, *args, f"--backup-dir={tmp_path / 'backup-2'}")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and f"--backup-to s3://{bucket}/node holds the backup of gpu-a" in out, out[
        -3000:
    ]
    assert "--backup-dir" not in out.split("holds the backup of gpu-a")[0].rsplit("gpuhost:", 1)[-1]

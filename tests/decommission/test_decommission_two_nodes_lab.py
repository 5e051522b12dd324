"""Two lab nodes, one after the other, with the same --backup-dir: the second is refused.

Node A's backup is made and called safe; node B's run (the same paths, other bytes) names A as
the owner of the place before anything is stopped, and A's backup keeps A's bytes. Real SSH to
two lab hosts; the owner is told by the agent's machine-id and hostname.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_node_with_the_first_nodes_backup_dir_is_refused(lab, tmp_path):
    a, b = (lab.host("health-ok", name=f"two{n}-{os.getpid() % 100000}") for n in "ab")
    for h in (a, b):
        r = h.ssh(["sh", "-c", "mkdir -p /srv/two && hostname > /srv/two/who"], timeout=30)
        assert r.returncode == 0, r.stderr
    doc = {
        "name": "two-nodes",
        "stop": {"units": ["sglang-*.service"], "term_timeout": 5},  # this test's own two hosts
        "categories": {"who": {"roots": ["/srv/two"]}},
    }
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    dest = tmp_path / "backup"

    def run(h):
        argv = [
            sys.executable, "-m", "pytest", str(ROOT / "suites" / "decommission"), *h.pytest_args(),
            f"--manifest={manifest}", f"--backup-dir={dest}", "--report-dir=none", "-p", "no:cacheprovider", "-q",
        ]  # fmt: skip
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)

    r = run(a)
    assert r.returncode == 0, r.stdout[-3000:]
    a_bytes = (dest / "who" / "srv" / "two" / "who").read_bytes()
    assert a_bytes == a.ssh(["cat", "/srv/two/who"], timeout=30).stdout.encode()
    r = run(b)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and f"--backup-dir {dest} holds the backup of " in out, out[-3000:]
    assert "Traceback" not in out
    assert (dest / "who" / "srv" / "two" / "who").read_bytes() == a_bytes  # A's backup is A's
    for h in (a, b):
        h.ssh(["rm", "-rf", "/srv/two"], timeout=30)


def test_two_lab_nodes_one_moto_endpoint_own_data_and_every_root(lab, s3_endpoint, tmp_path):
    """Two real lab nodes against one moto endpoint, one --backup-to without {host}.

    Node A's root that is a symbolic link makes it not safe until the manifest follows it; then
    every file of both roots is in A's backup directory and under the prefix, byte for byte.
    Node B, later, with the same prefix (its own backup directory) is refused before anything
    stops, naming A, and A's objects keep A's bytes.
    """
    a, b = (lab.host("health-ok", name=f"own{n}-{os.getpid() % 100000}") for n in "ab")
    for h in (a, b):
        r = h.ssh(
            ["sh", "-c", "mkdir -p /srv/own /srv/own-real && hostname > /srv/own/who && "
             "head -c 5000 /dev/urandom > /srv/own-real/blob && ln -sfn /srv/own-real /srv/own-link"],
            timeout=30,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    bucket = s3_endpoint.make_bucket("fleet")
    doc = {
        "name": "two-nodes-s3",
        "stop": {"units": ["sglang-*.service"], "term_timeout": 5},
        "categories": {"who": {"roots": ["/srv/own", "/srv/own-link"], "s3": True}},
    }
    manifest = tmp_path / "m.yaml"
    env = {**os.environ, **s3_endpoint.env}

    def run(h, dest):
        manifest.write_text(yaml.safe_dump(doc))
        argv = [
            sys.executable, "-m", "pytest", str(ROOT / "suites" / "decommission"), *h.pytest_args(),
            f"--manifest={manifest}", f"--backup-dir={dest}", f"--backup-to=s3://{bucket}/fleet",
            f"--s3-endpoint={s3_endpoint.url}", "--report-dir=none", "-p", "no:cacheprovider", "-q",
        ]  # fmt: skip
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    r = run(a, tmp_path / "a")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "root /srv/own-link of category who is a symbolic link" in out, out[-3000:]
    doc["categories"]["who"]["follow_root_links"] = True
    r = run(a, tmp_path / "a")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    client = s3_endpoint.client()
    truth = {p: a.ssh(["cat", p], timeout=30).stdout.encode("latin-1") for p in ("/srv/own/who",)}
    blob = a.ssh(["sh", "-c", "base64 -w0 /srv/own-real/blob"], timeout=30).stdout
    truth["/srv/own-real/blob"] = __import__("base64").b64decode(blob)
    for path, body in truth.items():
        assert (tmp_path / "a" / "who" / path.lstrip("/")).read_bytes() == body
        assert client.get_object(Bucket=bucket, Key=f"fleet/who{path}")["Body"].read() == body
    before = {o["Key"]: o["ETag"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    r = run(b, tmp_path / "b")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and f"--backup-to s3://{bucket}/fleet holds the backup of " in out, out[-3000:]
    assert "Traceback" not in out
    assert {o["Key"]: o["ETag"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]} == before
    for path, body in truth.items():
        assert client.get_object(Bucket=bucket, Key=f"fleet/who{path}")["Body"].read() == body
    for h in (a, b):
        h.ssh(["rm", "-rf", "/srv/own", "/srv/own-real", "/srv/own-link"], timeout=30)

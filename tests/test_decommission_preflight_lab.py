"""suites/decommission on the b200-nvl8 lab host with S3 misconfigured: refused before the first stop.

The suite runs as an operator runs it (a subprocess over real SSH). A `--backup-to` bucket that does
not exist, or an `in_s3` location that does not, is one line of a usage error: the run stops there,
the 7 SGLang servers keep running, and nothing is copied.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "fixtures" / "manifests" / "b200-node-backup.yaml"


@pytest.fixture(scope="module")
def b200(lab):
    return lab.host("b200-nvl8", data_scale="small")


def _servers(h: Any) -> int:
    return sum("-m sglang.launch_server" in p for p in h.ssh(["ps", "-eo", "args="]).stdout.splitlines())


def _run(h: Any, manifest: Path, dest: Path, backup_to: str, endpoint: str, env: dict[str, str]) -> Any:
    argv = [
        sys.executable, "-m", "pytest", str(ROOT / "suites" / "decommission"), *h.pytest_args(),
        f"--manifest={manifest}", f"--backup-dir={dest}", f"--backup-to={backup_to}",
        f"--s3-endpoint={endpoint}", f"--report-dir={dest.parent / 'reports'}", "-p", "no:cacheprovider", "-q",
    ]  # fmt: skip
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_wrong_bucket_is_refused_in_one_line_before_any_server_stops(b200, s3_endpoint, tmp_path):
    h = b200
    h.reset()
    env = {**os.environ, **s3_endpoint.env}
    assert _servers(h) == 7
    dest = tmp_path / "backup"

    r = _run(h, MANIFEST, dest, "s3://no-such-decom-bucket/b200", s3_endpoint.url, env)
    out = r.stdout + r.stderr
    assert r.returncode == 4, out[-5000:]
    assert [line for line in out.splitlines() if line.strip()] == [
        "ERROR: gpuhost: --backup-to s3://no-such-decom-bucket/b200: no such bucket (NoSuchBucket)"
    ], out[-5000:]
    assert "Traceback" not in out and "botocore" not in out
    assert _servers(h) == 7
    assert not dest.exists()

    # the node's data said to be in a bucket that does not exist: the in_s3 location is named
    bucket = s3_endpoint.make_bucket("decom")
    doc = yaml.safe_load(MANIFEST.read_text())
    doc["categories"]["data"] = {"roots": ["/data/data"], "in_s3": "s3://no-such-pipeline-bucket/dflash/"}
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    r = _run(h, manifest, dest, f"s3://{bucket}/b200", s3_endpoint.url, env)
    out = r.stdout + r.stderr
    assert r.returncode == 4, out[-5000:]
    assert [line for line in out.splitlines() if line.strip()] == [
        "ERROR: gpuhost: in_s3 s3://no-such-pipeline-bucket/dflash/ of category data: no such bucket (NoSuchBucket)"
    ], out[-5000:]
    assert _servers(h) == 7
    assert not dest.exists()
    assert s3_endpoint.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0

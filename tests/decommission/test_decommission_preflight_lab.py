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

ROOT = Path(__file__).resolve().parents[2]
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


def _run_args(h: Any, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    argv = [
        sys.executable, "-m", "pytest", str(ROOT / "suites" / "decommission"), *h.pytest_args(),
        f"--report-dir={tmp_path / 'reports'}", "-p", "no:cacheprovider", "-q", *args,
    ]  # fmt: skip
    return subprocess.run(
        argv, cwd=tmp_path, env=env or dict(os.environ), capture_output=True, text=True, timeout=300
    )


def test_every_missing_precondition_is_listed_at_once_before_any_server_stops(b200, tmp_path):
    """The example manifest marks categories for S3: without --backup-to, and with a backup
    directory under a file, the run is refused with both lines, the servers run, nothing is made."""
    h = b200
    h.reset()
    assert _servers(h) == 7
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    dest = blocker / "backup"
    r = _run_args(h, tmp_path, f"--manifest={MANIFEST}", f"--backup-dir={dest}")
    out = r.stdout + r.stderr
    assert r.returncode == 4, out[-5000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 2, out[-5000:]
    assert lines[0].startswith("ERROR: gpuhost: the manifest marks ") and "--backup-to=s3://" in lines[0], (
        lines
    )
    assert lines[1] == f"gpuhost: --backup-dir {dest} cannot be made: {blocker} is not a directory", lines
    assert "Traceback" not in out and "ProcedureError" not in out
    assert _servers(h) == 7
    assert blocker.read_text() == "x"


def test_a_backup_dir_without_room_for_the_node_refuses_at_step_one_with_servers_running(b200, tmp_path):
    """Room at the backup directory is checked against the node's listing before the first stop."""
    h = b200
    h.reset()
    assert _servers(h) == 7
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "gpuhost-test-small", str(small)], check=True)
    try:
        doc = yaml.safe_load(MANIFEST.read_text())
        for cat in doc["categories"].values():
            cat.pop("s3", None)  # no S3 here: only the local directory's room is asked
        manifest = tmp_path / "local-only.yaml"
        manifest.write_text(yaml.safe_dump(doc))
        r = _run_args(h, tmp_path, f"--manifest={manifest}", f"--backup-dir={small / 'node'}")
        out = r.stdout + r.stderr
        assert r.returncode == 1, out[-5000:]
        assert "refused before any change" in out and "GB free on its filesystem" in out, out[-5000:]
        assert "NOT SAFE" in out or "NOT safe" in out, out[-5000:]
        assert "ProcedureError" not in out
        assert _servers(h) == 7
        assert list(small.iterdir()) == []  # not even an owner record or a timeline
    finally:
        subprocess.run(["umount", str(small)], check=False)

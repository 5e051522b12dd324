"""`--check-only` writes nothing, on any target or destination, in each of the suites.

Each suite runs as an operator runs it (a subprocess over real SSH) against a lab host. Before
and after, a snapshot of everything the run could write: the host's overlay upper directory (every
file it changed since boot, its containers' too, tests/helpers/snapshot.py), the lab's record of
sysfs writes, the local backup directory and the S3 buckets. They must be identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.snapshot import bucket_snapshot, diff, host_snapshot, settled_snapshot, tree_snapshot

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "fixtures" / "manifests" / "b200-node-backup.yaml"
ORDER = ROOT / "fixtures" / "orders" / "b200-order.yaml"


def _pytest(h: Any, suite: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    argv = [
        sys.executable, "-m", "pytest", str(ROOT / "suites" / suite), *h.pytest_args(), "--check-only",
        f"--report-dir={tmp_path / 'reports'}", "-p", "no:cacheprovider", "-q", *args,
    ]  # fmt: skip
    return subprocess.run(
        argv, cwd=tmp_path, env=env or dict(os.environ), capture_output=True, text=True, timeout=300
    )


def test_decommission_check_only_leaves_node_backup_dir_and_buckets_as_they_were(lab, s3_endpoint, tmp_path):
    h = lab.host("b200-nvl8", data_scale="small")
    h.reset()
    env = {**os.environ, **s3_endpoint.env}
    bucket = s3_endpoint.make_bucket("co")
    client = s3_endpoint.client()
    dest = tmp_path / "backup"
    node0, bucket0 = settled_snapshot(h), bucket_snapshot(client, bucket)

    r = _pytest(
        h, "decommission", tmp_path, f"--manifest={MANIFEST}", f"--backup-dir={dest}",
        f"--backup-to=s3://{bucket}/b200", f"--s3-endpoint={s3_endpoint.url}", env=env,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]  # would fix: the servers run, nothing is backed up
    assert "would fix" in out, out[-4000:]
    assert diff(node0, host_snapshot(h)) == []
    assert not dest.exists(), sorted(tree_snapshot(dest))
    assert diff(bucket0, bucket_snapshot(client, bucket)) == []


def test_p2p_check_only_leaves_host_and_container_as_they_were(lab, tmp_path):
    h = lab.host("proxmox-rtx6000")
    h.reset()
    before = settled_snapshot(h)
    r = _pytest(h, "p2p", tmp_path, "--stop-timeout=3")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]  # the IOMMU groups would be changed
    assert "would fix" in out, out[-4000:]
    assert diff(before, host_snapshot(h)) == []


@pytest.mark.parametrize("fix", ["", "--fix=persistence"])
def test_health_check_only_leaves_host_as_it_was_and_remembers_on_the_controller(lab, tmp_path, fix):
    h = lab.host("health-no-persistence")
    h.reset()
    state = tmp_path / "controller-state"
    env = {**os.environ, "GPUHOST_CONTROLLER_STATE_DIR": str(state)}
    before = settled_snapshot(h)
    r = _pytest(h, "health", tmp_path, *([fix] if fix else []), env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]  # persistence mode is off on this host
    assert diff(before, host_snapshot(h)) == []
    # the kernel-log cursor a nightly check-only sweep needs is kept where the run was made
    assert list(state.rglob("*.json")), sorted(str(p) for p in state.rglob("*"))


def test_accept_check_only_leaves_the_node_and_the_bucket_as_they_were(lab, s3_endpoint, tmp_path):
    h = lab.host("b200-nvl8", data_scale="small")
    h.reset()
    env = {**os.environ, **s3_endpoint.env}
    bucket = s3_endpoint.make_bucket("co")
    client = s3_endpoint.client()
    order = tmp_path / "order.yaml"
    order.write_text(ORDER.read_text() + f"s3: {{bucket: {bucket}, endpoint: '{s3_endpoint.url}'}}\n")
    node0, bucket0 = settled_snapshot(h), bucket_snapshot(client, bucket)
    r = _pytest(h, "accept", tmp_path, f"--order={order}", env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]  # a healthy node: ACCEPT, its write throughput not measured
    assert "write throughput not measured (--check-only writes nothing)" in out, out[-4000:]
    assert diff(node0, host_snapshot(h)) == []
    assert diff(bucket0, bucket_snapshot(client, bucket)) == []

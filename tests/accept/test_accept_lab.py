"""suites/accept end to end on the lab's rented HGX B200 node (real SSH), S3 through moto on loopback.

Each scenario runs the suite as a renter would (`python -m pytest suites/accept ...` in a
subprocess) against `b200-nvl8` or a variant of it (gpulab/profiles/accept_variants.py), and
reads the verdict from the answer on the terminal and from the promised-vs-found JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulab.profiles.accept_variants import gpu_short
from tests.helpers.snapshot import diff, host_snapshot, settled_snapshot

ROOT = Path(__file__).resolve().parents[2]
ORDER = ROOT / "fixtures" / "orders" / "b200-order.yaml"


@pytest.fixture(scope="module")
def b200(lab: Any) -> Any:
    return lab.host("b200-nvl8", name=f"acc-{os.getpid() % 100000}", data_scale="small")


def order(tmp: Path, **changes: Any) -> Path:
    """The example order with `changes` ({"disk": {...}} replaces that section's fields given)."""
    import yaml

    data = yaml.safe_load(ORDER.read_text())
    for section, fields in changes.items():
        data[section] = {**data.get(section, {}), **fields}
    path = tmp / "order.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def accept(h: Any, tmp: Path, order_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run suites/accept against `h`; return (the completed process, the evidence JSON or None)."""
    evidence = tmp / "evidence" / "accept.json"
    argv = [
        sys.executable, "-m", "pytest", str(ROOT / "suites" / "accept"), *h.pytest_args(),
        f"--order={order_path}", f"--report-dir={tmp / 'reports'}", f"--accept-evidence={evidence}",
        "--accept-scratch-mib=64", "-p", "no:cacheprovider", "-q", *args,
    ]  # fmt: skip
    r = subprocess.run(
        argv, cwd=tmp, env=env or dict(os.environ), capture_output=True, text=True, timeout=400, check=False
    )
    data = json.loads(evidence.read_text()) if evidence.is_file() else None
    return r, data


def _scratch_left(h: Any) -> list[str]:
    r = h.ssh(["sh", "-c", "ls -a /data | grep gpuhost-accept || true"])
    return r.stdout.split()


def _item(data: dict[str, Any], name: str) -> dict[str, Any]:
    (it,) = [i for i in data["items"] if i["item"] == name]
    return it


def test_healthy_node_is_accepted_with_s3_reachable_and_no_scratch_file_left(b200, s3_endpoint, tmp_path):
    b200.reset()
    bucket = s3_endpoint.make_bucket("acc")
    path = order(tmp_path, s3={"bucket": bucket, "prefix": "run/", "endpoint": s3_endpoint.url})
    r, data = accept(b200, tmp_path, path, env={**os.environ, **s3_endpoint.env})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert f"{b200.address}: ACCEPT" in out, out[-3000:]
    assert data["verdict"] == "ACCEPT", data
    assert {i["item"] for i in data["items"]} >= {
        "GPU count", "GPU model", "memory per GPU", "driver version", "CUDA version", "health checks",
        "P2P per pair", "NCCL all-reduce", "free space", "write throughput", f"S3 s3://{bucket}/run/",
    }  # fmt: skip
    assert _item(data, "GPU count")["found"] == "8"
    assert _scratch_left(b200) == []
    (html,) = (tmp_path / "reports").glob("*.html")
    assert "ACCEPT" in html.read_text()


def test_one_gpu_short_is_rejected_naming_the_count(lab, tmp_path):
    h = lab.host(gpu_short(), name=f"acc-short-{os.getpid() % 100000}", data_scale="small")
    r, data = accept(h, tmp_path, order(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-5000:]
    assert f"{h.address}: REJECT: GPU count: promised 8, found 7" in out, out[-3000:]
    assert data["verdict"].startswith("REJECT: GPU count: promised 8, found 7"), data


def test_an_nvlink_down_is_rejected(b200, tmp_path):
    """The lab models a link down in nvidia-smi (fault `nvlinks_down`, gpulab_tools/nvidia_smi.py)."""
    b200.reset()
    faults = {"gpus": {"0000:43:00.0": {"nvlinks_down": [3]}}}
    w = b200.ssh(["sh", "-c", "cat > /var/lib/gpulab/faults.json"], input=json.dumps(faults))
    assert w.returncode == 0, w.stderr
    try:
        r, data = accept(b200, tmp_path, order(tmp_path))
    finally:
        b200.ssh(["rm", "-f", "/var/lib/gpulab/faults.json"])
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-5000:]
    assert data["verdict"].startswith("REJECT: "), data
    assert "nvlink" in _item(data, "health checks")["found"], data
    assert not _item(data, "health checks")["ok"]


def test_a_slow_disk_is_rejected_naming_the_throughput(b200, tmp_path):
    b200.reset()
    r, data = accept(b200, tmp_path, order(tmp_path, disk={"write_mb_s": 1_000_000}))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-5000:]
    it = _item(data, "write throughput")
    assert not it["ok"] and it["found"].endswith("MB/s (64 MiB, fsync'd)"), it
    assert f"write throughput: promised >= 1e+06 MB/s, found {it['found']}" in data["verdict"]
    assert _scratch_left(b200) == []


def test_check_only_writes_nothing_on_the_node(b200, tmp_path):
    b200.reset()
    before = settled_snapshot(b200)
    # a file made and removed again leaves no file behind, but the directory's change time moves
    times = ["stat", "-c", "%.9Y %.9Z", "/data"]
    stamp = b200.ssh(times).stdout
    r, data = accept(b200, tmp_path, order(tmp_path), "--check-only")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "write throughput not measured (--check-only writes nothing)" in out, out[-3000:]
    assert "write throughput" not in {i["item"] for i in data["items"]}
    assert diff(before, host_snapshot(b200)) == []
    assert b200.ssh(times).stdout == stamp


@contextlib.contextmanager
def slow_volume(h: Any, at: str, write_bps: int) -> Iterator[None]:
    """Mount a volume at `at` on the host that takes `write_bps` bytes/s (gpulab/kernel/slowfs.py).

    The FUSE daemon runs in the host's mount namespace (nsenter; the lab's own Python is under
    the host's root, gpulab/host/lab.py: the overlay's lower layer is this machine's /), with
    /dev/fuse made in the host's /dev for the time of the block.
    """
    fuse = h.dir / "dev" / "fuse"
    os.mknod(fuse, 0o600 | stat.S_IFCHR, os.makedev(10, 229))  # /dev/fuse: misc 229 (devices.txt)
    assert h.ssh(["mkdir", "-p", at, "/var/tmp/slow-backing"]).returncode == 0
    ns = ["nsenter", "-t", str(h.init_pid()), "-m", "--"]
    argv = [
        *ns,
        sys.executable,
        "-m",
        "gpulab.kernel.slowfs",
        "--backing=/var/tmp/slow-backing",
        f"--mount={at}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([*argv, f"--write-bps={write_bps}"], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 20
        while (
            h.ssh(["stat", "-f", "-c", "%T", at]).stdout.strip() != "fuseblk"
            and not h.ssh(["sh", "-c", f"stat -f -c %T {at} | grep -q fuse"]).returncode == 0
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "slowfs did not mount"
            time.sleep(0.2)
        yield
    finally:
        subprocess.run([*ns, "umount", at], check=False)
        proc.wait(timeout=20)
        fuse.unlink()


def test_a_really_slow_data_volume_is_rejected_naming_the_throughput(b200, tmp_path):
    """A data volume that takes 4 MiB/s (a FUSE volume that paces writes); the order asks 50 MB/s."""
    b200.reset()
    with slow_volume(b200, "/srv/slow", 4 << 20):
        r, data = accept(b200, tmp_path, order(tmp_path, disk={"path": "/srv/slow"}))
        left = b200.ssh(["ls", "-A", "/srv/slow"]).stdout.split()
    out = r.stdout + r.stderr
    it = _item(data, "write throughput")
    assert r.returncode == 1, (it, out[-5000:])
    assert not it["ok"], it
    mb_s = float(it["found"].split()[0])
    assert 2 < mb_s < 5, it  # 4 MiB/s = 4.2 MB/s, not the page cache's speed
    assert f"write throughput: promised >= 50 MB/s, found {it['found']}" in data["verdict"], data
    assert left == []  # the scratch file was removed

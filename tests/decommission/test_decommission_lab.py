"""suites/decommission end to end on the b200-nvl8 lab host (real SSH) with moto's S3 on loopback.

Each scenario runs the suite as an operator would: `python -m pytest suites/decommission ...` in a
subprocess (the controller), so that killing it is a real crash of the controller.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.modules.backup.s3 import key_for

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "fixtures" / "manifests" / "b200-node-backup.yaml"
S3_CATEGORIES = ("data", "other")

# a node-side listing: {base64(path): sha256 hex, or "link:" + base64(target)}
NODE_HASHES = r"""
import base64, hashlib, json, os
out = {}
for d, dirs, files in os.walk(b"/data"):
    for n in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
        p = os.path.join(d, n)
        k = base64.b64encode(p).decode()
        if os.path.islink(p):
            out[k] = "link:" + base64.b64encode(os.readlink(p)).decode()
        elif os.path.isfile(p):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[k] = h.hexdigest()
print(json.dumps(out))
"""
SKIP = re.compile(rb"/\.[^/]*\.sw.$")  # the manifest leaves editor swap files out


@pytest.fixture(scope="module")
def b200(lab):
    return lab.host("b200-nvl8", data_scale="small")


def node_hashes(h: Any) -> dict[bytes, str]:
    r = h.ssh(["python3", "-c", NODE_HASHES], timeout=120)
    assert r.returncode == 0, r.stderr
    out = {base64.b64decode(k): v for k, v in json.loads(r.stdout).items()}
    return {k: v for k, v in out.items() if not SKIP.search(k)}


def category_of(path: bytes) -> str:
    rel = path[len(b"/data/") :]
    top = rel.split(b"/", 1)[0]
    if b"/" not in rel and (rel.endswith(b".md") or rel.endswith(b".txt")):
        return "notes"
    if top in (b"scripts", b"configs", b"logs", b"data"):
        return top.decode()
    return "other"


def local_of(dest: Path, path: bytes) -> bytes:
    return os.fsencode(dest) + b"/" + category_of(path).encode() + path


def check_local(dest: Path, hashes: dict[bytes, str], *, complete: bool) -> list[bytes]:
    """Every file under its final name matches the node; with complete, every node file is there."""
    missing = []
    for path, want in hashes.items():
        local = local_of(dest, path)
        if want.startswith("link:"):
            if os.path.islink(local):
                assert os.readlink(local) == base64.b64decode(want[5:]), path
            else:
                assert not os.path.exists(local), f"{path!r}: link stored as something else"
                missing.append(path)
            continue
        try:
            with open(local, "rb") as f:
                got = hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            missing.append(path)
            continue
        assert got == want, f"{path!r}: local copy differs from the node"
    if complete:
        assert missing == []
    return missing


def check_s3(client: Any, bucket: str, prefix: str, dest: Path, hashes: dict[bytes, str]) -> None:
    keys = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            keys[obj["Key"]] = obj
    owner = keys.pop(f"{prefix}/.gpuhost/node.json", None)  # the node the prefix belongs to
    assert owner is not None
    want = {p: v for p, v in hashes.items() if category_of(p) in S3_CATEGORIES}
    assert len(keys) == len(want)
    for path, sha in want.items():
        rel = category_of(path) + "/" + os.fsdecode(path.lstrip(b"/"))
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{key_for(rel)}")["Body"].read()
        if sha.startswith("link:"):
            assert body == base64.b64decode(sha[5:])
        else:
            assert hashlib.sha256(body).hexdigest() == sha, path
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def suite_argv(h: Any, dest: Path, bucket: str, prefix: str, endpoint: str, reports: Path) -> list[str]:
    return [
        sys.executable, "-m", "pytest", str(ROOT / "suites" / "decommission"), *h.pytest_args(),
        f"--manifest={MANIFEST}", f"--backup-dir={dest}", f"--backup-to=s3://{bucket}/{prefix}",
        f"--s3-endpoint={endpoint}", f"--report-dir={reports}", "-p", "no:cacheprovider", "-q",
        "-o", "decommission_stall_timeout=10", "-o", "decommission_s3_part_mib=5",
    ]  # fmt: skip


def run_suite(argv: list[str], env: dict[str, str], timeout: float = 240) -> tuple[int, str, dict[str, int]]:
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|fixed|failed|skipped|would fix|error)", tail)}
    return r.returncode, r.stdout[-30000:] + r.stderr[-3000:], counts


def processes(h: Any) -> list[str]:
    return h.ssh(["ps", "-eo", "args="]).stdout.splitlines()


def test_decommission_b200(b200, s3_endpoint, tmp_path):
    """Stop, back up, upload; rerun is a no-op; a change is copied; hostile names and /etc link."""
    h = b200
    h.reset()
    bucket = s3_endpoint.make_bucket("decom")
    dest = tmp_path / "backup"
    env = {**os.environ, **s3_endpoint.env}
    argv = suite_argv(h, dest, bucket, "b200", s3_endpoint.url, tmp_path / "reports")
    assert sum("-m sglang.launch_server" in p for p in processes(h)) == 7

    # --check-only stops nothing, copies nothing, and says what it would stop and copy
    rc, out, counts = run_suite([*argv, "--check-only"], env)
    assert rc != 0 and counts.get("would fix", 0) >= 4, out
    assert "stop PID" in out and "sglang.launch_server" in out and "files" in out, out
    assert sum("-m sglang.launch_server" in p for p in processes(h)) == 7
    copied = [p for p in dest.rglob("*") if p.is_file() and ".gpuhost" not in p.parts]
    assert copied == []
    assert s3_endpoint.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0

    rc, out, counts = run_suite(argv, env)
    assert rc == 0, out
    assert counts.get("failed", 0) == 0 and counts.get("fixed", 0) >= 3, out
    after = processes(h)
    assert not any("sglang.launch_server" in p and p.startswith("python3") for p in after), after
    assert "vim /data/sglang_notes.md" in after and "tail -f /data/logs/sglang-dp0.log" in after
    hashes = node_hashes(h)
    assert len(hashes) > 1500
    check_local(dest, hashes, complete=True)
    check_s3(s3_endpoint.client(), bucket, "b200", dest, hashes)
    link = local_of(dest, b"/data/odd names/etc-link")
    assert os.path.islink(link) and os.readlink(link) == b"/etc"
    assert not os.path.exists(os.fsencode(dest) + b"/other/etc") and not Path("/tmp/pwned").exists()
    # NOTES.md lists every process stopped, once: the 7 servers (and whatever the selection adds, e.g. workers)
    ran = [line for line in (dest / "NOTES.md").read_text().splitlines() if line.startswith("- PID ")]
    records = (dest / ".gpuhost" / "stopped.jsonl").read_text().splitlines()
    assert len(ran) == len({(r["pid"], r["starttime"]) for r in map(json.loads, records)}) >= 7
    assert sum("-m sglang.launch_server" in line for line in ran) == 7, ran
    sums = subprocess.run(
        ["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=dest, capture_output=True, text=True
    )
    assert sums.returncode == 0, sums.stdout[-2000:]
    # the stop step's evidence shows every server's command line whole, except its API key
    # (sglang-dp6 runs with --api-key in the b200-nvl8 profile)
    key = "Rk8Lq2Zm4Xp7Wn3VtQ9xY"
    artefacts = [
        *(tmp_path / "reports").glob("*.json"),
        *(tmp_path / "reports").glob("*.html"),
        dest / "NOTES.md",
    ]
    texts = {p.name: p.read_text(errors="replace") for p in artefacts}
    assert texts and not [n for n, t in texts.items() if key in t], "the API key reached an artefact"
    # the run's evidence file, not the fleet summary beside it (the glob's order is the directory's)
    evidence = next(t for n, t in sorted(texts.items()) if n.endswith(".json") and "fleet-summary/" not in t)
    assert (
        "--api-key ***" in evidence
        and "--base-gpu-id 6 --tp 1 --mem-fraction-static 0.88 --api-key ***" in evidence
    )
    assert "--model-path /data/models/Qwen3-235B-A22B-FP8 --port 30006" in evidence

    # a rerun changes nothing and passes everywhere
    rc, out, counts = run_suite(argv, env)
    assert rc == 0 and counts.get("passed") == 8, out

    # a file changed on the node is copied again (and uploaded: data is an S3 category)
    h.ssh("echo 'one more line' >> /data/data/completions/part-000/completions_00001.jsonl")
    rc, out, counts = run_suite(argv, env)
    assert rc == 0 and counts.get("fixed", 0) >= 2, out
    hashes = node_hashes(h)
    check_local(dest, hashes, complete=True)
    check_s3(s3_endpoint.client(), bucket, "b200", dest, hashes)


def test_decommission_survives_five_cuts(b200, s3_endpoint, tmp_path):
    """The controller is killed 5 times at random points; each rerun resumes; nothing is lost."""
    h = b200
    h.reset()
    bucket = s3_endpoint.make_bucket("cuts")
    dest = tmp_path / "backup"
    env = {**os.environ, **s3_endpoint.env}
    argv = suite_argv(h, dest, bucket, "b200", s3_endpoint.url, tmp_path / "reports")
    rng = random.Random(os.environ.get("GPUHOST_CUT_SEED", time.time_ns()))
    cuts: list[tuple[Any, ...]] = []
    for i in range(5):
        p = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # cut at a random moment once the local copy (run 0) or the S3 upload (run 1) has
        # verifiably begun, and at a random time from the start (runs 2, 3, 4)
        meta = dest / ".gpuhost"
        started = time.monotonic()
        if i in (0, 1):
            # wait until a random number of files is journalled as verified, then cut
            pattern = "state.journal.jsonl" if i == 0 else "s3-*.journal.jsonl"
            want = rng.randint(20, 1000)
            while time.monotonic() - started < 90 and p.poll() is None:
                done = sum(j.read_bytes().count(b"\n") for j in meta.glob(pattern)) if meta.is_dir() else 0
                if done >= want:
                    break
                time.sleep(0.02)
            delay = 0.0
        else:
            delay = rng.uniform(1.0, 5.0)
        try:
            p.wait(timeout=delay)
            cuts.append((i, round(time.monotonic() - started, 2), "finished first"))
        except subprocess.TimeoutExpired:
            if i == 2:
                h.cut_link()  # one of the cuts is the link itself going down under the transfer
                time.sleep(1.0)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            h.heal_link()
            cuts.append((i, round(time.monotonic() - started, 2), "killed"))
        # whatever was under a final name is complete and correct (temp names, then rename);
        # read the node now: the servers append to their logs when they stop
        missing = check_local(dest, node_hashes(h), complete=False)
        cuts[-1] += (len(missing),)
    print("cuts (run, delay s, what, files still missing):", cuts)
    assert any(c[2] == "killed" and c[3] for c in cuts), cuts  # at least one cut before the backup was whole
    rc, out, counts = run_suite(argv, env)
    assert rc == 0, (cuts, out)
    hashes = node_hashes(h)
    check_local(dest, hashes, complete=True)
    check_s3(s3_endpoint.client(), bucket, "b200", dest, hashes)
    assert list((dest / ".gpuhost" / "tmp").iterdir()) == []
    rc, out, counts = run_suite(argv, env)
    assert rc == 0 and counts.get("passed") == 8, out

"""Benchmark verifying data already in S3 in place against re-uploading it, in one run.

    python benchmarks/bench_inplace.py               # 10 GB tree (the seed's node had 7.25 GB)
    python benchmarks/bench_inplace.py --size-gb 2   # a smaller tree
    python benchmarks/bench_inplace.py --smoke       # CI: 48 MB, one round, seconds

A tree shaped like the seed's /data/data (47 Arrow shards, about 3/4 of the bytes, and JSONL
completions in 32 MiB files) is written, then put in a fresh moto server on loopback with
`aws s3 sync`, as the node's own pipeline would have: that upload is the re-upload a backup
would otherwise make, timed. Then `InPlace.check` proves every file against its object (the
cli's objects carry no checksum, so the MD5 ETag, single-part or multipart, is recomputed from
the node's bytes) through a local:// agent, the node-side reader the suite uses over SSH, with 1
and with 2 hashing workers, alternated for --rounds rounds; medians are compared. Every request
body the checking client sends is counted. The tree is in the page cache for both arms.
Goals (the project's): in place at least 5x faster than the re-upload; 0 bytes sent; the
node's hashing with 2 workers at least 1.8x faster than with 1 on a 2-core machine (the whole
check, with its S3 listing and HEADs, is printed beside it). Writes reports/bench_inplace.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytest_gpuhost.exec.s3io import make_client  # noqa: E402
from pytest_gpuhost.exec.targets import open_connection, parse_host_url  # noqa: E402
from pytest_gpuhost.modules.backup.inplace import InPlace  # noqa: E402
from pytest_gpuhost.modules.backup.local import Backup, Category, Manifest  # noqa: E402
from pytest_gpuhost.modules.process import Selection  # noqa: E402
from tests.helpers.s3server import FAKE_ENV, start_moto, stop_moto  # noqa: E402

MiB = 1024 * 1024


def write_tree(root: Path, total: int) -> tuple[int, int]:
    """Write 47 shards (3/4 of total) and 32 MiB JSONL files (the rest); return (files, bytes)."""
    block = os.urandom(4 * MiB)
    n = 0
    written = 0

    def put(path: Path, size: int) -> None:
        nonlocal n, written
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            left = size
            while left:
                k = min(left, len(block))
                f.write(block[:k])
                left -= k
            f.write(os.urandom(16))  # no two files alike
        n += 1
        written += size + 16

    shard = max(1, total * 3 // 4 // 47)
    for i in range(47):
        put(root / "shards" / f"data-{i:05d}-of-00047.arrow", shard)
    rest = total - shard * 47
    for i in range(max(1, rest // (32 * MiB))):
        put(root / "completions" / f"part-{i // 100:03d}" / f"completions_{i:05d}.jsonl", min(32 * MiB, rest))
    return n, written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="48 MB, one round (CI)")
    args = ap.parse_args()
    size = int(48 * MiB if args.smoke else args.size_gb * 1e9)
    rounds = 1 if args.smoke else args.rounds
    tmp = Path(tempfile.mkdtemp(prefix="bench-inplace-"))
    proc = None
    os.environ.update(FAKE_ENV)
    try:
        files, total = write_tree(tmp / "data", size)
        proc, url = start_moto(tmp / "moto.log")
        client = make_client(url, max_pool=32)
        client.create_bucket(Bucket="bench-inplace")
        venv_aws = Path(sys.executable).with_name("aws")
        aws = str(venv_aws) if venv_aws.exists() else shutil.which("aws") or "aws"
        t0 = time.perf_counter()
        subprocess.run(
            [
                aws,
                "--endpoint-url",
                url,
                "s3",
                "sync",
                "--only-show-errors",
                str(tmp / "data"),
                "s3://bench-inplace/dflash/",
            ],
            check=True,
            env={**os.environ, **FAKE_ENV},
        )
        upload = time.perf_counter() - t0
        sent = [0, 0]  # request bodies (bytes), requests

        def count(request: object, **_: object) -> None:
            body = getattr(request, "body", None)
            sent[0] += len(body) if isinstance(body, bytes | bytearray) else 0
            sent[1] += 1

        client.meta.events.register("before-send.s3", count)
        conn = open_connection(parse_host_url("local://"))
        m = Manifest(
            "bench",
            (
                Category(
                    "data", (str(tmp / "data"),), in_s3=((str(tmp / "data"), "s3://bench-inplace/dflash/"),)
                ),
            ),
            Selection(),
        )
        listing = Backup(conn, m, tmp / "dest").walk()
        times: dict[int, list[float]] = {1: [], 2: []}
        hashing: dict[int, list[float]] = {1: [], 2: []}
        proved = 0
        for _ in range(rounds):
            for workers in (1, 2):
                t0 = time.perf_counter()
                res = InPlace(conn, m, lambda loc: client, workers=workers).check(listing)
                times[workers].append(time.perf_counter() - t0)
                hashing[workers].append(res.hash_seconds)
                proved = len(res.proved)
                assert proved == files, [p.how for p in res.proofs if not p.ok][:5]
        conn.close()
    finally:
        if proc is not None:
            stop_moto(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    h1, h2 = statistics.median(hashing[1]), statistics.median(hashing[2])
    out = {
        "files": files,
        "bytes": total,
        "aws_s3_sync_upload_s": round(upload, 3),
        "in_place_1_worker_s": round(one, 3),
        "in_place_2_workers_s": round(two, 3),
        "rounds": rounds,
        "bytes_sent_while_verifying": sent[0],
        "requests_while_verifying": sent[1],
        "speedup_vs_upload": round(upload / two, 2),
        "workers_2_vs_1": round(one / two, 2),
        "hashing_1_worker_s": round(h1, 3),
        "hashing_2_workers_s": round(h2, 3),
        "hashing_2_vs_1": round(h1 / h2, 2),
    }
    print(f"tree: {files} files, {total / 1e9:.2f} GB; in the page cache for every arm")
    print(f"aws s3 sync (the re-upload):     {upload:8.2f} s")
    print(f"in place, 1 worker (median):     {one:8.2f} s  ({total / one / 1e6:.0f} MB/s)")
    print(f"in place, 2 workers (median):    {two:8.2f} s  ({total / two / 1e6:.0f} MB/s)")
    print(f"in place vs re-upload:           {upload / two:8.2f}x faster (goal: 5x)")
    print(f"2 workers vs 1, whole check:     {one / two:8.2f}x")
    print(f"2 workers vs 1, node hashing:    {h1 / h2:8.2f}x (goal: 1.8x; {h1:.2f} s vs {h2:.2f} s)")
    print(f"bytes sent while verifying: {sent[0]} in {sent[1]} requests (goal: 0 bytes)")
    print(f"{proved} of {files} files proved in place")
    (ROOT / "reports").mkdir(exist_ok=True)
    (ROOT / "reports" / "bench_inplace.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fleet merge at scale: `python -m pytest_gpuhost.merge` over 1,000 per-node summaries.

The per-node JSONs are made from real ones: `benchmarks/merge_nodes/*.json` are fleet summaries
that `pytest suites/health --check-only` wrote against lab hosts (README there says how), one
healthy 8-GPU B200 node, one with an Xid 79, one with persistence mode off, one with a degraded
PCIe link. Each generated node is a copy of one of them renamed to `gpu-node-NNNN` (host, node,
argv as a per-node run writes it: `--host=local:// --node-name=...`), its run times spread over
the night, and a few values varied (temperatures, one rack on another driver), mixed so that about
4% of the nodes fail.

Times, as medians of --rounds runs, wall and CPU (the merge is one process: its user+system CPU
from getrusage of the child):

* the merge over a directory of N files (`merge DIR -o fleet.html`);
* the merge over an S3 prefix of N objects on moto_server on loopback (`merge s3://... `);
* the merged HTML's size, and Chromium's load time: `chromium --headless --dump-dom` of the
  report minus the same of an empty page (Chromium's own start), median of --rounds.

Goal: 1,000 nodes merged in under 5 s here, the HTML usable (size and load time quoted).

    python benchmarks/bench_merge.py               # 1,000 nodes, 3 rounds
    python benchmarks/bench_merge.py --nodes 10000 --rounds 1 --no-s3
    python benchmarks/bench_merge.py --smoke       # CI: 50 nodes, 1 round, S3 and Chromium when there
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.s3server import FAKE_ENV, start_moto, stop_moto  # noqa: E402

TEMPLATES = ROOT / "benchmarks" / "merge_nodes"
#: Share of nodes made from each template (the rest are healthy).
MIX = {"b200-xid.json": 0.02, "pcie-degraded.json": 0.01, "b200-persistence.json": 0.01}
GOAL_S = 5.0
_TEMP = re.compile(r"(\d+) C")


def _template_host(summary: dict[str, Any]) -> str:
    (host,) = summary["hosts"]
    return str(host)


def make_nodes(n: int, dest: Path, seed: int = 14) -> dict[str, int]:
    """Write n node summaries to dest/gpu-node-NNNN.json; return how many of each template."""
    rng = random.Random(seed)
    texts = {p.name: p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.glob("*.json"))}
    hosts = {name: _template_host(json.loads(t)) for name, t in texts.items()}
    kinds = ["b200-ok.json"] * n
    slots = list(range(n))
    rng.shuffle(slots)
    at = 0
    for name, share in MIX.items():
        k = max(1, round(n * share))
        for i in slots[at : at + k]:
            kinds[i] = name
        at += k
    night = 1796083200.0  # 2026-12-01 00:00 UTC: each node's run starts in the first 10 minutes
    counts: dict[str, int] = {}
    dest.mkdir(parents=True, exist_ok=True)
    width = max(4, len(str(n)))
    for i, kind in enumerate(kinds):
        node = f"gpu-node-{i + 1:0{width}d}"
        text = texts[kind].replace(json.dumps(hosts[kind])[1:-1], node)
        s = json.loads(text)
        start = night + rng.uniform(0, 600)
        took = float(s["run"]["duration"]) * rng.uniform(0.8, 1.5)
        s["run"].update(
            started=start,
            finished=start + took,
            duration=round(took, 3),
            node=node,
            argv=[
                "suites/health",
                "--host=local://",
                f"--node-name={node}",
                "--check-only",
                "--report-dir=/tmp/gpuhost",
                "--fleet-json=s3://ops-reports/nightly/2026-12-01/",
            ],
        )
        cells = s["hosts"][node]["checks"]
        if i // 32 == 7:  # one rack of 32 on another driver: the fleet's uniformity line names it
            state = (cells.get("driver_version") or {}).get("state")
            if isinstance(state, dict):
                state["driver_version"] = "570.124.06"
        temp = cells.get("temperature")
        if temp:
            temp["summary"] = _TEMP.sub(
                lambda m: f"{int(m.group(1)) + rng.randint(-6, 8)} C", temp["summary"]
            )
        (dest / f"{node}.json").write_text(json.dumps(s, indent=1), encoding="utf-8")
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def timed(
    argv: list[str], env: dict[str, str] | None = None
) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """Run argv; return (wall s, CPU s of the child: user+system, the child's result)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc


def merge_runs(
    sources: list[str], out: Path, rounds: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    walls, cpus = [], []
    proc = None
    for _ in range(rounds):
        wall, cpu, proc = timed([sys.executable, "-m", "pytest_gpuhost.merge", *sources, "-o", str(out)], env)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"merge failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        walls.append(wall)
        cpus.append(cpu)
    assert proc is not None
    return {
        "wall": statistics.median(walls),
        "cpu": statistics.median(cpus),
        "walls": walls,
        "out": proc.stdout,
    }


def chromium_load(page: Path, rounds: int) -> dict[str, float] | None:
    """Median wall of `chromium --headless --dump-dom` on the page minus on an empty page."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        return None
    empty = page.with_name("empty.html")
    empty.write_text("<!DOCTYPE html><html><body></body></html>\n", encoding="utf-8")
    profile = tempfile.mkdtemp(prefix="bench-merge-chromium-")
    base = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={profile}",
    ]
    base += ["--disable-extensions", "--disable-background-networking", "--dump-dom"]
    try:
        subprocess.run([*base, empty.as_uri()], capture_output=True, timeout=120)  # warm the disk cache
        t_page: list[float] = []
        t_empty: list[float] = []
        dom = 0
        for _ in range(rounds):
            for target, acc in ((empty, t_empty), (page, t_page)):
                t0 = time.perf_counter()
                p = subprocess.run([*base, target.as_uri()], capture_output=True, timeout=120)
                acc.append(time.perf_counter() - t0)
                if target == page:
                    dom = len(p.stdout)
        page_s, empty_s = statistics.median(t_page), statistics.median(t_empty)
        return {"page": page_s, "empty": empty_s, "load": page_s - empty_s, "dom_bytes": float(dom)}
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def proc_cpu(pid: int) -> float:
    """CPU seconds (user+system) a running process has used so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def upload(dest: Path, url: str, bucket: str) -> float:
    """Put every node file under s3://bucket/nightly/2026-12-01/ (8 threads); return the seconds."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=FAKE_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=FAKE_ENV["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket=bucket)
    files = sorted(dest.glob("*.json"))
    t0 = time.perf_counter()

    def put(p: Path) -> None:
        client.put_object(Bucket=bucket, Key=f"nightly/2026-12-01/{p.name}", Body=p.read_bytes())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, files))
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="50 nodes, 1 round (CI)")
    ap.add_argument("--no-s3", action="store_true", help="skip the merge over S3 (moto)")
    ap.add_argument("--no-chromium", action="store_true", help="skip Chromium's load time")
    ap.add_argument("--keep", help="write the nodes and the report here and keep them")
    args = ap.parse_args()
    if args.smoke:
        args.nodes, args.rounds = 50, 1
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-merge-"))
    nodes = work / "nodes"
    if nodes.exists():
        shutil.rmtree(nodes)
    try:
        counts = make_nodes(args.nodes, nodes)
        size = sum(p.stat().st_size for p in nodes.glob("*.json"))
        print(
            f"{args.nodes} node summaries, {size / 1e6:.1f} MB ({size // args.nodes} bytes each): "
            + ", ".join(f"{n} {k.removesuffix('.json')}" for k, n in sorted(counts.items()))
        )
        out = work / "fleet.html"
        r = merge_runs([str(nodes)], out, args.rounds)
        rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the merges only, so far
        html_size = out.stat().st_size
        json_size = out.with_suffix(".json").stat().st_size
        print(
            f"merge of a directory: {r['wall']:.2f} s wall, {r['cpu']:.2f} CPU-s (median of {args.rounds}; "
            f"walls {', '.join(f'{w:.2f}' for w in r['walls'])})"
        )
        print(
            f"  merged HTML {html_size / 1e6:.2f} MB, merged JSON {json_size / 1e6:.1f} MB, "
            f"peak memory of the merge {rss_mb:.0f} MB"
        )
        print("  " + r["out"].strip().splitlines()[1] if len(r["out"].strip().splitlines()) > 1 else "")
        results = {"nodes": args.nodes, "dir": r, "html_bytes": html_size}
        if not args.no_s3:
            proc, url = start_moto(work / "moto.log")
            try:
                put_s = upload(nodes, url, "bench-merge")
                env = {**os.environ, **FAKE_ENV, "AWS_ENDPOINT_URL": url}
                moto0 = proc_cpu(proc.pid)
                s3 = merge_runs(
                    ["s3://bench-merge/nightly/2026-12-01/"], work / "fleet-s3.html", args.rounds, env
                )
                moto_cpu = (proc_cpu(proc.pid) - moto0) / args.rounds
            finally:
                stop_moto(proc)
            print(
                f"merge over S3 (moto on loopback, {args.nodes} objects put in {put_s:.1f} s): "
                f"{s3['wall']:.2f} s wall, {s3['cpu']:.2f} CPU-s of the merge (median of {args.rounds}) "
                f"+ {moto_cpu:.2f} CPU-s of moto_server (mean)"
            )
            results["s3"] = s3
        if not args.no_chromium:
            c = chromium_load(out, args.rounds)
            if c is None:
                print("chromium: not installed, load time not measured")
            else:
                print(
                    f"chromium --headless --dump-dom: {c['page']:.2f} s for the report, {c['empty']:.2f} s "
                    f"for an empty page: load {c['load']:.2f} s (median of {args.rounds}); DOM "
                    f"{c['dom_bytes'] / 1e6:.2f} MB"
                )
        worst = max(r["wall"], results.get("s3", {}).get("wall", 0.0))
        verdict = "met" if worst < GOAL_S else "MISSED"
        print(f"goal: {args.nodes} nodes merged in under {GOAL_S:.0f} s: {verdict} ({worst:.2f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The backup at scale in files: `bench_backup.py --files N` (a tokenised dataset's shape).

N small files (64 to 763 bytes) in a few levels of folders, `/data/scale-N/shard-SS/DDD/NNNNNNN.tok`,
1,000 files a folder and 100 folders a shard, built once on the lab node (its tmpfs grown to fit)
and kept there, so that a later run with `--host NAME` and the same N reuses it. Measured, each
from a cold destination: our backup (walk, plan, stream, SHA-256 on both ends, verify,
SHA256SUMS) against `rsync -a` over ssh, then the no-op rerun of each. Printed: wall time, time
per file, and the controller's peak resident memory during our run (this process's VmHWM, reset
before the run through /proc/self/clear_refs, so it counts only that run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpulab.host.lab import LabHost
from pytest_gpuhost.modules.backup.local import Category, Manifest
from pytest_gpuhost.modules.process import Selection

SCALE_ROOT = "/data/scale-{n}"  # one tree per N: each kept for the next run with the same N
PEAK_GOAL = 1 << 30  # the controller's peak resident memory, at any N

# Runs on the node (stdlib only): the tree, unless a marker says it holds exactly N files already.
_BUILD = r"""
import os, sys
n, root = int(sys.argv[1]), sys.argv[2]
mark = root + ".built"  # beside the tree, not in it
if not os.path.exists(mark):
    os.system("rm -rf '%s'" % root)
    seed = os.urandom(1 << 16)
    for i in range(n):
        if i % 1000 == 0:
            d = "%s/shard-%02d/%03d" % (root, i // 100000, (i // 1000) % 100)
            os.makedirs(d)
        size = 64 + (i * 7919) % 700
        off = (i * 131) % (len(seed) - size)
        with open("%s/%07d.tok" % (d, i), "wb") as f:
            f.write(i.to_bytes(8, "little") + seed[off : off + size - 8])
    open(mark, "w").close()
print("ready")
"""


def peak_rss() -> int:
    """This process's peak resident memory since the last reset_peak() (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """Set VmHWM back to the current resident memory (Linux >= 4.0: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def grow_fs(h: LabHost, files: int) -> None:
    """Grow the node's tmpfs to hold the tree: a page per small file, and room to spare."""
    st = os.statvfs(h.dir / "fs")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    need = files * 4096 + (1 << 30)
    if free < need:  # only ever grown: other trees (other N) may be kept in it
        subprocess.run(["mount", "-o", f"remount,size={size + need - free}", str(h.dir / "fs")], check=True)


def build_tree(h: LabHost, files: int) -> float:
    grow_fs(h, files)
    t0 = time.perf_counter()
    r = h.ssh(["python3", "-c", _BUILD, str(files), SCALE_ROOT.format(n=files)], timeout=3600)
    if r.returncode != 0 or "ready" not in r.stdout:
        raise RuntimeError(f"building the tree failed: {r.stderr[-2000:]}")
    # warm the node's page cache equally for both tools (tmpfs: already in memory)
    return time.perf_counter() - t0


def manifest(files: int) -> Manifest:
    return Manifest("scale", (Category("dataset", (SCALE_ROOT.format(n=files),)),), Selection())


def run_scale(args: Any, h: LabHost, our_backup: Any, rsync: Any) -> int:
    """Time ours and rsync on the N-file tree, cold then no-op; print and save the figures."""
    n = args.files
    built = build_tree(h, n)
    work = Path(tempfile.mkdtemp(prefix="bench-backup-scale-"))
    times: dict[str, float] = {}
    info: dict[str, Any] = {"files": n, "tree_built_s": round(built, 1), "rss_before": rss()}
    try:
        for suffix in ("", " noop"):
            t0 = time.perf_counter()
            r = rsync(h, work / "rsync", src=SCALE_ROOT.format(n=n) + "/")
            times["rsync" + suffix] = time.perf_counter() - t0
            if r.returncode != 0:
                print("rsync failed:", r.stderr.decode(errors="replace")[-2000:], file=sys.stderr)
            reset_peak()
            t0 = time.perf_counter()
            info["ours" + suffix] = our_backup(h, work / "ours", manifest=manifest(n))
            times["ours" + suffix] = time.perf_counter() - t0
            info["ours" + suffix]["peak_rss"] = peak_rss()
    except BaseException:
        subprocess.run(["rm", "-rf", str(work)], check=False)
        raise
    peak = max(info["ours"]["peak_rss"], info["ours noop"]["peak_rss"])
    print(
        f"\nbackup at scale: {n:,} small files on the node ({SCALE_ROOT.format(n=n)}, built or checked in {built:.1f} s)"
    )
    for name, secs in times.items():
        extra = f"  controller peak RSS {info[name]['peak_rss'] / 2**20:7.1f} MiB" if name in info else ""
        print(f"  {name:<12} {secs:8.2f} s  {secs / n * 1e6:7.1f} us/file{extra}")
    ratio = times["ours noop"] / times["rsync noop"]
    print(f"  controller RSS before the runs: {info['rss_before'] / 2**20:.1f} MiB")
    print(
        f"  peak RSS {peak / 2**20:.1f} MiB ({(peak - info['rss_before']) / n:.0f} B per file above the start)"
    )
    print(f"  peak RSS under 1 GiB: {'yes' if peak < PEAK_GOAL else 'NO'}")
    print(f"  noop / rsync noop (goal <= 2): {ratio:.2f}")
    print(f"  local / rsync: {times['ours'] / times['rsync']:.2f}")
    print(f"  ours: {info['ours']}")
    print(f"  ours noop: {info['ours noop']}")
    out = Path(__file__).resolve().parents[1] / "reports" / f"bench_backup_files_{n}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"times": times, "info": info}, indent=2, default=str))
    # the copies go after the figures are out: removing two million files takes minutes
    subprocess.run(["rm", "-rf", str(work)], check=False)
    bad = info["ours"]["missing"] or info["ours"]["error"] or info["ours noop"]["copied_files"]
    bad = bad or info["ours"]["copied_files"] < n or peak >= PEAK_GOAL
    return 1 if bad else 0

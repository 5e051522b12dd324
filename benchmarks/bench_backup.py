"""Benchmark the decommission backup against `rsync -a` over ssh and `aws s3 sync`, in one run.

    python benchmarks/bench_backup.py            # b200-nvl8 lab host, --data-scale bench (~850 MB)
    python benchmarks/bench_backup.py --smoke    # CI: small scale (~35 MB), no S3 part, seconds
    python benchmarks/bench_backup.py --host NAME  # reuse a running lab host (`python -m gpulab up ...`)
    python benchmarks/bench_backup.py --files 1000000 --host NAME  # scale in files (backup_scale.py)

Measured, each from a cold destination: our local backup (walk, bulk stream, SHA-256 on both
ends, verify, SHA256SUMS) vs `rsync -a -e ssh`; the no-op rerun of each; our backup plus S3
upload vs rsync followed by `aws s3 sync`, each to a fresh moto server on loopback.  Goals
(the project's targets): local <= 1.2 x rsync; with S3 < rsync + aws s3 sync; no-op rerun <= 2 x rsync's.
Both comparisons alternate the tools, --rounds rounds (default 3) for the local copy and
--s3-rounds (default 3) for S3, and compare medians, because the machine is shared.  Next to each
wall time the CPU-seconds of every party are measured and printed: the tool itself (ours: this
process, its ssh clients and the ssh ControlMaster; rsync: rsync and its ssh; aws: the aws CLI),
moto (the S3 server, one Python process that both tools share), and the lab node (its cgroup:
sshd and the sender or rsync).  On this 2-core machine the sum decides the wall time once anything
else runs, so a reviewer can see what decided a ratio.  Needs root (the lab), rsync, awscli and
moto.  Prints a table and writes reports/bench_backup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402

from gpulab.host.lab import CLIENT_KEY, Lab, LabHost  # noqa: E402
from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url  # noqa: E402
from pytest_gpuhost.modules.backup.local import Backup, Manifest, load_manifest  # noqa: E402
from pytest_gpuhost.modules.backup.s3 import S3Upload, item_for, items_from_backup, parse_s3_url  # noqa: E402
from tests.helpers.s3server import FAKE_ENV, start_moto, stop_moto  # noqa: E402

MANIFEST = ROOT / "fixtures" / "manifests" / "b200-node-backup.yaml"


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """CPU-seconds (user + system) a live process has used, from /proc/PID/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def node_cpu(h: LabHost) -> float:
    """CPU-seconds used so far by every process of the lab node (its cgroup v2 cpu.stat)."""
    for stat_file in (
        Path(f"/sys/fs/cgroup/unified/gpulab/{h.name}/cpu.stat"),
        Path(f"/sys/fs/cgroup/gpulab/{h.name}/cpu.stat"),
    ):
        try:
            for line in stat_file.read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except OSError:
            continue
    return 0.0


def own_cpu() -> tuple[float, float]:
    """CPU-seconds of this process and of its reaped children (rsync, aws, ssh clients)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def ssh_master_cpu(conn: Any) -> float:
    """CPU-seconds of the connection's ssh ControlMaster (a daemon, never reaped by us)."""
    path = getattr(getattr(getattr(conn, "launcher", None), "transport", None), "control_path", None)
    if not path:
        return 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-M" in argv and os.fsencode(path) in argv:
            return proc_cpu(int(pid))
    return 0.0


class Cpu:
    """CPU-seconds of each party during one timed run: the tool, moto, the lab node."""

    def __init__(self, h: LabHost, moto_pid: int | None = None) -> None:
        self.h = h
        self.moto_pid = moto_pid
        self.me, self.kids = own_cpu()
        self.node = node_cpu(h)
        self.moto = proc_cpu(moto_pid) if moto_pid else 0.0

    def stop(self, extra: float = 0.0, *, tool_is_self: bool = True) -> dict[str, float]:
        me, kids = own_cpu()
        tool = (kids - self.kids) + (me - self.me if tool_is_self else 0.0) + extra
        out = {"tool": tool, "node": node_cpu(self.h) - self.node}
        if self.moto_pid:
            out["moto"] = proc_cpu(self.moto_pid) - self.moto
        out["total"] = sum(out.values())
        return {k: round(v, 2) for k, v in out.items()}


def our_backup(
    h: LabHost,
    dest: Path,
    s3: dict[str, Any] | None = None,
    *,
    manifest: Manifest | None = None,
) -> dict[str, Any]:
    """One full run of our backup, connection included: walk, plan, stream, verify, checksums (+ S3).

    manifest: the lab node's manifest, every category to S3, unless given."""
    opts = TargetOptions(
        identity=str(CLIENT_KEY),
        known_hosts=str(h.known_hosts),
        host_key_policy="strict",
        command_timeout=600,
        connect_timeout=10,
    )
    if manifest is None:
        manifest = load_manifest(MANIFEST)
        # every category to S3, so that aws s3 sync of the whole tree is a like-for-like comparison
        manifest = replace(manifest, categories=tuple(replace(c, s3=True) for c in manifest.categories))
    conn = open_connection(parse_host_url(f"ssh://root@{h.address}"), opts)
    out: dict[str, Any] = {}
    try:
        b = Backup(conn, manifest, dest, stall_timeout=120, op_timeout=1800)
        session = up = None
        if s3 is not None:
            # as the suite does: upload while the local copy runs, then catch up on anything left
            up = S3Upload(dest, parse_s3_url(s3["url"]), endpoint=s3["endpoint"], workers=8)
            session = up.start(skip_current=True)
            b.on_placed = lambda f, rec: session.offer(item_for(f, rec))
        listing = b.walk()
        res = b.run(b.plan(listing))
        missing = b.verify(listing)
        b.write_checksums(listing)
        b.finish()
        out |= {
            "copied_files": res.copied_files,
            "copied_bytes": res.copied_bytes,
            "missing": len(missing),
            "error": res.error,
            "failed": len(res.failed),
            "round_trips": conn.round_trips,
            "copy_s": round(res.duration, 2),
        }
        if up is not None and session is not None:
            copied = time.perf_counter()
            during = session.finish()
            out["upload_tail_s"] = round(time.perf_counter() - copied, 2)  # uploads left when the copy ended
            # as the suite's "data in S3" step: one listing of the prefix proves every object
            # (present, with the ETag and size recorded when its upload was verified); only what
            # it does not prove is uploaded again and checked again
            items, unverified = items_from_backup(b, listing)
            plan = up.plan(items)
            after = up.run(plan) if plan.upload else None
            s3_missing = up.verify(items) if after is not None else []
            up.finish()
            out.update(
                uploaded_during_copy=during.uploaded,
                uploaded_after=after.uploaded if after else 0,
                upload_failed=len(during.failed) + (len(after.failed) if after else 0),
                unverified=len(unverified),
                s3_missing=len(s3_missing),
                open_uploads=len(after.open_uploads_after if after else during.open_uploads_after),
            )
        return out
    finally:
        out["ssh_master_cpu"] = ssh_master_cpu(conn)
        conn.close()


def rsync(h: LabHost, dest: Path, src: str = "/data/") -> subprocess.CompletedProcess[bytes]:
    ssh = f"ssh -i {CLIENT_KEY} -o UserKnownHostsFile={h.known_hosts} -o StrictHostKeyChecking=yes -o BatchMode=yes"
    return subprocess.run(
        ["rsync", "-a", "-e", ssh, f"root@{h.address}:{src}", f"{dest}/"], capture_output=True, timeout=3600
    )


def aws_sync(src: Path, url: str, endpoint: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, **FAKE_ENV}
    return subprocess.run(
        [
            "aws",
            "s3",
            "sync",
            str(src),
            url,
            "--endpoint-url",
            endpoint,
            "--no-follow-symlinks",
            "--only-show-errors",
        ],
        capture_output=True,
        env=env,
        timeout=3600,
    )


def median_cpu(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The median of each CPU figure over the rounds."""
    keys = {k for r in rounds for k in r}
    return {k: round(statistics.median(r.get(k, 0.0) for r in rounds), 2) for k in sorted(keys)}


def scale_main(args: argparse.Namespace) -> int:
    """--files N: the backup of N small files against rsync (see backup_scale.py)."""
    from benchmarks.backup_scale import run_scale

    lab = Lab()
    if args.host:
        return run_scale(args, lab.get(args.host), our_backup, rsync)
    h = lab.up("b200-nvl8", name=f"bench-bkn-{os.getpid()}", data_scale="small")
    try:
        return run_scale(args, h, our_backup, rsync)
    finally:
        if not args.keep:
            h.down()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="small data scale, for CI")
    ap.add_argument("--host", help="use this running lab host instead of booting one")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 comparison (the default with --smoke)")
    ap.add_argument("--s3", action="store_true", help="with --smoke: include the S3 comparison (~40 s)")
    ap.add_argument(
        "--rounds", type=int, default=0, help="rounds of the local comparison (default 3; smoke 1)"
    )
    ap.add_argument("--s3-rounds", type=int, default=3, help="rounds of the S3 comparison (default 3)")
    ap.add_argument(
        "--files",
        type=int,
        default=0,
        help="scale in files: N small files (backup_scale.py), ours and rsync, cold and no-op, peak RSS",
    )
    ap.add_argument("--keep", action="store_true", help="with --files and no --host: leave the host up")
    args = ap.parse_args()
    if args.files:
        return scale_main(args)
    scale = "small" if args.smoke else "bench"
    args.rounds = args.rounds or (1 if args.smoke else 3)
    if args.smoke and not args.s3:
        args.no_s3 = True
    lab = Lab()
    booted = None
    if args.host:
        h = lab.get(args.host)
    else:
        booted = h = lab.up("b200-nvl8", name=f"bench-bk-{os.getpid()}", data_scale=scale)
    work = Path(tempfile.mkdtemp(prefix="bench-backup-"))
    moto = None
    times: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[dict[str, float]]] = {}  # per sample: CPU-seconds of tool, node, moto
    info: dict[str, Any] = {"scale": scale, "host": h.name}
    try:
        # The copy's correctness check (every file verified) needs data that does not change under it:
        # stop the node's servers first, as the decommission suite does, so no log grows while it is
        # copied (with them running, a smoke run once reported `missing: 3`). The pattern is anchored
        # on the servers' argv[0] so it cannot match the remote shell that runs pkill; their renamed
        # worker children (`sglang::scheduler_TP0`, ...) go too.
        h.ssh(
            [
                "sh",
                "-c",
                "pkill -KILL -f '^(python3 -m sglang[.]launch_server|sglang::)'; pkill -KILL -x tail; true",
            ]
        )
        # warm the node's page cache equally for both tools
        h.ssh("find /data -type f -exec cat {} + >/dev/null")
        # the machine is shared: alternate the tools, round after round, and compare medians

        def sample(name: str, secs: float, used: dict[str, float]) -> None:
            samples.setdefault(name, []).append(secs)
            cpu.setdefault(name, []).append(used)

        def run_rsync(name: str, dest: Path) -> None:
            c = Cpu(h)
            t, r = timed(lambda: rsync(h, dest))
            if r.returncode != 0:
                print("rsync failed:", r.stderr.decode(errors="replace")[-2000:], file=sys.stderr)
            sample(name, t, c.stop(tool_is_self=False))

        def run_ours(name: str, dest: Path) -> None:
            c = Cpu(h)
            t, info[name] = timed(lambda: our_backup(h, dest))
            sample(name, t, c.stop(info[name]["ssh_master_cpu"]))

        for rnd in range(args.rounds):
            for d in ("rsync", "ours"):
                shutil.rmtree(work / d, ignore_errors=True)
            order = ("rsync", "ours") if rnd % 2 == 0 else ("ours", "rsync")
            for suffix in ("", " noop"):
                for tool in order:
                    if tool == "rsync":
                        run_rsync("rsync" + suffix, work / "rsync")
                    else:
                        run_ours("ours" + suffix, work / "ours")
        for k, v in samples.items():
            times[k] = statistics.median(v)
        if not args.no_s3:
            # rsync followed by aws s3 sync vs ours with S3, each from an empty directory and a fresh
            # moto server (moto keeps objects in memory and slows as it fills), alternating per round
            for rnd in range(args.s3_rounds):
                order = ("aws", "ours") if rnd % 2 == 0 else ("ours", "aws")
                for tool in order:
                    moto, endpoint = start_moto(work / f"moto-{tool}.log")
                    boto3.client(
                        "s3",
                        endpoint_url=endpoint,
                        aws_access_key_id=FAKE_ENV["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=FAKE_ENV["AWS_SECRET_ACCESS_KEY"],
                        region_name=FAKE_ENV["AWS_DEFAULT_REGION"],
                    ).create_bucket(Bucket="bench")
                    # the 1-minute load average as each run starts (other sessions' work)
                    info.setdefault("load", []).append(f"{tool} {os.getloadavg()[0]:.1f}")
                    if tool == "aws":
                        shutil.rmtree(work / "rsync-s3", ignore_errors=True)
                        c = Cpu(h, moto.pid)
                        t_r, _ = timed(lambda: rsync(h, work / "rsync-s3"))
                        c_r = c.stop(tool_is_self=False)
                        c_a = Cpu(h, moto.pid)
                        t_a, a = timed(
                            lambda ep=endpoint: aws_sync(work / "rsync-s3", "s3://bench/rsync", ep)
                        )
                        sample("aws s3 sync", t_a, c_a.stop(tool_is_self=False))
                        sample("rsync + aws s3 sync", t_r + t_a, c.stop(tool_is_self=False))
                        cpu["rsync + aws s3 sync"][-1]["rsync"] = c_r["tool"]
                        info["aws rc"] = a.returncode
                        info["aws errors"] = a.stderr.decode(errors="replace").strip().splitlines()[-3:]
                    else:
                        shutil.rmtree(work / "ours-s3", ignore_errors=True)
                        os.environ.update(FAKE_ENV)
                        c = Cpu(h, moto.pid)
                        t, info["ours + S3"] = timed(
                            lambda ep=endpoint: our_backup(
                                h, work / "ours-s3", {"url": "s3://bench/ours", "endpoint": ep}
                            )
                        )
                        sample("ours + S3", t, c.stop(info["ours + S3"]["ssh_master_cpu"]))
                        info.setdefault("ours + S3 rounds", []).append(info["ours + S3"])
                    stop_moto(moto)
                    moto = None
            for k in ("rsync + aws s3 sync", "aws s3 sync", "ours + S3"):
                times[k] = statistics.median(samples[k])
        du = subprocess.run(
            ["du", "-sb", str(work / "rsync")], capture_output=True, text=True
        ).stdout.split()[0]
        info["bytes"] = int(du)
    finally:
        if moto is not None:
            stop_moto(moto)
        shutil.rmtree(work, ignore_errors=True)
        if booted is not None:
            booted.down()
    ratios = {
        "local / rsync (goal <= 1.2)": times["ours"] / times["rsync"],
        "noop / rsync noop (goal <= 2)": times["ours noop"] / times["rsync noop"],
    }
    if "ours + S3" in times:
        ratios["ours+S3 / (rsync + aws s3 sync) (goal < 1)"] = (
            times["ours + S3"] / times["rsync + aws s3 sync"]
        )
        # what the wall-time ratio tends to on a busy machine: all CPU-seconds spent, moto included
        ratios["CPU-s sum, ours+S3 / (rsync + aws s3 sync)"] = (
            median_cpu(cpu["ours + S3"])["total"] / median_cpu(cpu["rsync + aws s3 sync"])["total"]
        )
    print(f"\nbackup benchmark, b200-nvl8 /data at scale {scale} ({info.get('bytes', 0) / 1e6:.0f} MB)")
    print("  wall: median (each round); CPU-seconds, median over the rounds: tool / moto / node / sum")
    for name, secs in times.items():
        each = ", ".join(f"{x:.2f}" for x in samples[name])
        used = median_cpu(cpu[name])
        parts = (
            f"{used['tool']:6.2f} / {used.get('moto', 0.0):6.2f} / {used['node']:5.2f} / {used['total']:6.2f}"
        )
        print(f"  {name:<20} {secs:8.2f} s  ({each})   CPU {parts}")
    for name, ratio in ratios.items():
        print(f"  {name:<45} {ratio:6.2f}")
    print(f"  ours: {info['ours']}")
    print(f"  ours noop: {info['ours noop']}")
    if "ours + S3" in info:
        print(f"  ours + S3: {info['ours + S3']}; aws rc {info['aws rc']} {info['aws errors']}")
        print(f"  load average as each S3 run started: {', '.join(info['load'])}")
    out = ROOT / "reports" / ("bench_backup_smoke.json" if args.smoke else "bench_backup.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "times": times,
                "samples": samples,
                "cpu_seconds": cpu,
                "cpu_median": {k: median_cpu(v) for k, v in cpu.items()},
                "ratios": ratios,
                "info": info,
            },
            indent=2,
            default=str,
        )
    )
    bad = info["ours"]["missing"] or info["ours"]["error"] or info["ours noop"]["copied_files"]
    s3 = info.get("ours + S3")
    if s3 is not None:
        bad = bad or s3["s3_missing"] or s3["unverified"] or s3["upload_failed"] or s3["open_uploads"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

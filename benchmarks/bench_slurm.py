"""suites/health through a real Slurm on N lab hosts: ``srun -N N`` against local://, then the merge.

    sudo python benchmarks/bench_slurm.py              # 16 nodes, 3 timed rounds
    sudo python benchmarks/bench_slurm.py --smoke      # 2 nodes, 1 round (CI)

Boots N ``health-ok`` lab hosts (host names gpu-node-01..N, the Slurm node names), starts
slurmctld here and slurmd in each (gpulab/slurm/cluster.py) and moto on the controller's lab-side
address. Each round: ``srun --nodes=N --ntasks-per-node=1`` runs ``pytest suites/health
--host=local:// --check-only`` on every node, each node writes its summary to S3, then
``python -m pytest_gpuhost.merge s3://...`` builds the fleet report (which must hold N hosts). One
untimed round first plays the previous night (the first run of each node records its kernel-log
baseline). Reported: wall seconds of srun and of the merge (medians), and a CPU account of the
timed rounds by who spent it: the nodes (each node's systemd with every process it reaped: the
job steps with the tests and tools they ran, read from /proc as cumulative child time), the lab's FUSE sysfs daemons, the controller's
slurmctld and munged, and this script's children (srun, merge).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpulab.host.lab import Lab, LabError, LabHost  # noqa: E402
from gpulab.profiles.load import load_profile  # noqa: E402
from gpulab.profiles.types import Profile  # noqa: E402
from gpulab.slurm.cluster import SlurmCluster, slurm_unavailable  # noqa: E402
from tests.helpers.s3server import FAKE_ENV, start_moto, stop_moto  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
INOTIFY = Path("/proc/sys/fs/inotify/max_user_instances")
INOTIFY_WANT = 1024


def ensure_inotify(hosts: int) -> int | None:
    """Raise fs.inotify.max_user_instances when N more lab hosts would run out of it; return the old value.

    Each lab host's systemd takes about 8 inotify instances, and the kernel's default of 128 per
    user ends a 16-host lab (plus other lab hosts) with "systemd died while booting"
    (as benchmarks/bench_health.py does; inotify(7), /proc/sys/fs/inotify/max_user_instances).
    """
    try:
        current = int(INOTIFY.read_text())
    except (OSError, ValueError):
        return None
    if current < INOTIFY_WANT and hosts * 10 + 128 > current:
        INOTIFY.write_text(f"{INOTIFY_WANT}\n")
        print(f"raised fs.inotify.max_user_instances {current} -> {INOTIFY_WANT} for {hosts} lab hosts")
        return current
    return None


def _stat_cpu(text: str, children: bool) -> float:
    f = text.rsplit(")", 1)[1].split()
    ticks = int(f[11]) + int(f[12]) + ((int(f[13]) + int(f[14])) if children else 0)
    return ticks / TICK


def node_cpu(h: LabHost) -> float:
    """CPU seconds so far of the node's systemd with every process it reaped.

    slurmd starts each step's slurmstepd through a child that exits at once (a double fork), so
    the step is reparented to the node's PID 1 and its time (with the tests and tools it reaped)
    lands in PID 1's cumulative child time when it ends (proc(5), cutime/cstime).
    """
    try:
        return _stat_cpu(Path(f"/proc/{h.init_pid()}/stat").read_text(), children=True)
    except (OSError, ValueError, IndexError):
        return float("nan")


def pid_cpu(pid: int | None) -> float:
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat").read_text(), children=False)
    except (OSError, ValueError, IndexError):
        return float("nan")


def account(c: SlurmCluster, hosts: list[LabHost]) -> dict[str, float]:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    sysfs = [int((h.dir / "pids" / "sysfs").read_text()) for h in hosts]
    procs = c._procs  # the controller's daemons, started by the cluster
    return {
        "nodes": sum(node_cpu(h) for h in hosts),
        "sysfs": sum(pid_cpu(p) for p in sysfs),
        "slurmctld+munged": sum(
            pid_cpu(procs[w].pid if w in procs else None) for w in ("slurmctld", "munged")
        ),
        "srun+merge": kids.ru_utime + kids.ru_stime,
    }


def up(lab: Lab, prof: Profile, name: str, tries: int = 3) -> LabHost:
    """Boot a lab host, again after a failed boot (a loaded machine can miss the boot timeout)."""
    for k in range(tries):
        try:
            return lab.up(prof, name=name)
        except LabError as e:
            if k == tries - 1:
                raise
            print(f"boot of {name} failed ({e}); again", flush=True)
    raise AssertionError("unreachable")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="2 nodes, 1 round")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n, rounds = (2, 1) if args.smoke else (args.nodes, args.rounds)
    why = slurm_unavailable()
    if why:
        print(f"bench_slurm: skipped: {why}")
        return 0
    lab = Lab()
    lab.check()
    tag = f"bsl{os.getpid() % 100000}"
    hosts: list[LabHost] = []
    cluster: SlurmCluster | None = None
    moto = None
    tmp = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    restore_inotify = ensure_inotify(n)
    try:
        t0 = time.monotonic()
        for i in range(1, n + 1):
            prof = load_profile("health-ok", overrides={"hostname": f"gpu-node-{i:02d}"})
            hosts.append(up(lab, prof, f"{tag}-{i:02d}"))
        t_boot = time.monotonic() - t0
        t0 = time.monotonic()
        cluster = SlurmCluster(hosts).start()
        t_slurm = time.monotonic() - t0
        moto, url = start_moto(tmp / "moto.log", host=cluster.ctl_address)
        import boto3

        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        boto3.client(
            "s3", endpoint_url=url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        ).create_bucket(Bucket=bucket)  # fmt: skip
        env = {**FAKE_ENV, "AWS_ENDPOINT_URL": url}
        print(f"{n} nodes booted in {t_boot:.1f} s, Slurm up (all nodes idle) in {t_slurm:.2f} s", flush=True)

        idle_waits: list[float] = []

        def night(k: int) -> tuple[float, float]:
            dest = f"s3://{bucket}/night{k}/"
            argv = [
                "srun", f"--nodes={n}", "--ntasks-per-node=1", f"--chdir={ROOT}", "--time=10",
                # each node keeps its task's output in the cluster's directory (the summary goes to S3)
                "--input=none", f"--output={cluster.dir}/job-%j-%N.out",  # type: ignore[union-attr]
                str(ROOT / ".venv/bin/python"), "-m", "pytest", "suites/health", "--host=local://",
                "--check-only", "-p", "no:cacheprovider", "-o", "addopts=", "-q",
                "--report-dir=/tmp/gpuhost", f"--fleet-json={dest}",
            ]  # fmt: skip
            t = time.monotonic()
            r = cluster.run(argv, timeout=600, env=env)  # type: ignore[union-attr]
            t_srun = time.monotonic() - t
            if r.returncode != 0:
                raise SystemExit(f"bench_slurm: srun exited {r.returncode}: {(r.stderr or r.stdout)[-2000:]}")
            out = tmp / f"night{k}.html"
            t = time.monotonic()
            p = subprocess.run(
                [sys.executable, "-m", "pytest_gpuhost.merge", dest, "--endpoint-url", url, "-o", str(out)],
                cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **FAKE_ENV}, check=False,
            )  # fmt: skip
            t_merge = time.monotonic() - t
            merged = json.loads(out.with_suffix(".json").read_text())
            if p.returncode != 0 or len(merged["hosts"]) != n:
                raise SystemExit(
                    f"bench_slurm: merge exited {p.returncode} with {len(merged['hosts'])} hosts"
                )
            t = time.monotonic()
            cluster.wait_idle(timeout=300)  # type: ignore[union-attr]  # every node free for the next round
            idle_waits.append(time.monotonic() - t)
            return t_srun, t_merge

        first = night(0)
        print(f"first night (untimed): srun {first[0]:.2f} s, merge {first[1]:.2f} s", flush=True)
        before = account(cluster, hosts)
        sruns, merges = [], []
        for k in range(1, rounds + 1):
            s, m = night(k)
            sruns.append(s)
            merges.append(m)
            print(f"round {k}: srun {s:.2f} s, merge {m:.2f} s", flush=True)
        after = account(cluster, hosts)
        cpu = {k: (after[k] - before[k]) / rounds for k in before}
        print(
            f"nodes={n}: srun -N {n} health {statistics.median(sruns):.2f} s, merge {statistics.median(merges):.2f} s,"
            f" total {statistics.median(sruns) + statistics.median(merges):.2f} s wall (median of {rounds})"
        )
        print(
            f"after each job, until every node was idle again: {', '.join(f'{w:.1f}' for w in idle_waits)} s"
        )
        print(
            "CPU s per round: "
            + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
            + f"; sum {sum(cpu.values()):.2f}"
        )
    finally:
        # Each step on its own: one that fails (or a second Ctrl-C) must not leave the rest behind.
        steps: list[Callable[[], object]] = []
        if moto is not None:
            steps.append(lambda: stop_moto(moto))  # type: ignore[arg-type]
        if cluster is not None:
            steps.append(cluster.stop)
        steps += [h.down for h in hosts]
        for step in steps:
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - report it, then go on cleaning up
                print(f"bench_slurm: cleanup step failed: {e!r}", file=sys.stderr)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
        if restore_inotify is not None and INOTIFY.read_text().strip() == str(INOTIFY_WANT):
            INOTIFY.write_text(f"{restore_inotify}\n")  # leave the machine as it was
    return 0


if __name__ == "__main__":
    sys.exit(main())

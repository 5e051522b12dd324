"""Fleet health check speed: suites/health vs testinfra and pdsh, on lab hosts.

Boots up to 16 lab hosts (profile health-ok: 4 GPUs, SGLang, no container) with 25 ms netem
delay on each link, then for 1, 4 and 16 hosts runs, one run each, the same -n:

* ours:      pytest suites/health --inventory=... --check-only -n N   (one agent per host,
             every fact in one request, plus the kernel-log cursor commit)
* testinfra: pytest benchmarks/testinfra_health -p no:gpuhost --hosts=paramiko://... -n N
             (the same 19 checks, one host.run each: a new SSH channel per command)
* pdsh:      pdsh -R ssh -w HOSTS ONE_SHOT (health_pdsh.py publishes the script: the same four
             nvidia-smi runs, dmesg and systemctl; one login per host, all at once, no verdicts)
* workers:   ours with reports, --gpuhost-scheduling=workers (xdist workers even where the plugin
             would check in its own process; only with --suites ...,workers)

and prints wall time (ours twice: without reports, like the testinfra suite, and with the
pytest-html/JSON/JUnit reports a nightly run writes; both after one untimed "previous night" run
of ours, whose time is printed too, since a nightly run finds the state the last one left), SSH
round trips per host for our facts (and for the connection as a whole, agent start included)
and commands per host for testinfra. Goals: <= 2 round trips
per host for the facts; 16 hosts >= 5x faster than testinfra; 16 hosts <= 3x the time of 1.

Each run of ours also prints where its time went, per phase (health_phases.py, a -p plugin:
process starts, collection, SSH login + agent start and the facts request per host from the
connections' timing record, the checks, the reports). Beside pdsh it prints wall time and CPU per
host, controller (this script's children: pytest, or pdsh and its ssh clients) and node (the lab
host's cgroup, cpu.stat), and the goals: 16 hosts within 1.5x of pdsh, 1 within 2x, CPU within 2x.

Every run also gets a CPU account (the machine has few cores, so CPU decides the wall time of a
large run): CPU seconds of the pytest processes (controller and workers), of the lab hosts (their
cgroups: sshd, the agent or testinfra's commands, the emulated nvidia-smi and dmesg, systemd),
of the lab's FUSE sysfs daemons, and of this script (the user-space delay proxy, when used).
Both suites run from compiled bytecode, as installed packages do, even where the environment sets
PYTHONDONTWRITEBYTECODE (`--no-bytecode-cache` keeps the environment's setting).

    sudo python benchmarks/bench_health.py             # 1, 4, 16 hosts, -n 2, one run each
    sudo python benchmarks/bench_health.py --repeat 3  # medians of 3 alternating rounds
    sudo python benchmarks/bench_health.py --smoke     # CI: 1 and 2 hosts, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import health_pdsh  # noqa: E402  (beside this file)
from delay_proxy import DelayProxy  # noqa: E402  (beside this file)
from health_cpu import CGROUP_ROOTS, CpuAccount, cpu_now, cpu_since  # noqa: E402  (beside this file)
from health_phases import phases  # noqa: E402  (beside this file)
from proc_acct import Accounting, cgroup_pids, summary  # noqa: E402  (beside this file)

from gpulab.host.lab import CLIENT_KEY, Lab, LabError, LabHost  # noqa: E402

CHECKS = 19
# Plugins neither suite uses, blocked for both: the cache writes .pytest_cache, and Hypothesis's
# plugin (in the development environment, when installed) imports hypothesis in every pytest
# process at the terminal summary, about 0.5 CPU-s each.
UNRELATED = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")


def netem_available() -> bool:
    """Say whether this kernel has the netem qdisc (some sandboxes ship without sch_netem)."""
    probe = subprocess.run(
        ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], capture_output=True, check=False
    )
    if probe.returncode == 0:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False)
        return True
    return False


INOTIFY = Path("/proc/sys/fs/inotify/max_user_instances")


def ensure_inotify(hosts: int) -> int | None:
    """Raise fs.inotify.max_user_instances if N more systemd instances would run out of it.

    Each lab host's systemd takes about 8 inotify instances; the kernel default of 128 ends a
    16-host lab (plus whatever else runs) with "systemd died while booting". Returns the value
    to restore afterwards (None when nothing was changed).
    """
    try:
        current = int(INOTIFY.read_text())
    except (OSError, ValueError):
        return None
    want = 1024
    if current < want and hosts * 10 + 128 > current:
        INOTIFY.write_text(f"{want}\n")
        print(f"raised fs.inotify.max_user_instances {current} -> {want} for {hosts} lab hosts")
        return current
    return None


@dataclass
class Endpoint:
    """Where the suites reach one lab host: its own address, or the delay proxy in front of it."""

    host: LabHost
    address: str
    port: int

    @property
    def known_hosts(self) -> str:
        text = Path(self.host.known_hosts).read_text()
        if self.port == 22:
            return text
        # OpenSSH and paramiko look up a non-22 port as "[addr]:port".
        return "".join(
            f"[{self.address}]:{self.port} {line.split(None, 1)[1]}\n"
            for line in text.splitlines()
            if line.strip()
        )


def write_inventory(path: Path, hosts: list[Endpoint]) -> None:
    lines = [
        "all:",
        "  vars: {ansible_user: root, service: sglang-qwen, service_port: 30000, gpu_count: 4}",
        "  hosts:",
    ]
    lines += [f"    {e.host.name}: {{ansible_host: {e.address}, ansible_port: {e.port}}}" for e in hosts]
    path.write_text("\n".join(lines) + "\n")


ACCT: list[str] | None = None  # --acct: the exited processes' CPU summary of the last run


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 900,
    hosts: list[LabHost] | None = None,
) -> tuple[float, str, int, CpuAccount]:
    """Run a suite; return its wall time, output, exit code and CPU account (over `hosts`)."""
    before = cpu_now(hosts or [])
    acct = Accounting() if ACCT is not None else None
    lab_pids = cgroup_pids(r / h.cgroup for h in hosts or [] for r in CGROUP_ROOTS) if acct else set()
    t0 = time.monotonic()
    if acct:
        acct.__enter__()
    try:
        p = subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    finally:
        if acct:
            acct.__exit__()
    took = time.monotonic() - t0
    if acct and ACCT is not None:
        ACCT[:] = summary(acct.records, {"pytest": {os.getpid()}, "lab hosts": lab_pids})
        name = "ours" if "suites/health" in argv else argv[0] if argv[0] == "pdsh" else "testinfra"
        print(
            f"    exited processes ({name}, {len(hosts or [])} hosts, {took:.2f} s), CPU-s/count:", flush=True
        )
        for line in ACCT:
            print(f"      {line}", flush=True)
    return took, p.stdout + p.stderr, p.returncode, cpu_since(before, hosts or [])


def ours(
    tmp: Path, hosts: list[Endpoint], known: Path, workers: int, reports: bool, *extra: str
) -> dict[str, Any]:
    inv = tmp / f"fleet-{len(hosts)}.yaml"
    write_inventory(inv, hosts)
    summary = tmp / f"ours-{len(hosts)}-{reports}.json"
    report_dir = str(tmp) if reports else "none"
    record = tmp / f"phases-{len(hosts)}-{reports}-{len(extra)}.jsonl"
    record.unlink(missing_ok=True)
    # health_phases (beside this file, a -p plugin) stamps each pytest process's phases into `record`
    env = dict(os.environ, GPUHOST_PHASES=str(record), PYTHONPATH=str(Path(__file__).parent))
    t0 = time.time()
    took, out, rc, cpu = run(
        [
            sys.executable, "-m", "pytest", "suites/health", "-q", *UNRELATED, "-o", "addopts=", "-p", "health_phases",
            f"--inventory={inv}", f"--ssh-identity={CLIENT_KEY}", f"--known-hosts={known}", "--check-only",
            "-n", str(workers), f"--report-dir={report_dir}", f"--fleet-json={summary}", *extra,
        ],
        env=env,
        hosts=[e.host for e in hosts],
    )  # fmt: skip
    t_end = time.time()
    data = json.loads(summary.read_text())
    bad = {h: v["status"] for h, v in data["hosts"].items() if v["status"] != "ok"}
    if rc != 0 or bad:
        print(out[-3000:], file=sys.stderr)
        raise SystemExit(f"suites/health did not pass on healthy lab hosts: rc={rc} {bad}")
    facts = [v["round_trips"] for v in data["hosts"].values()]
    conn = [v["conn_round_trips"] for v in data["hosts"].values()]
    return {
        "wall": took, "facts_rt": max(facts), "conn_rt": max(conn), "cpu": cpu, "phases": phases(record, t0, t_end)
    }  # fmt: skip


def baseline(tmp: Path, hosts: list[Endpoint], workers: int) -> dict[str, Any]:
    log = tmp / f"testinfra-{len(hosts)}.log"
    log.unlink(missing_ok=True)  # a log per run: commands per host are counted for this run only
    env = dict(os.environ, TESTINFRA_CMD_LOG=str(log))
    urls = ",".join(f"paramiko://root@{e.address}:{e.port}" for e in hosts)
    took, out, rc, cpu = run(
        [
            sys.executable, "-m", "pytest", "benchmarks/testinfra_health", "-q", *UNRELATED,
            "-p", "no:gpuhost", "-o", "addopts=", "-W", "ignore", f"--hosts={urls}",
            f"--ssh-identity-file={CLIENT_KEY}", "-n", str(workers),
        ],
        env=env,
        hosts=[e.host for e in hosts],
    )  # fmt: skip
    if rc != 0:
        print(out[-3000:], file=sys.stderr)
        raise SystemExit(f"the testinfra suite did not pass on healthy lab hosts: rc={rc}")
    per_host = Counter(json.loads(line)["host"] for line in log.read_text().splitlines())
    return {"wall": took, "cmds": max(per_host.values()), "cpu": cpu}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time (the upper one of an even count); its walls listed."""
    ordered = sorted(runs, key=lambda x: x["wall"])
    out = dict(ordered[len(ordered) // 2])
    out["walls"] = [x["wall"] for x in runs]
    return out


def main() -> int:
    """Boot the hosts, run both suites per size, print the table and the goals."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CI size: 1 and 2 hosts")
    ap.add_argument("--sizes", default="1,4,16", help="host counts to measure (default 1,4,16)")
    ap.add_argument(
        "-n",
        "--workers",
        type=int,
        default=2,
        help="xdist workers for both suites (default 2, one per core here)",
    )
    ap.add_argument("--delay-ms", type=int, default=25, help="delay each way on each lab link (default 25)")
    ap.add_argument("--profile", default="health-ok")
    ap.add_argument(
        "--repeat", type=int, default=1, help="rounds per size, medians reported (default 1: one run each)"
    )
    ap.add_argument(
        "--no-bytecode-cache",
        action="store_true",
        help="keep PYTHONDONTWRITEBYTECODE from the environment (every pytest process compiles its modules)",
    )
    ap.add_argument(
        "--suites",
        default="ours,reports,testinfra,pdsh",
        help="which runs to time: ours (no reports), reports (ours with reports), testinfra, pdsh, workers "
        "(ours with reports on -n workers even where it would check in process); default all but workers; pdsh is left out where it is not installed",
    )
    ap.add_argument(
        "--acct",
        action="store_true",
        help="print every run's exited processes' CPU by name (BSD process accounting; see proc_acct.py)",
    )
    args = ap.parse_args()
    global ACCT
    ACCT = [] if args.acct else None
    wanted = {"ours": "o", "reports": "r", "testinfra": "b", "pdsh": "p", "workers": "i"}
    try:
        kinds = {wanted[k.strip()] for k in args.suites.split(",")}
    except KeyError as exc:
        raise SystemExit(
            f"bench_health: --suites {args.suites!r}: unknown {exc}; use ours, reports, testinfra, pdsh"
        ) from None
    if "p" in kinds and health_pdsh.available() is None:
        print("bench_health: pdsh not installed (Debian package pdsh; scripts/setup.sh): no pdsh baseline")
        kinds.discard("p")
    sizes = [1, 2] if args.smoke else sorted({int(s) for s in args.sizes.split(",")})
    workers = 2 if args.smoke else args.workers
    lab = Lab()
    try:
        lab.check()
    except LabError as exc:
        print(f"bench_health: skipped: lab unavailable: {exc}")
        return 0
    tag = f"bh{os.getpid() % 100000}"
    hosts: list[LabHost] = []
    proxy: DelayProxy | None = None
    restore_inotify: int | None = None
    try:
        restore_inotify = ensure_inotify(max(sizes))
        t0 = time.monotonic()
        for i in range(max(sizes)):
            hosts.append(lab.up(args.profile, name=f"{tag}-{i:02d}"))
        how = "no delay"
        if args.delay_ms and netem_available():
            for h in hosts:
                h.set_netem(delay_ms=args.delay_ms)
            how = f"{args.delay_ms} ms netem delay on both ends of each link"
        elif args.delay_ms:
            proxy = DelayProxy(args.delay_ms / 1000)
            how = f"{args.delay_ms} ms delay each way by a user-space TCP proxy (this kernel has no netem)"
        eps = [
            Endpoint(h, "127.0.0.1", proxy.add(h.address, 22)) if proxy else Endpoint(h, h.address, 22)
            for h in hosts
        ]
        # Warm every host up the same way for both suites (page cache, first Python start),
        # so that whichever suite runs first does not pay for it.
        for h in hosts:
            h.ssh(
                "python3 -c pass; nvidia-smi >/dev/null; dmesg >/dev/null; systemctl is-active sglang-qwen >/dev/null",
                timeout=60,
            )
        print(
            f"{len(hosts)} lab hosts ({args.profile}) up in {time.monotonic() - t0:.1f} s; {how}; -n {workers}"
        )
        with tempfile.TemporaryDirectory(prefix="bench-health-") as d:
            tmp = Path(d)
            known = tmp / "known_hosts"
            known.write_text("".join(e.known_hosts for e in eps))
            # The previous night: one untimed run of ours over every host leaves what each
            # nightly run finds from the second night on (the kernel-log cursor, the CUDA version
            # cached for the driver). Its time is the first night's, printed on its own.
            bytecode = "as found in the environment"
            if not args.no_bytecode_cache:
                # An installed suite runs from compiled bytecode (pip compiles it; Python caches it
                # on first import). A sandbox that sets PYTHONDONTWRITEBYTECODE makes every pytest
                # process compile every module and re-run pytest's assertion rewriting of every
                # plugin instead: ~0.2 CPU-s per process for testinfra's suite, more for ours.
                # Both suites get the cache, in a directory of this run (warmed by the untimed
                # runs below).
                os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
                os.environ["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
                bytecode = "compiled bytecode cached (--no-bytecode-cache: as found in the environment)"
            print(f"bytecode: {bytecode}")
            baseline(tmp, eps[:1], workers)  # untimed: compiles the testinfra suite's modules
            first_night = ours(tmp, eps, known, workers, reports=False)
            print(
                f"first night (no gpuhost state on the hosts yet), {len(eps)} hosts: {first_night['wall']:.2f} s"
            )
            rows = []
            pdsh_goals: list[tuple[str, bool]] = []
            for n in sizes:
                # Like for like first (the testinfra suite writes no report), then with ours'
                # pytest-html report, JSON evidence and JUnit, as a nightly run writes them.
                # --repeat N: N rounds of the three, alternating which suite goes first; medians
                runs: dict[str, list[dict[str, Any]]] = {k: [] for k in "orbpi"}
                loads: list[float] = []
                for rnd in range(args.repeat):
                    loads.append(os.getloadavg()[0])
                    order = ("o", "r", "i", "p", "b") if rnd % 2 == 0 else ("b", "p", "i", "o", "r")
                    for k in (k for k in order if k in kinds):
                        if k == "p":
                            runs[k].append(health_pdsh.sweep(tmp, eps[:n], CLIENT_KEY, known, run))
                        elif k == "i":
                            runs[k].append(
                                ours(tmp, eps[:n], known, workers, True, "--gpuhost-scheduling=workers")
                            )
                        elif k == "b":
                            runs[k].append(baseline(tmp, eps[:n], workers))
                        else:
                            runs[k].append(ours(tmp, eps[:n], known, workers, reports=k == "r"))
                medians = {k: median_run(runs[k]) for k in kinds}
                for k in ("o", "r", "i"):
                    if k in medians:
                        how = {"o": "no reports", "r": "with reports", "i": "with reports, on workers"}[k]
                        print(f"hosts={n:<3} where the time went ({how}, median run):")
                        for what, secs in medians[k]["phases"]:
                            print(f"          {secs:6.3f} s  {what}")
                if "p" in kinds:
                    health_pdsh.compare(n, medians, pdsh_goals)
                if (
                    not {"o", "r", "b"} <= kinds
                ):  # a partial run (--suites): each median on its own, no ratios
                    for k in sorted(kinds - {"p", "i"}):
                        m = median_run(runs[k])
                        walls = ", ".join(f"{w:.2f}" for w in m["walls"])
                        label = {"o": "ours", "r": "ours with reports", "b": "testinfra", "p": "pdsh"}[k]
                        rt = f"; {m['facts_rt']} round trips/host for the facts" if "facts_rt" in m else ""
                        print(
                            f"hosts={n:<3} {label} {m['wall']:6.2f} s (runs {walls}){rt}; CPU s {m['cpu'].line()}"
                        )
                    continue
                o, r, b = (median_run(runs[k]) for k in ("o", "r", "b"))
                o["wall_reports"] = r["wall"]
                rows.append((n, o, b))
                print(
                    f"hosts={n:<3} ours {o['wall']:6.2f} s ({r['wall']:.2f} s with reports; {o['facts_rt']} round trips/host "
                    f"for the facts, {o['conn_rt']} with the agent start) | testinfra {b['wall']:6.2f} s "
                    f"({b['cmds']} commands/host, a channel each) | {b['wall'] / o['wall']:.1f}x",
                    flush=True,
                )
                print(
                    f"          CPU s (median runs): ours {o['cpu'].line()} | testinfra {b['cpu'].line()}",
                    flush=True,
                )
                if args.repeat > 1:
                    print(
                        "          runs: ours "
                        + ", ".join(f"{w:.2f}" for w in o["walls"])
                        + " | with reports "
                        + ", ".join(f"{w:.2f}" for w in r["walls"])
                        + " | testinfra "
                        + ", ".join(f"{w:.2f}" for w in b["walls"]),
                        flush=True,
                    )
                    # The same round's runs are neighbours in time: their ratio is less moved by
                    # other load on the machine than the ratio of the medians.
                    print(
                        "          ratio per round: "
                        + ", ".join(f"{tb / to:.1f}x" for to, tb in zip(o["walls"], b["walls"], strict=True))
                        + " | load average at each round's start: "
                        + ", ".join(f"{x:.1f}" for x in loads),
                        flush=True,
                    )
        for text, ok in pdsh_goals:
            print(f"  [{'met' if ok else 'MISSED'}] {text}")
        if not {"o", "r", "b"} <= kinds:
            return 0
        print()
        print(
            f"{'hosts':>5} {'ours s':>8} {'+reports s':>11} {'rt/host':>8} {'testinfra s':>12} {'cmds/host':>10} {'speedup':>8}"
        )
        for n, o, b in rows:
            print(
                f"{n:>5} {o['wall']:>8.2f} {o['wall_reports']:>11.2f} {o['facts_rt']:>8} {b['wall']:>12.2f} "
                f"{b['cmds']:>10} {b['wall'] / o['wall']:>7.1f}x"
            )
        print(f"(first night, {len(eps)} hosts, before any of these: {first_night['wall']:.2f} s)")
        first, last = rows[0], rows[-1]
        goals = [
            ("<= 2 round trips per host for the facts", max(o["facts_rt"] for _, o, _ in rows) <= 2),
            (
                f">= 5x faster than testinfra at {last[0]} hosts ({last[2]['wall'] / last[1]['wall']:.1f}x; "
                f"{last[2]['wall'] / last[1]['wall_reports']:.1f}x with our reports)",
                last[2]["wall"] / last[1]["wall"] >= 5,
            ),
            (
                f"{last[0]} hosts <= 3x the time of {first[0]} ({last[1]['wall'] / first[1]['wall']:.2f}x)",
                last[1]["wall"] <= 3 * first[1]["wall"],
            ),
        ]
        for text, ok in goals:
            print(f"  [{'met' if ok else 'MISSED'}] {text}")
        return 0
    finally:
        if proxy is not None:
            proxy.close()
        for h in hosts:
            try:
                h.down()
            except Exception as exc:  # keep tearing down the rest
                print(f"teardown {h.name}: {exc}", file=sys.stderr)
        if restore_inotify is not None:  # leave the machine as it was
            INOTIFY.write_text(f"{restore_inotify}\n")


if __name__ == "__main__":
    sys.exit(main())

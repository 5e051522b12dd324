"""Per-command cost: our agent (one SSH channel) vs testinfra's paramiko backend (a channel each).

Starts OpenSSH's sshd on 127.0.0.1 with its own host key (tests/helpers/sshd.py), then in one
run measures connect + first command, `host.run("true")` x N and a 50-file fact read (small
/proc and /sys files):

* ours:      make_host(Connection) -> host.run / host.file(...).content, and the same 50 files in
             one `read_files` round trip; through the OpenSSH client (a ControlMaster, the default
             where `ssh` exists), logged in on a socket of ours (`openssh`), and again where ssh
             must connect itself (`carrier`: an ssh_config with `CheckHostIP yes`, as `ProxyJump`
             or `ProxyCommand` would; the only login before 83cf6d3);
* paramiko:  the same, with the agent's channel on a paramiko transport (the fallback; before the
             OpenSSH client carried every channel, this was the only way);
* testinfra: testinfra.get_host("paramiko://...") with the same key; its SSHClient is given the
             known_hosts file and RejectPolicy so both sides verify the host key.

`--repeat K` runs everything K times on one sshd and prints the medians (for a shared machine);
the order of the three rotates from run to run, so none always goes first after a quiet spell.
Connect is also given in CPU-seconds (a figure the machine's load moves much less than wall
time): this process's (every thread's, paramiko's included) plus its `ssh` clients' and the
OpenSSH master's, the sshd side left out (the same server work for all three).

    python benchmarks/bench_exec.py            # N=200
    python benchmarks/bench_exec.py --smoke    # a few commands, seconds
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paramiko  # noqa: E402
import testinfra  # noqa: E402

from pytest_gpuhost.exec.backend import make_host  # noqa: E402
from pytest_gpuhost.exec.connect import connect  # noqa: E402
from pytest_gpuhost.exec.connection import ConnectionOptions  # noqa: E402
from pytest_gpuhost.exec.ssh.paramiko import SSHLauncher, SSHTransport  # noqa: E402
from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url  # noqa: E402
from tests.helpers.sshd import start_sshd  # noqa: E402


def fact_paths(n: int) -> list[str]:
    """Pick `n` small readable files from /proc and /sys (the kind of facts a suite reads)."""
    fixed = [
        "/proc/version",
        "/proc/loadavg",
        "/proc/uptime",
        "/proc/cmdline",
        "/proc/meminfo",
        "/proc/cpuinfo",
    ]
    candidates = fixed + sorted(glob.glob("/proc/sys/kernel/*")) + sorted(glob.glob("/sys/class/net/*/mtu"))
    out = []
    for p in candidates:
        try:
            with open(p, "rb") as f:
                f.read(65536)
            out.append(p)
        except OSError:
            continue
        if len(out) == n:
            break
    if len(out) < n:
        raise SystemExit(f"only {len(out)} readable fact files found")
    return out


def cpu_seconds(mark: str | None = None) -> float:
    """CPU-seconds of this process and its reaped children, plus its live `ssh` processes.

    Live: `ssh` children of this process, and any `ssh` whose command line holds `mark` (the
    master's socket directory: the master is a daemon, nobody's child here).
    """
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if comm == "ssh" and (int(rest[1]) == me or (mark is not None and mark.encode() in cmd)):
            total += _live_cpu(pid, (int(rest[11]) + int(rest[12])) / tick)
    return total


def _live_cpu(pid: str, ticks_s: float) -> float:
    """A live process's CPU-seconds: /proc/PID/schedstat's nanoseconds on CPU (its first field;
    Documentation/scheduler/sched-stats.rst), else /proc/PID/stat's utime+stime, whole ticks of
    10 ms (too coarse for an `ssh` that ran for 4 ms)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return ticks_s


def timed(fn, n: int) -> float:
    """Seconds per call of fn over n calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def measure_ours(sshd, paths: list[str], n: int, client: str, carrier_config: str) -> dict[str, float]:
    """Connect (OpenSSH master, or a paramiko transport) and time commands and file reads.

    `openssh` logs in directly (the master on a socket of ours); `carrier` through a config that
    makes ssh connect itself (`CheckHostIP yes`, as `ProxyJump` would): the login before 83cf6d3.
    """
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    if client in ("openssh", "carrier"):
        config = carrier_config if client == "carrier" else None
        conn = open_connection(
            parse_host_url(sshd.url),
            TargetOptions(
                identity=sshd.identity, known_hosts=sshd.known_hosts, connect_timeout=10, ssh_config=config
            ),
        )
        assert conn.launcher.client == "openssh"
        refusal = conn.launcher.transport.direct_refusal
        assert (refusal is None) == (client == "openssh"), refusal
    else:
        transport = SSHTransport(
            sshd.host,
            sshd.port,
            sshd.user,
            identity=sshd.identity,
            known_hosts=sshd.known_hosts,
            connect_timeout=10,
        )
        conn = connect(sshd.host, SSHLauncher(transport), ConnectionOptions())
    host = make_host(conn)
    host.run("true")
    connect_s = time.perf_counter() - t0
    control = getattr(conn.launcher.transport, "control_path", None)
    connect_cpu = cpu_seconds(os.path.dirname(control) if control else None) - c0
    run_s = timed(lambda: host.run("true"), n)
    file_each = timed(lambda: [host.file(p).content for p in paths], 1) / len(paths)
    rt0 = conn.round_trips
    t0 = time.perf_counter()
    got = conn.read_files(paths)
    batch = time.perf_counter() - t0
    assert conn.round_trips == rt0 + 1 and all(isinstance(v, str) for v in got.values())
    t0 = time.perf_counter()
    conn.close()
    close_s = time.perf_counter() - t0
    return {
        "connect": connect_s,
        "connect_cpu": connect_cpu,
        "run": run_s,
        "file": file_each,
        "batch": batch,
        "close": close_s,
    }


def measure_testinfra(sshd, paths: list[str], n: int) -> dict[str, float]:
    """testinfra's paramiko backend, host key verified the same way."""
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    ti = testinfra.get_host(
        f"paramiko://{sshd.user}@{sshd.host}:{sshd.port}", ssh_identity_file=sshd.identity
    )
    client = paramiko.SSHClient()
    client.load_host_keys(sshd.known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        sshd.host,
        port=sshd.port,
        username=sshd.user,
        key_filename=sshd.identity,
        timeout=10,
        allow_agent=False,
        look_for_keys=False,
    )
    ti.backend.__dict__["client"] = client  # what its cached `client` property would build, strictly
    ti.run("true")
    connect_s = time.perf_counter() - t0
    connect_cpu = cpu_seconds() - c0
    run_s = timed(lambda: ti.run("true"), n)
    t0 = time.perf_counter()
    for p in paths:
        ti.file(p).content  # noqa: B018 - the read is what is timed
    files = time.perf_counter() - t0
    client.close()
    return {
        "connect": connect_s,
        "connect_cpu": connect_cpu,
        "run": run_s,
        "file": files / len(paths),
        "batch": files,
        "close": 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200, help="commands per measurement (default 200)")
    ap.add_argument("--files", type=int, default=50, help="files in the fact read (default 50)")
    ap.add_argument("--repeat", type=int, default=1, help="runs, medians printed (default 1)")
    ap.add_argument("--smoke", action="store_true", help="tiny N, for CI")
    args = ap.parse_args()
    n, nfiles = (5, 5) if args.smoke else (args.n, args.files)
    paths = fact_paths(nfiles)
    kinds = ("openssh", "carrier", "paramiko", "testinfra")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}

    with tempfile.TemporaryDirectory(prefix="bench-exec-") as tmp:
        sshd = start_sshd(Path(tmp) / "sshd")
        carrier_config = Path(tmp) / "carrier_config"  # the system's config, and ssh connects itself
        carrier_config.write_text("Host *\n    CheckHostIP yes\nInclude /etc/ssh/ssh_config\n")
        try:
            for i in range(max(1, args.repeat)):
                for kind in kinds[i % 4 :] + kinds[: i % 4]:
                    if kind == "testinfra":
                        runs[kind].append(measure_testinfra(sshd, paths, n))
                    else:
                        runs[kind].append(measure_ours(sshd, paths, n, kind, str(carrier_config)))
        finally:
            sshd.stop()

    med = {k: {m: statistics.median(r[m] for r in runs[k]) for m in runs[k][0]} for k in kinds}
    ms = 1000.0
    rows = [
        ("connect + first command (ms)", "connect"),
        ("connect + first command, CPU (ms)", "connect_cpu"),
        ('host.run("true") per command (ms)', "run"),
        ("file read, one command each, per file (ms)", "file"),
        (f"{len(paths)}-file fact read, total (ms)", "batch"),
        ("close (ms)", "close"),
    ]
    print(
        f"bench_exec: sshd on 127.0.0.1, N={n} commands, {len(paths)}-file fact read, "
        f"median of {max(1, args.repeat)} run(s)"
    )
    print(f"{'measurement':44} {'openssh':>9} {'carrier':>9} {'paramiko':>9} {'testinfra':>10}")
    for label, key in rows:
        print(
            f"{label:44}" + "".join(f" {med[k][key] * ms:{10 if k == 'testinfra' else 9}.2f}" for k in kinds)
        )
    ti_run, ours_run = med["testinfra"]["run"], med["openssh"]["run"]
    goal = ti_run / ours_run >= 15
    print(
        f"goal: >= 15x less time per command than testinfra: {'met' if goal else 'NOT met'} ({ti_run / ours_run:.1f}x)"
    )
    no_slower = (
        med["openssh"]["connect"] <= med["paramiko"]["connect"] * 1.1
        and ours_run <= med["paramiko"]["run"] * 1.1
    )
    ratio = med["openssh"]["connect"] / med["paramiko"]["connect"]
    print(
        f"goal: OpenSSH client no slower than paramiko (10% noise): {'met' if no_slower else 'NOT met'} "
        f"(connect {ratio:.2f}x, per command {ours_run / med['paramiko']['run']:.2f}x; where ssh connects "
        f"itself (carrier): connect {med['carrier']['connect'] / med['paramiko']['connect']:.2f}x)"
    )
    return 0 if ((goal and no_slower) or args.smoke) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Per-command cost: our agent (one SSH channel) vs testinfra's paramiko backend (a channel each).

Starts OpenSSH's sshd on 127.0.0.1 with its own host key (tests/helpers/sshd.py), then in one
run measures `host.run("true")` x N and a 50-file fact read (small /proc and /sys files):

* ours:      make_host(Connection) -> host.run / host.file(...).content, and the same 50 files in
             one `read_files` round trip;
* testinfra: testinfra.get_host("paramiko://...") with the same key; its SSHClient is given the
             known_hosts file and RejectPolicy so both sides verify the host key.

    python benchmarks/bench_exec.py            # N=200
    python benchmarks/bench_exec.py --smoke    # a few commands, seconds
"""

from __future__ import annotations

import argparse
import glob
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import paramiko  # noqa: E402
import testinfra  # noqa: E402

from pytest_gpuhost.exec.backend import make_host  # noqa: E402
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


def timed(fn, n: int) -> float:
    """Seconds per call of fn over n calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200, help="commands per measurement (default 200)")
    ap.add_argument("--files", type=int, default=50, help="files in the fact read (default 50)")
    ap.add_argument("--smoke", action="store_true", help="tiny N, for CI")
    args = ap.parse_args()
    n, nfiles = (5, 5) if args.smoke else (args.n, args.files)
    paths = fact_paths(nfiles)

    with tempfile.TemporaryDirectory(prefix="bench-exec-") as tmp:
        sshd = start_sshd(Path(tmp) / "sshd")
        try:
            # ours
            t0 = time.perf_counter()
            conn = open_connection(
                parse_host_url(sshd.url),
                TargetOptions(identity=sshd.identity, known_hosts=sshd.known_hosts, connect_timeout=10),
            )
            ours_connect = time.perf_counter() - t0
            host = make_host(conn)
            host.run("true")  # warm
            ours_run = timed(lambda: host.run("true"), n)
            ours_file_each = timed(lambda: [host.file(p).content for p in paths], 1) / len(paths)
            rt0 = conn.round_trips
            t0 = time.perf_counter()
            got = conn.read_files(paths)
            ours_batch = time.perf_counter() - t0
            assert conn.round_trips == rt0 + 1 and all(isinstance(v, str) for v in got.values())

            # testinfra's paramiko backend, host key verified the same way
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
            ti_connect = time.perf_counter() - t0
            ti_run = timed(lambda: ti.run("true"), n)
            t0 = time.perf_counter()
            theirs = {p: ti.file(p).content for p in paths}
            ti_files = time.perf_counter() - t0
            for p in ("/proc/version", "/proc/cmdline"):  # both sides read the same bytes
                if p in theirs:
                    assert theirs[p] == str(got[p]).encode(), p
            client.close()
            conn.close()
        finally:
            sshd.stop()

    ms = 1000.0
    rows = [
        ("connect + first command (ms)", ours_connect * ms, ti_connect * ms),
        ('host.run("true") per command (ms)', ours_run * ms, ti_run * ms),
        ("file read, one command each, per file (ms)", ours_file_each * ms, ti_files / len(paths) * ms),
        (f"{len(paths)}-file fact read, total (ms)", ours_batch * ms, ti_files * ms),
    ]
    print(f"bench_exec: sshd on 127.0.0.1, N={n} commands, {len(paths)}-file fact read")
    print(f"{'measurement':44} {'ours':>10} {'testinfra':>10} {'ratio':>8}")
    for label, ours, theirs_ms in rows:
        print(f"{label:44} {ours:10.2f} {theirs_ms:10.2f} {theirs_ms / ours:7.1f}x")
    goal = ti_run / ours_run >= 15
    print(f"goal: >= 15x less time per command: {'met' if goal else 'NOT met'} ({ti_run / ours_run:.1f}x)")
    return 0 if (goal or args.smoke) else 1


if __name__ == "__main__":
    sys.exit(main())

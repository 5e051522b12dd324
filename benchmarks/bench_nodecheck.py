"""gpuhost-nodecheck's wall time on a lab host, with 25 ms of delay on its link removed and added.

    sudo python benchmarks/bench_nodecheck.py            # 10 rounds each way
    sudo python benchmarks/bench_nodecheck.py --smoke    # 1 round each way (CI)

The program runs inside the host (reached over SSH, as Slurm's slurmd would start it there): it
checks the node it runs on through local agents, so the delay on the host's link must not change
its time, and it must stay within its budget (default 10 s). Per round: the program's own figure
(from its process start to its verdict line), and bash's real/user/sys of the whole process.
The delay is netem on the host's link (LabHost.set_netem); where this kernel has no netem, a
second host is booted with the lab's user-space delay on its SSH port instead.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.host import netns  # noqa: E402
from gpulab.host.lab import Lab, LabHost  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PY = REPO / ".venv" / "bin" / "python"
BUDGET = 10.0
_JUDGED = re.compile(r"checks judged in ([0-9.]+) s")


def one_round(h: LabHost) -> tuple[float, float, float, float, int]:
    """Run the program once inside `h`; return (own, real, user, sys) seconds and its exit status."""
    script = f'cd /tmp && TIMEFORMAT="%R %U %S"; {{ time {PY} -m pytest_gpuhost.nodecheck >/tmp/nc.out; }} 2>&1; echo "rc=$?"; cat /tmp/nc.out'
    r = h.ssh(["bash", "-c", script], timeout=60)
    lines = r.stdout.splitlines()
    real, user, sys_ = (float(x) for x in lines[0].split())
    rc = int(lines[1].removeprefix("rc="))
    m = _JUDGED.search(r.stdout)
    if m is None:
        raise SystemExit(f"no verdict line from nodecheck on {h.name}: {r.stdout[-500:]} {r.stderr[-500:]}")
    return float(m.group(1)), real, user, sys_, rc


def measure(h: LabHost, rounds: int) -> dict[str, float]:
    one_round(h)  # warm: the first start reads the repository from disk
    rows = [one_round(h) for _ in range(rounds)]
    return {
        "own": statistics.median(r[0] for r in rows),
        "own_max": max(r[0] for r in rows),
        "real": statistics.median(r[1] for r in rows),
        "cpu": statistics.median(r[2] + r[3] for r in rows),
        "rc": max(r[4] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="one round each way")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    rounds = 1 if args.smoke else args.rounds
    lab = Lab()
    lab.check()
    name = f"bnc-{os.getpid()}"
    hosts = [lab.up("health-ok", name=name)]
    try:
        results = {"0 ms": measure(hosts[0], rounds)}
        if netns.netem_available():
            hosts[0].set_netem(delay_ms=25)
            delayed = hosts[0]
            how = "netem 25 ms each way"
        else:
            hosts.append(lab.up("health-ok", name=f"{name}d", delay_ms=25))
            delayed = hosts[1]
            how = "user-space 25 ms each way on the SSH port (no netem here)"
        t0 = time.monotonic()
        delayed.ssh("true")
        rtt = time.monotonic() - t0
        results["25 ms"] = measure(delayed, rounds)
    finally:
        for h in hosts:
            h.down()
    print(f"gpuhost-nodecheck on a lab host (health-ok, 4 GPUs), {rounds} round(s) each, budget {BUDGET:g} s")
    print(f"delay: {how}; one ssh 'true' with it: {rtt:.2f} s")
    print(f"{'link':<8} {'own median':>11} {'own max':>8} {'real med':>9} {'cpu med':>8} {'exit':>5}")
    for link, r in results.items():
        print(
            f"{link:<8} {r['own']:>10.2f}s {r['own_max']:>7.2f}s {r['real']:>8.2f}s {r['cpu']:>7.2f}s {int(r['rc']):>5}"
        )
    within = all(r["own_max"] < BUDGET for r in results.values())
    diff = results["25 ms"]["own"] - results["0 ms"]["own"]
    print(f"within budget: {'yes' if within else 'NO'}; delay changed the median by {diff:+.2f} s")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())

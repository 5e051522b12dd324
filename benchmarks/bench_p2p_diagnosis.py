"""What the P2P diagnosis adds to a suites/p2p repair run (the seed's host with every cause at once).

Boots `gpulab.profiles.p2p_variants.rtx6000_all_causes()` (the seed's Proxmox host with the IOMMU
translated, BAR1 256 MiB, nvidia_uvm with HMM and port runtime PM on) and, per round:

* the diagnosis's reads alone, in a round trip of their own over SSH: the agent's `p2p_causes`
  fact and the three nvidia-smi reads (`topo -p2p r`, `topo -p2p w`, `-q -d MEMORY`). In
  the suite they ride in step 1's existing batch, so this is an upper bound of their cost; and
  the read of each GPU's link right after the "before" copies (a round trip of its own, in the
  suite too);
* the judging (`modules/p2p_causes.diagnose`, pure) on what was read, 100 times, the median;
* a whole repair run (`pytest suites/p2p` from a pristine host), for scale.

Printed: each figure, and whether the diagnosis (reads + judging) stays within 1 s of a repair run.

    python benchmarks/bench_p2p_diagnosis.py            # 5 rounds
    python benchmarks/bench_p2p_diagnosis.py --smoke    # CI: one round, no repair run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpulab.host.lab import CLIENT_KEY, Lab  # noqa: E402
from gpulab.profiles import p2p_variants  # noqa: E402
from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url  # noqa: E402
from pytest_gpuhost.modules import p2p_causes, p2p_reports  # noqa: E402
from tests.p2p.test_p2p_suite import NVIDIA, run_suite  # noqa: E402

BUDGET_S = 1.0
LINKS = [
    f"/sys/bus/pci/devices/{b}/{n}"
    for b in NVIDIA
    for n in ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="one round, without the repair run")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rounds = 1 if args.smoke else args.rounds
    lab = Lab()
    lab.check()
    h = lab.up(p2p_variants.rtx6000_all_causes(), name=f"bench-p2pdiag-{os.getpid()}")
    reads: list[float] = []
    judge: list[float] = []
    repair: list[float] = []
    try:
        opts = TargetOptions(
            identity=str(CLIENT_KEY),
            known_hosts=str(h.known_hosts),
            host_key_policy="strict",
            command_timeout=120,
            connect_timeout=10,
        )
        conn = open_connection(parse_host_url(f"ssh://root@{h.address}"), opts)
        try:
            for _ in range(rounds):
                t0 = time.perf_counter()
                replies = conn.batch(
                    [{"op": "facts", "names": ["p2p_causes"], "params": {}, "timeout": 60}]
                    + [dict(r) for r in p2p_causes.READS]
                )
                conn.call("read_files", paths=LINKS, reply_timeout=10)  # the links under load, its own trip
                reads.append(time.perf_counter() - t0)
                fact = replies[0]["p2p_causes"]
                outs = p2p_causes.outputs(replies[1:])
                times = []
                for _ in range(100):
                    t1 = time.perf_counter()
                    d = p2p_causes.diagnose(
                        fact,
                        list(NVIDIA),
                        group_types=dict.fromkeys(NVIDIA, "DMA-FQ"),
                        smi_bar1=p2p_reports.parse_smi_bar1(outs["smi_q"]),
                    )
                    d.table()
                    times.append(time.perf_counter() - t1)
                judge.append(statistics.median(times))
        finally:
            conn.close()
        if not args.smoke:
            with tempfile.TemporaryDirectory(prefix="bench-p2pdiag-") as tmp:
                for _ in range(min(rounds, 3)):
                    h.reset()
                    run = run_suite(h, Path(tmp), timeout=600)
                    if run.rc != 0:
                        raise RuntimeError(f"the repair run failed: {run.output[-2000:]}")
                    repair.append(run.seconds)
    finally:
        h.down()
    found = ", ".join(sorted({c.cause for c in d.found}))
    print(f"suites/p2p diagnosis on rtx6000-all-causes, {rounds} round(s), {os.cpu_count()} cores")
    print(f"found: {found}")
    r, j = statistics.median(reads), statistics.median(judge)
    print(f"reads in a round trip of their own (median): {r * 1000:.0f} ms")
    print(f"judging (diagnose + table, median of 100 x {rounds}): {j * 1000:.2f} ms")
    if repair:
        print(f"a whole repair run (median of {len(repair)}): {statistics.median(repair):.1f} s")
    total = r + j
    print(
        f"the diagnosis adds at most {total:.2f} s to a repair run: within {BUDGET_S:g} s: {'yes' if total <= BUDGET_S else 'no'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

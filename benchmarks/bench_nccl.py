"""The NCCL collective check's cost in the seed's repair run (suites/p2p on proxmox-rtx6000).

Boots the seed's Proxmox host as the lab repairs it (fixtures/profiles/proxmox-rtx6000.yaml: 4
GPUs on nvidia for LXC 101's SGLang, 4 on vfio-pci for a VM, IOMMU groups translated; the
SEV-SNP variant, proxmox-epyc-snp, is refused at the plan step, so it has no repair run to
measure) and, per round, from a pristine host:

* the repair run, `pytest suites/p2p` as an operator types it: every step, the collective
  (`p2p collective`: both arms of `all_reduce_perf`, P2P and `NCCL_P2P_DISABLE=1`) included;
* the same repair run on a host without nccl-tests (`/usr/bin/all_reduce_perf` moved aside in
  the host's and the container's own overlay roots), where the step skips: what the run costs
  without the check;
* a check-only run (what a CI gate runs) on the broken host, for its step's share.

Printed: the step's own duration, the whole run's, its share, and the two runs side by side (the
difference is the check's cost, and a check-only run, which is what CI gates use, is printed too).
The lab's collective takes about as long as the real one would not (a real all_reduce_perf from
8 MiB to 128 MiB on 4 GPUs is seconds of GPU time): these figures are the suite's own overhead
around it, which is what the lab can measure.

    python benchmarks/bench_nccl.py            # 3 rounds
    python benchmarks/bench_nccl.py --smoke    # CI: one round, the run with the check only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpulab.host.lab import Lab, LabHost  # noqa: E402
from tests.p2p.test_p2p_suite import run_suite  # noqa: E402

STEP = "test_p2p_collective"
TOOL = "/usr/bin/all_reduce_perf"


def step_seconds(run: Any) -> float:
    t = run.tests.get(STEP) or {}
    return float(t.get("duration") or 0.0)


def one(h: LabHost, tmp: Path, *args: str, with_tool: bool = True) -> Any:
    """A run from a pristine host; with_tool=False hides nccl-tests first."""
    h.reset()
    hide = f"mv {TOOL} {TOOL}.aside && pct exec 101 -- mv {TOOL} {TOOL}.aside"
    if not with_tool:  # the step looks on the host and in the service's container (LXC 101)
        r = h.ssh(hide)
        if r.returncode != 0:
            raise RuntimeError(f"cannot move {TOOL} aside: {r.stderr.strip()}")
    try:
        run = run_suite(h, tmp, *args, timeout=600)
    finally:
        if not with_tool:
            h.ssh(f"mv {TOOL}.aside {TOOL}; pct exec 101 -- mv {TOOL}.aside {TOOL}")
    want = ("passed", "fixed", "would fix") if with_tool else ("skipped",)
    got = run.outcomes.get(STEP)
    if got not in want:
        raise RuntimeError(f"the collective step ended {got!r}, not {want}: {run.output[-2000:]}")
    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="one round, the repair run with the check only")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rounds = 1 if args.smoke else args.rounds
    lab = Lab()
    lab.check()
    h = lab.up("proxmox-rtx6000", name=f"bench-nccl-{os.getpid()}")
    rows: dict[str, list[tuple[float, float]]] = {"repair": [], "repair, no nccl-tests": [], "check-only": []}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-nccl-") as tmp:
            for _ in range(rounds):
                run = one(h, Path(tmp))
                rows["repair"].append((run.seconds, step_seconds(run)))
                if args.smoke:
                    continue
                run = one(h, Path(tmp), with_tool=False)
                rows["repair, no nccl-tests"].append((run.seconds, step_seconds(run)))
                run = one(h, Path(tmp), "--check-only")
                rows["check-only"].append((run.seconds, step_seconds(run)))
    finally:
        h.down()
    print(
        f"suites/p2p on the seed's Proxmox host (proxmox-rtx6000), {rounds} round(s), {os.cpu_count()} cores"
    )
    print(f"{'run':<24} {'run med':>8} {'step med':>9} {'share':>6}")
    for name, rs in rows.items():
        if not rs:
            continue
        run_s = statistics.median(r[0] for r in rs)
        step_s = statistics.median(r[1] for r in rs)
        print(f"{name:<24} {run_s:>7.1f}s {step_s:>8.2f}s {100 * step_s / run_s:>5.0f}%")
    if rows["repair, no nccl-tests"]:
        with_check = statistics.median(r[0] for r in rows["repair"])
        without = statistics.median(r[0] for r in rows["repair, no nccl-tests"])
        print(
            f"the collective check costs the repair run {with_check - without:+.1f} s "
            f"({with_check / without:.2f}x the run without it)"
        )
    print("collective step measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())

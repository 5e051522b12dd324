"""suites/accept's cost on the lab's rented B200 node: wall time per run and per step, and what it measured.

    sudo python benchmarks/bench_accept.py            # 3 rounds of each mode
    sudo python benchmarks/bench_accept.py --smoke    # 1 round (CI)

Each round runs the suite as a renter does (`python -m pytest suites/accept ...` in a
subprocess, over SSH) with the example order (fixtures/orders/b200-order.yaml), once in full (the
64 MiB scratch file written and read) and once with --check-only (nothing written). Per mode:
the run's wall time (median, max), each step's call time (median, from pytest's --durations),
and the figures the run found (least P2P pair, write throughput), read from its evidence JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.host.lab import Lab, LabHost  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ORDER = REPO / "fixtures" / "orders" / "b200-order.yaml"
_DURATION = re.compile(r"^([0-9.]+)s call\s+\S+::test_(\w+)\[", re.M)


def one_run(h: LabHost, tmp: Path, *extra: str) -> tuple[float, dict[str, float], dict[str, str], str]:
    """Run the suite once; return (wall seconds, step -> call seconds, item -> found, verdict)."""
    evidence = tmp / "accept.json"
    argv = [
        sys.executable, "-m", "pytest", str(REPO / "suites" / "accept"), *h.pytest_args(), f"--order={ORDER}",
        f"--report-dir={tmp / 'reports'}", f"--accept-evidence={evidence}", "--accept-scratch-mib=64",
        "-p", "no:cacheprovider", "-q", "--durations=0", "--durations-min=0", *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=600, check=False)
    wall = time.monotonic() - t0
    data = json.loads(evidence.read_text())
    if r.returncode != 0:
        raise SystemExit(f"bench_accept: the run said {data['verdict']}:\n{r.stdout[-3000:]}")
    steps = {m.group(2): float(m.group(1)) for m in _DURATION.finditer(r.stdout)}
    return wall, steps, {i["item"]: i["found"] for i in data["items"]}, data["verdict"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="one round only")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rounds = 1 if args.smoke else args.rounds
    lab = Lab()
    lab.check()
    h = lab.up("b200-nvl8", name=f"bench-acc-{os.getpid()}", data_scale="small")
    try:
        for mode, extra in (("full", ()), ("check-only", ("--check-only",))):
            walls: list[float] = []
            steps: dict[str, list[float]] = {}
            found: dict[str, str] = {}
            for _ in range(rounds):
                with tempfile.TemporaryDirectory(prefix="bench-accept-") as tmp:
                    wall, per_step, found, verdict = one_run(h, Path(tmp), *extra)
                walls.append(wall)
                for name, s in per_step.items():
                    steps.setdefault(name, []).append(s)
            print(f"{mode}: {verdict}; wall median {statistics.median(walls):.2f} s, max {max(walls):.2f} s")
            print("  steps: " + ", ".join(f"{n} {statistics.median(v):.2f} s" for n, v in steps.items()))
            print(
                "  found: "
                + "; ".join(f"{k}: {found[k]}" for k in ("P2P per pair", "write throughput") if k in found)
            )
        print("accept measured")
    finally:
        h.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())

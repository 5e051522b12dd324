"""Measure how long lab hosts take to come up, reboot and reset (the README quotes the numbers).

    sudo python benchmarks/bench_lab_boot.py            # 5 rounds of each
    sudo python benchmarks/bench_lab_boot.py --smoke    # 1 round (CI)

"up" is from the call to SSH answering on every machine (host and containers) and the
hand-started services launched; "boot" is the part after the lab layer is built (systemd to
running + sshd), which is also what a reboot costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.host.lab import Lab  # noqa: E402
from gpulab.profiles.load import load_profile  # noqa: E402


def main() -> int:
    """Boot each case N times; print median and max seconds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="one round only")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rounds = 1 if args.smoke else args.rounds
    lab = Lab()
    lab.check()
    host_only = load_profile("proxmox-rtx6000", {"containers": [], "services": []})
    cases = [
        ("host only", host_only),
        ("host + container", "proxmox-rtx6000"),
        ("b200 (7 servers, /data)", "b200-nvl8"),
    ]
    name = f"bench-{os.getpid()}"
    print(f"{'case':<26} {'up median':>10} {'up max':>8} {'boot med':>9} {'reboot':>8} {'reset':>8}")
    for label, prof in cases:
        ups, boots, reboots, resets = [], [], [], []
        for _ in range(rounds):
            t0 = time.monotonic()
            h = lab.up(prof, name=name)
            try:
                ups.append(time.monotonic() - t0)
                boots.append(h.meta["boot_timings"]["total"])
                reboots.append(h.reboot())
                resets.append(h.reset())
            finally:
                h.down()
        print(
            f"{label:<26} {statistics.median(ups):>9.2f}s {max(ups):>7.2f}s {statistics.median(boots):>8.2f}s"
            f" {statistics.median(reboots):>7.2f}s {statistics.median(resets):>7.2f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time from detection to a returned node: `--fix=reset` and `--fix=reset,reboot` on a lab host.

Boots one lab host (profile health-ok: 4 GPUs, SGLang tp=4 and nvidia-persistenced holding
them), then per round:

* reset path:  GPU 0000:14:00.0 says it needs a reset (fault `reset_required`); one run of
  `pytest suites/health --fix=reset`: the reset step stops both units, resets the GPU, starts
  them again and confirms from the GPU's signals;
* reboot path: the same GPU with `reset_sticks` too (the reset returns 0, the GPU stays in
  error until the node reboots); one run with `--fix=reset,reboot`: the reset, the re-check
  (which waits suites/health/reset.py VERIFY_TIMEOUT for the signals to clear), `systemctl
  reboot` inside the host, SSH polled until a new boot id answers, the units checked, every fact
  read again;
* Xid 79 path: an Xid 79 ("GPU has fallen off the bus": NVIDIA's catalogue resolves it with a
  reboot) on GPU 0000:13:00 in the kernel log; one run with `--fix=reset,reboot`: no GPU reset,
  the service stopped (bounded ladder), `systemctl reboot`, the new boot id, the unit checked,
  every fact read again, the compute check.

Every recovery ends with the compute check (`all_reduce_perf -g 1 -c 1` on each GPU recovered).

"detection to returned" is the reset step's own duration (its check found the GPU owing a
reset; it ends once the re-check says no GPU owes one, units active); "run" is the whole pytest
run (every health check of the host, then the step). The reboot path's share spent waiting for
the new boot id is printed from the step's evidence.

    sudo python benchmarks/bench_reset.py            # 3 rounds of each path
    sudo python benchmarks/bench_reset.py --smoke    # CI: the reset path once, one in-host reboot
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpulab.host.lab import CLIENT_KEY, Lab, LabHost  # noqa: E402
from suites.health.reset import VERIFY_TIMEOUT  # noqa: E402

BUS = "0000:14:00.0"
XID79 = "NVRM: Xid (PCI:0000:13:00): 79, pid=2231, name=python3, GPU has fallen off the bus."
_REBOOT_NOTE = re.compile(r"SSH answered with boot id \S+ after ([0-9.]+) s")


def inject(h: LabHost, faults: dict[str, Any]) -> None:
    """Write the host's runtime faults (what gpulab_tools.load_faults reads)."""
    r = h.ssh(["sh", "-c", "cat > /var/lib/gpulab/faults.json"], input=json.dumps(faults))
    if r.returncode != 0:
        raise RuntimeError(f"cannot write faults: {r.stderr.strip()}")


def log_xid79(h: LabHost) -> None:
    """Append an Xid 79 to the host's kernel log, stamped after its boot lines."""
    after_boot = max(k.t for k in h.profile.kernel_log) + 1.0
    line = json.dumps({"t": after_boot, "msg": XID79}) + "\n"
    r = h.ssh(["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=line)
    if r.returncode != 0:
        raise RuntimeError(f"cannot write the kernel log: {r.stderr.strip()}")


def boot_id(h: LabHost) -> str:
    return h.ssh(["cat", "/proc/sys/kernel/random/boot_id"]).stdout.strip()


def run(h: LabHost, tmp: Path, name: str, fix: str) -> dict[str, float]:
    """Run suites/health with `--fix=FIX`; return the step's and the run's seconds."""
    known = tmp / "known_hosts"
    known.write_text(Path(h.known_hosts).read_text())
    inv = tmp / "fleet.yaml"
    inv.write_text(
        "all:\n  vars: {ansible_user: root, service: sglang-qwen, service_port: 30000}\n"
        f"  hosts:\n    {h.name}: {{ansible_host: {h.address}}}\n"
    )
    argv = [
        sys.executable, "-m", "pytest", "suites/health", "-p", "no:cacheprovider", "-q",
        f"--inventory={inv}", f"--ssh-identity={CLIENT_KEY}", f"--known-hosts={known}",
        "--connect-timeout=5", f"--report-dir={tmp}", f"--report-name={name}", f"--fleet-json={tmp}/{name}.json",
        f"--fix={fix}", "-o", "addopts=", "-o", "health_reboot_timeout=120",
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    wall = time.monotonic() - t0
    cell = json.loads((tmp / f"{name}.json").read_text())["hosts"][h.name]["checks"]["reset"]
    if cell["outcome"] != "fixed":
        raise RuntimeError(f"{name}: the reset step ended {cell['outcome']}: {proc.stdout[-2000:]}")
    html = (tmp / f"{name}.html").read_text() if (tmp / f"{name}.html").exists() else ""
    m = _REBOOT_NOTE.search(html)
    return {"step": float(cell["duration"]), "run": wall, "reboot": float(m.group(1)) if m else 0.0}


def in_host_reboot(h: LabHost) -> float:
    """Reboot the host from inside (`systemctl reboot` over SSH); return seconds to a new boot id."""
    old = boot_id(h)
    t0 = time.monotonic()
    h.ssh(["systemctl", "reboot"])
    while time.monotonic() - t0 < 60:
        try:
            now = boot_id(h)
        except subprocess.TimeoutExpired:
            now = ""
        if now and now != old:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError(f"{h.name} did not come back within 60 s of systemctl reboot")


def main() -> int:
    """Run each path N times on one lab host; print median and max seconds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="the reset path once and one in-host reboot")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rounds = 1 if args.smoke else args.rounds
    lab = Lab()
    lab.check()
    h = lab.up("health-ok", name=f"bench-reset-{os.getpid()}")
    results: dict[str, list[dict[str, float]]] = {
        "reset": [],
        "reset,reboot": [],
        "reset,reboot (Xid 79)": [],
    }
    try:
        with tempfile.TemporaryDirectory(prefix="bench-reset-") as tmp:
            for k in range(rounds):
                inject(h, {"gpus": {BUS: {"reset_required": True}}})
                results["reset"].append(run(h, Path(tmp), f"reset{k}", "reset"))
                if args.smoke:
                    continue
                inject(h, {"gpus": {BUS: {"reset_required": True, "reset_sticks": True}}})
                results["reset,reboot"].append(run(h, Path(tmp), f"reboot{k}", "reset,reboot"))
                inject(h, {})
                log_xid79(h)
                results["reset,reboot (Xid 79)"].append(run(h, Path(tmp), f"xid79-{k}", "reset,reboot"))
            plain = in_host_reboot(h)
    finally:
        h.down()
    print(
        f"detection to a returned node on a lab host (health-ok, 4 GPUs), {rounds} round(s), {os.cpu_count()} cores"
    )
    print(f"{'path':<30} {'step med':>9} {'step max':>9} {'run med':>8} {'new boot id':>12}")
    for path, rs in results.items():
        if not rs:
            continue
        steps = [r["step"] for r in rs]
        print(
            f"{'--fix=' + path:<30} {statistics.median(steps):>8.1f}s {max(steps):>8.1f}s"
            f" {statistics.median(r['run'] for r in rs):>7.1f}s"
            + (f" {statistics.median(r['reboot'] for r in rs):>11.1f}s" if path != "reset" else f" {'-':>12}")
        )
    print(f"the reboot path waits {VERIFY_TIMEOUT:g} s for the reset's signals to clear before it reboots")
    print(f"in-host reboot alone (systemctl reboot to a new boot id over SSH): {plain:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

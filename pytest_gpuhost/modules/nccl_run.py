"""Running the NCCL collective check on a target: both arms of all_reduce_perf, each bounded there.

Used by suites/p2p (step 7, the in-scope GPUs) and suites/health (`--health-nccl`, every GPU).
The parsing and the verdict are pytest_gpuhost/modules/nccl.py; this module only runs. Each arm
runs as ``timeout -k 5 BOUND all_reduce_perf ...`` on the target, so a hung collective is ended
there (SIGTERM at the bound, SIGKILL 5 s later) even when the link to it is lost; the arm carries a
marker in its environment (``GPUHOST_NCCL_RUN``), and afterwards every ``all_reduce_perf`` whose
environment holds the marker is listed and killed: nothing of ours stays on the GPUs. The GPUs
are given as CUDA ordinals in PCI order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``), counted among the GPUs
that machine's nvidia-smi lists (a container numbers only the GPUs passed to it).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pytest_gpuhost.errors import Unreachable
from pytest_gpuhost.modules import nccl, p2p

__all__ = ["ARGS", "TOOL", "cuda_order", "find_tool", "run_arm", "run_both", "side"]

TOOL = "all_reduce_perf"
# one process, every in-scope GPU (-g N); 8 MiB to 128 MiB, where a PCIe ring reaches its bus
# bandwidth; -c 1 checks every result (the #wrong column); 5 warm-up and 20 timed iterations
ARGS = ("-b", "8M", "-e", "128M", "-f", "2", "-c", "1", "-w", "5", "-n", "20")
KILL_AFTER = 5  # seconds between timeout's SIGTERM and its SIGKILL
MARK = "GPUHOST_NCCL_RUN"
# the pids of all_reduce_perf processes whose environment holds MARK=$1 (an argument, never spliced)
_OURS = (
    'for p in $(pgrep -x all_reduce_perf); do tr "\\0" "\\n" < /proc/$p/environ 2>/dev/null'
    ' | grep -qxF "GPUHOST_NCCL_RUN=$1" && echo "$p"; done; true'
)


def find_tool(conns: list[Any]) -> tuple[Any | None, list[str]]:
    """The first connection with all_reduce_perf on PATH, and where it was looked for."""
    looked = []
    for conn in conns:
        try:
            r = conn.run(["sh", "-c", 'command -v "$1"', "sh", TOOL], timeout=15)
        except Unreachable as exc:
            looked.append(f"{conn.name} (unreachable: {str(exc)[:80]})")
            continue
        if r.rc == 0 and r.stdout.strip():
            return conn, looked
        looked.append(conn.name)
    return None, looked


def cuda_order(conn: Any) -> list[str]:
    """PCI addresses of the GPUs this machine's nvidia-smi lists, in PCI order (CUDA's with PCI_BUS_ID)."""
    r = conn.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], timeout=30)
    if r.rc != 0:
        return []
    return sorted(p2p.norm_bdf(line) for line in r.stdout.splitlines() if line.strip())


def leftovers(conn: Any, token: str) -> list[int]:
    """Pids of all_reduce_perf processes of this arm still on the target."""
    r = conn.run(["sh", "-c", _OURS, "sh", token], timeout=15)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def run_arm(conn: Any, name: str, gpus: list[str], extra_env: dict[str, str], bound: float) -> nccl.Arm:
    """Run one arm on ``gpus`` (PCI addresses) within ``bound`` seconds on the target."""
    gpus = sorted(gpus)
    order = cuda_order(conn)
    argv = ["timeout", "-k", str(KILL_AFTER), f"{bound:g}", TOOL, *ARGS, "-g", str(len(gpus))]
    arm = nccl.Arm(name, gpus, argv, dict(extra_env), bound, where=conn.name)
    missing = [b for b in gpus if b not in order]
    if missing:
        arm.tail = f"{', '.join(missing)} not listed by nvidia-smi on {conn.name}"
        return arm
    token = uuid.uuid4().hex
    env = {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(order.index(b)) for b in gpus),
        "NCCL_DEBUG": "INFO",
        MARK: token,
        **extra_env,
    }
    t0 = time.monotonic()
    r = conn.run(argv, timeout=bound + KILL_AFTER + 15, env=env)
    arm.seconds = time.monotonic() - t0
    arm.rc = r.rc
    # timeout(1): 124 when it sent SIGTERM, 137 when the command needed the SIGKILL
    arm.hung = r.rc in (124, 137) or bool(getattr(r, "timed_out", False))
    arm.tail = (r.stdout + "\n" + r.stderr).strip()[-4000:]
    arm.result = nccl.parse_perf(r.stdout)
    arm.channels = nccl.parse_channels(r.stdout + "\n" + r.stderr)
    left = leftovers(conn, token)
    if left:
        conn.run(["kill", "-9", *map(str, left)], timeout=15)
        time.sleep(0.5)
        arm.leftover = left
    return arm


def run_both(conn: Any, gpus: list[str], bound: float) -> tuple[nccl.Arm, nccl.Arm]:
    """The P2P arm (NCCL as it chooses), then the control arm (NCCL_P2P_DISABLE=1), on ``gpus``."""
    first = run_arm(conn, nccl.ARMS[0], gpus, {"NCCL_P2P_DISABLE": "0"}, bound)
    control = run_arm(conn, nccl.ARMS[1], gpus, dict(nccl.CONTROL_ENV), bound)
    return first, control


def side(arm: nccl.Arm) -> dict[str, Any]:
    """One arm as a column of the evidence: transport, bus bandwidth, wrong elements, time."""
    r = arm.result
    return {
        "transport": arm.transport_text(),
        "avg busbw (GB/s)": r.avg_busbw,
        "#wrong": r.wrong,
        "seconds": round(arm.seconds, 2),
        "rc": arm.rc,
        "result": arm.failure() or "completed",
        "where": arm.where,
        "env": arm.env,
    }

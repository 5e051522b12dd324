"""The short compute check after a GPU reset or a reboot: one all-reduce on each GPU, data checked.

A reset is confirmed by the GPU's own signals (reset.py); this asks the GPU to compute as well.
nccl-tests' `all_reduce_perf` on that one GPU (`-g 1 -c 1`: every result checked, the `#wrong`
column), else the same run of the torch program with `python3` on the node's PATH, through
modules/nccl_run.py, bounded on the target with nothing of ours left behind. On one GPU the
collective is a copy within the GPU, so it proves that CUDA can open the GPU, run kernels on it
and get right data back, and nothing about its links. Where the node has neither, the check says
"not checked" and the reset stands on the signals alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytest_gpuhost.modules import p2p
from pytest_gpuhost.modules.nccl_run import NO_TOOL, find_tool, run_arm, side
from pytest_gpuhost.run import evidence

__all__ = ["BOUND", "compute_check"]

BOUND = 60.0  # seconds for each GPU's run; the lab's takes well under one


def compute_check(conn: Any, gpus: Sequence[str], bound: float = BOUND) -> tuple[bool, str]:
    """Run the check on each GPU (nvidia-smi's bus ids); return (ok, one line for the verdict).

    ok is True when every GPU completed with 0 wrong, or when there is no tool to run (the
    line says "not checked").
    """
    ev = evidence.current()
    tool, looked = find_tool([conn])
    if tool is None:
        line = f"compute check: not checked (no {NO_TOOL} on the node: {'; '.join(looked)})"
        ev.note(line)
        return True, line
    ev.note(f"compute check with {tool.describe()}")
    bad: list[str] = []
    good: list[str] = []
    for gpu in gpus:
        bus = p2p.norm_bdf(gpu)
        arm = run_arm(tool, "compute", [bus], {}, bound)
        ev.note(f"compute check on {bus}: {side(arm)}")
        wrong = arm.result.wrong or arm.result.out_of_bounds
        why = arm.failure() or (f"{wrong} wrong result(s)" if wrong else "")
        (bad if why else good).append(f"{bus}: {why}" if why else bus)
    if bad:
        return False, f"compute check failed ({tool.label()} -g 1 -c 1): " + "; ".join(bad)
    return True, f"compute check passed on {', '.join(good)} ({tool.label()} -g 1 -c 1, 0 wrong)"

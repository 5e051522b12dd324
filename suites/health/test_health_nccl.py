"""`--health-nccl`: an NCCL all-reduce on every GPU of the host, against a control arm (opt-in).

A copy that passes is not proof that the collectives work (NCCL hangs, or a collective returns
wrong data, while copies and p2pBandwidthLatencyTest pass: github.com/vllm-project/vllm/issues/
51513, github.com/NVIDIA/nccl-tests/issues/117). On hosts with two or more GPUs, nccl-tests'
`all_reduce_perf -c 1` (else the torch program with `python3` on the host's PATH, where its torch
has NCCL) runs on all of them as NCCL chooses (the P2P arm) and with NCCL_P2P_DISABLE=1 (the
control), each bounded on the host (pytest_gpuhost/modules/nccl_run.py);
the verdict (pytest_gpuhost/modules/nccl.py) passes only when the first arm completed in its
bound with 0 wrong elements. On GPUs that NCCL connects through P2P (every channel via P2P/...)
it must also beat the control by the stated margin; a host whose NCCL uses SHM or NET for its
GPUs (no P2P path between them, which a health check cannot repair) is judged on completion and
data only, with its transport in the summary. Collected only with --health-nccl
(suites/health/conftest.py). It only reports.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.modules import nccl
from pytest_gpuhost.modules.nccl_run import NO_TOOL, cuda_order, find_tool, run_both, side
from pytest_gpuhost.run import evidence

from . import options


def judge(first: nccl.Arm, control: nccl.Arm) -> tuple[bool, str]:
    """(ok, summary) of the two arms, as the health check reads them (see the module docstring)."""
    full = nccl.verdict(first, control)
    if full.ok:
        return True, full.summary
    wrong = bool(first.result.wrong or first.result.out_of_bounds)
    if first.failure() or wrong:  # hung, no result, wrong data: the collective itself does not work
        return False, full.summary
    kinds = {c.kind for c in first.channels}
    if kinds and "P2P" not in kinds:
        return True, f"all-reduce completed with correct data via {first.transport_text()} (no P2P path)"
    return False, full.summary


def test_nccl_collective(health: Any, request: Any) -> None:
    """NCCL collective: an all-reduce on every GPU completes in its bound, with correct data."""
    conn = health.target.conn
    gpus = cuda_order(conn)
    if len(gpus) < 2:
        pytest.skip("fewer than two GPUs: no collective")
    tool, looked = find_tool([conn])
    if tool is None:
        pytest.skip(f"not checked: no NCCL tool ({NO_TOOL}): {'; '.join(looked)}")
    ev = evidence.current()
    ev.note(f"collective run with {tool.describe()}")
    first, control = run_both(tool, gpus, options.nccl_timeout(request.config))
    for arm in (first, control):
        ev.state(arm.name, side(arm), target=health.name)
    ok, summary = judge(first, control)
    props = request.node.user_properties
    props.append(("gpuhost_host", health.name))
    props.append(("gpuhost_check", "nccl_collective"))
    props.append(
        ("gpuhost_verdict", {"check": "nccl_collective", "ok": ok, "summary": summary, "reasons": gpus})
    )
    if not ok:
        pytest.fail(f"nccl collective: {summary}", pytrace=False)

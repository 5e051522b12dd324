"""The health suite's opt-in NCCL check (`--health-nccl`): how it reads the two arms.

Unlike suites/p2p, which repairs P2P and so demands it, the health check fails only what breaks a
collective: a hang, no result, or wrong data; and on P2P channels, P2P no faster than the
control. A host whose NCCL has no P2P path between its GPUs (SHM) is judged on completion and data.
"""

from __future__ import annotations

from suites.health.test_health_nccl import judge
from tests.p2p.test_p2p_nccl import arm, control, perf


def test_p2p_that_beats_the_control_passes() -> None:
    ok, summary = judge(arm("P2P", perf(21.0), "P2P/direct pointer"), control(10.0))
    assert ok, summary


def test_shm_with_correct_data_passes_and_says_so() -> None:
    ok, summary = judge(arm("P2P", perf(9.5), "SHM/direct/direct"), control(10.0))
    assert ok and summary == "all-reduce completed with correct data via SHM/direct/direct (2) (no P2P path)"


def test_wrong_data_fails_on_any_transport() -> None:
    for via in ("SHM/direct/direct", "P2P/IPC"):
        ok, summary = judge(arm("P2P", perf(9.5, wrong=3), via, rc=1), control(10.0))
        assert not ok and "wrong data" in summary, (via, summary)


def test_a_hang_fails() -> None:
    ok, summary = judge(
        arm("P2P", perf(0, concluded=False), "SHM/direct/direct", rc=124, hung=True), control()
    )
    assert not ok and "hung after 60 s" in summary


def test_p2p_no_faster_than_the_control_fails() -> None:
    ok, summary = judge(arm("P2P", perf(11.0), "P2P/CUMEM"), control(10.0))
    assert not ok and "below 1.2x" in summary

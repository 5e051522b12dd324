"""suites/p2p's NCCL collective step (test_p2p_collective) against the proxmox-rtx6000 lab host.

The lab's all_reduce_perf (gpulab_tools/all_reduce_perf.py) goes via P2P when the GPUs' IOMMU
groups are identity, via SHM otherwise; faults.json's ``nccl_hang`` and ``nccl_wrong`` make the
P2P arm hang or return wrong data. One host for the module (the session's), repaired once by the
`repaired` fixture; each scenario then runs the suite with --check-only, which only measures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.p2p.test_p2p_suite import run_suite

STEP = "test_p2p_collective"
DROPIN = "/etc/systemd/system/sglang-qwen.service.d/gpuhost-test-nccl.conf"


@pytest.fixture(scope="module")
def host(lab: Any) -> Any:
    """The proxmox-rtx6000 lab host (the session's, as tests/p2p/test_p2p_suite.py uses it)."""
    return lab.host("proxmox-rtx6000")


def set_faults(host: Any, faults: dict[str, Any]) -> None:
    r = host.ssh(["sh", "-c", "cat > /var/lib/gpulab/faults.json"], input=json.dumps(faults))
    assert r.returncode == 0, r.stderr


def arms(run: Any) -> dict[str, dict[str, Any]]:
    """The two arms side by side, as the evidence shows them (label -> column)."""
    labels = ("P2P", "control (NCCL_P2P_DISABLE=1)")
    return {s["label"]: s["value"] for s in run.evidence(STEP).get("states", []) if s["label"] in labels}


def message(run: Any) -> str:
    return str(run.tests[STEP].get("message", ""))


def ours_left(host: Any) -> str:
    return str(host.ssh("pgrep -x all_reduce_perf; true").stdout.strip())


@pytest.fixture(scope="module")
def repaired(host: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The host after one repair run (groups identity): the collective's P2P arm goes via P2P."""
    host.reset()
    set_faults(host, {})
    tmp = tmp_path_factory.mktemp("nccl-repair")
    broken = run_suite(host, tmp, "--check-only")
    first = run_suite(host, tmp)
    assert first.rc == 0, first.output[-3000:]
    yield host, broken, first
    set_faults(host, {})


def test_collective_on_broken_host_goes_via_shm_and_would_fix(repaired: Any) -> None:
    """Groups translated (DMA-FQ): NCCL finds no peer path, both arms go via SHM; check-only says would fix."""
    _, broken, _ = repaired
    assert broken.outcomes[STEP] == "would fix", broken.outcomes
    side = arms(broken)
    assert set(side) == {"P2P", "control (NCCL_P2P_DISABLE=1)"}, side
    assert side["P2P"]["transport"].startswith("SHM/direct/direct"), side
    assert "not via P2P" in message(broken), message(broken)


def test_collective_after_repair_beats_control(repaired: Any) -> None:
    """After the repair the P2P arm goes via P2P, 0 wrong, faster than the control by the margin."""
    _, _, first = repaired
    assert first.outcomes[STEP] == "passed", first.outcomes
    side = arms(first)
    p2p, control = side["P2P"], side["control (NCCL_P2P_DISABLE=1)"]
    assert p2p["transport"].startswith("P2P/direct pointer") and p2p["#wrong"] == 0, side
    assert control["transport"].startswith("SHM/direct/direct"), side
    assert p2p["avg busbw (GB/s)"] >= 1.2 * control["avg busbw (GB/s)"], side
    print(f"lab busbw: P2P {p2p['avg busbw (GB/s)']} GB/s, control {control['avg busbw (GB/s)']} GB/s")


def test_hung_collective_is_bounded_and_named(repaired: Any, tmp_path: Path) -> None:
    """nccl_hang: the P2P arm is ended by timeout on the host, reported as hung with its GPUs; nothing is left."""
    host = repaired[0]
    set_faults(host, {"nccl_hang": True})
    try:
        run = run_suite(host, tmp_path, "--check-only", "--p2p-nccl-timeout=5")
    finally:
        set_faults(host, {})
    assert run.outcomes[STEP] == "failed", run.outcomes
    assert "hung after 5 s on 0000:17:00.0, 0000:18:00.0, 0000:3a:00.0, 0000:3b:00.0" in message(run), (
        message(run)
    )
    assert ours_left(host) == ""
    assert run.rc != 0


def test_wrong_data_fails_and_service_env_is_reported(repaired: Any, tmp_path: Path) -> None:
    """nccl_wrong: #wrong != 0 fails the step; NCCL_P2P_DISABLE=1 in the unit's Environment= is named."""
    host = repaired[0]
    conf = "[Service]\nEnvironment=NCCL_P2P_DISABLE=1\n"
    setup = f"mkdir -p {Path(DROPIN).parent} && cat > {DROPIN} && systemctl daemon-reload"
    r = host.ssh(["pct", "exec", "101", "--", "sh", "-c", setup], input=conf)
    assert r.returncode == 0, r.stderr
    set_faults(host, {"nccl_wrong": 7})
    try:
        run = run_suite(host, tmp_path, "--check-only")
    finally:
        set_faults(host, {})
        host.ssh(["pct", "exec", "101", "--", "sh", "-c", f"rm -f {DROPIN} && systemctl daemon-reload"])
    assert run.outcomes[STEP] == "failed", run.outcomes
    text = message(run)
    assert "P2P: wrong data: 35 wrong elements (first at 8388608 B: 7)" in text, text
    assert "the service disables P2P itself (NCCL_P2P_DISABLE=1 in the Environment=" in text, text


def test_acs_redirect_routed_by_the_root_complex_passes_copies_and_hangs_the_collective(
    lab: Any, tmp_path: Path
) -> None:
    """The #902 case: ACS redirect on the switch ports, routed back by the root complex. The repair
    runs, the copies pass, the collective hangs in its bound, names the GPUs and points at ACS."""
    import os

    from gpulab.profiles.p2p_variants import rtx6000_acs_redirect_routed

    h = lab.host(rtx6000_acs_redirect_routed(), name=f"p2pred-{os.getpid()}")
    run = run_suite(h, tmp_path, "--p2p-nccl-timeout=5")
    assert run.outcomes["test_p2p_bandwidth"] in ("passed", "fixed"), (run.outcomes, run.output[-3000:])
    assert run.outcomes[STEP] == "failed", run.outcomes
    text = message(run)
    assert "hung after 5 s on 0000:17:00.0, 0000:18:00.0, 0000:3a:00.0, 0000:3b:00.0" in text, text
    assert "ACS P2P Request/Completion Redirect is on at 0000:16:00.0, 0000:16:01.0, 0000:39:00.0" in text, (
        text
    )
    assert ours_left(h) == ""
    assert run.rc != 0


def test_without_nccl_tests_the_services_own_python_is_asked(repaired: Any, tmp_path: Path) -> None:
    """No all_reduce_perf on the host nor in LXC 101: the step asks the SGLang stand-in's own Python
    (its #! interpreter, read in the container at step 1) and python3 on both PATHs for a torch with
    NCCL; the lab has none, so it skips, naming each place and why."""
    host = repaired[0]
    tool = "/usr/bin/all_reduce_perf"
    r = host.ssh(f"mv {tool} {tool}.aside && pct exec 101 -- mv {tool} {tool}.aside")
    assert r.returncode == 0, r.stderr
    try:
        run = run_suite(host, tmp_path, "--check-only")
    finally:
        host.ssh(f"mv {tool}.aside {tool}; pct exec 101 -- mv {tool}.aside {tool}")
    assert run.outcomes[STEP] == "skipped", run.outcomes
    text = message(run)
    assert text.startswith(
        "p2p collective: not checked: no NCCL tool (nccl-tests' all_reduce_perf on PATH, or a Python "
        "whose torch has NCCL): "
    ), text
    assert text.count(": no all_reduce_perf") == 2, text  # the host and the container
    before = next(s["value"] for s in run.evidence(STEP)["states"] if s["label"] == "before")
    (python,) = before["service_env"]["pythons"]  # ExecStart=python3 ...: its /proc/PID/exe
    path, _, where = python.partition(" (")
    assert path.startswith("/usr/bin/python3") and where.endswith("of sglang-qwen.service)"), python
    asked = f"{path} on {host.address}/101: ModuleNotFoundError: No module named 'torch'"
    assert asked in text, text
    assert text.index(asked) < text.index("python3 on "), text  # the service's own first

"""suites/p2p end to end against the proxmox-rtx6000 lab host, over real SSH.

One lab host for the module, `reset()` between scenarios. Each scenario runs the suite in a
subprocess, exactly as an operator would, and judges it by its exit code, its JSON evidence
report, the lab's record of sysfs writes and signals, and the host's state read over SSH.
Connection cuts are injected by a small pytest plugin given to the suite run with `-p`: it
implements the plugin's own hooks (`pytest_gpuhost_command`) and calls `gpulab cut-link`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.gate import GATE_WAIT, Gate

ROOT = Path(__file__).resolve().parents[2]
NVIDIA = ["0000:17:00.0", "0000:18:00.0", "0000:3a:00.0", "0000:3b:00.0"]
GROUPS = [30, 31, 32, 33]
VFIO = ["0000:9a:00", "0000:9b:00", "0000:ba:00", "0000:bb:00"]  # GPUs 4-7 and their audio functions
VFIO_GROUPS = [34, 35, 36, 37]
STEPS = [
    "test_plan",
    "test_service_stopped",
    "test_gpus_released",
    "test_iommu_groups_identity",
    "test_drivers_bound",
    "test_p2p_bandwidth",
    "test_p2p_collective",
    "test_persisted",
    "test_service_restored",
]
STOP_TIMEOUT = 2.0

CUT_PLUGIN = '''
"""Cut the lab host's link right after the first command or write that matches P2P_CUT_AT."""
import os
import subprocess
import sys

_done = []


def pytest_gpuhost_command(target, result):
    if _done or os.environ["P2P_CUT_AT"] not in result.command or not result.ok:
        return
    _done.append(result.command)
    subprocess.run([sys.executable, "-m", "gpulab", "cut-link", os.environ["P2P_CUT_HOST"]], check=True, timeout=30)
    print("CUT after:", result.command, flush=True)
'''


@pytest.fixture(scope="module")
def host(lab: Any) -> Any:
    """The proxmox-rtx6000 lab host, booted once for this module."""
    return lab.host("proxmox-rtx6000")


class Run:
    """One suite run: exit code, output, per-test outcomes from the JSON report, and the new record lines."""

    def __init__(
        self,
        proc: subprocess.CompletedProcess[str],
        report: Path,
        record: list[dict[str, Any]],
        seconds: float,
    ) -> None:
        self.rc = proc.returncode
        self.output = proc.stdout + proc.stderr
        self.record = record
        self.seconds = seconds
        self.doc = json.loads(report.read_text()) if report.exists() else {"tests": []}
        self.outcomes: dict[str, str] = {}
        self.tests: dict[str, dict[str, Any]] = {}
        for t in self.doc.get("tests", []):
            name = t["nodeid"].split("::")[-1].split("[")[0]
            self.tests[name] = t
            self.outcomes[name] = t.get("gpuhost_outcome") or t.get("outcome")

    def writes(self) -> list[dict[str, Any]]:
        return [r for r in self.record if r.get("kind", "sysfs") == "sysfs"]

    def signals(self) -> list[dict[str, Any]]:
        return [r for r in self.record if r.get("kind") == "signal"]

    def evidence(self, step: str) -> dict[str, Any]:
        return self.tests.get(step, {}).get("evidence", {}).get("call", {})


def run_suite(
    host: Any,
    tmp_path: Path,
    *args: str,
    plugin: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 180,
) -> Run:
    """Run suites/p2p against the lab host in a subprocess; return what it did."""
    n = len(host.record())
    name = f"p2p-{time.monotonic_ns()}"
    argv = [
        sys.executable, "-m", "pytest", "suites/p2p", *host.pytest_args(),
        f"--stop-timeout={STOP_TIMEOUT:g}", "--command-timeout=8", "--connect-timeout=4",
        f"--report-dir={tmp_path}", f"--report-name={name}", "-p", "no:cacheprovider", "-q", *args,
    ]  # fmt: skip
    full_env = dict(os.environ, **(env or {}))
    if plugin:
        (tmp_path / "p2p_cut_plugin.py").write_text(plugin)
        full_env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), full_env.get("PYTHONPATH", "")])
        argv += ["-p", "p2p_cut_plugin"]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    run = Run(proc, tmp_path / f"{name}.json", host.record()[n:], time.monotonic() - t0)
    print(f"suite run {' '.join(args)}: rc {run.rc} in {run.seconds:.1f} s: {run.outcomes}")
    return run


def sh(host: Any, command: str) -> str:
    r = host.ssh(command)
    return r.stdout.strip()


def host_state(host: Any) -> dict[str, Any]:
    """Read groups, drivers, minors and the service state over SSH (one command)."""
    script = (
        "for g in 30 31 32 33 34 35 36 37; do echo group $g $(cat /sys/kernel/iommu_groups/$g/type); done; "
        "for d in /sys/bus/pci/devices/*; do b=${d##*/}; case $b in *:00.[01]) "
        "echo drv $b $(basename $(readlink $d/driver 2>/dev/null) 2>/dev/null);; esac; done; "
        "nvidia-smi --query-gpu=pci.bus_id,minor_number --format=csv,noheader | sed 's/^/minor /'; "
        "echo svc $(pct exec 101 -- systemctl is-active sglang-qwen.service); "
        "echo decoy $(pct exec 101 -- pgrep -x vim)"
    )
    out: dict[str, Any] = {"groups": {}, "drivers": {}, "minors": {}, "service": "", "decoy": ""}
    for line in sh(host, script).splitlines():
        parts = line.split()
        if parts[0] == "group":
            out["groups"][int(parts[1])] = parts[2] if len(parts) > 2 else None
        elif parts[0] == "drv":
            out["drivers"][parts[1]] = parts[2] if len(parts) > 2 else None
        elif parts[0] == "minor":
            bus, minor = (c.strip() for c in " ".join(parts[1:]).split(","))
            out["minors"]["0000:" + bus.lower().split(":", 1)[1]] = int(minor)
        elif parts[0] == "svc":
            out["service"] = parts[1] if len(parts) > 1 else ""
        elif parts[0] == "decoy":
            out["decoy"] = " ".join(parts[1:])
    return out


def assert_repaired(host: Any) -> None:
    """Groups 30-33 identity, every function on its driver, /dev/nvidia0-3 as before, service up."""
    st = host_state(host)
    assert [st["groups"][g] for g in GROUPS] == ["identity"] * 4, st["groups"]
    assert [st["groups"][g] for g in VFIO_GROUPS] == ["DMA-FQ"] * 4, st["groups"]
    for b in NVIDIA:
        assert st["drivers"][b] == "nvidia", st["drivers"]
        assert st["drivers"][b[:-1] + "1"] == "snd_hda_intel", st["drivers"]
    for b in VFIO:
        assert st["drivers"][b + ".0"] == st["drivers"][b + ".1"] == "vfio-pci", st["drivers"]
    assert st["minors"] == {b: i for i, b in enumerate(NVIDIA)}, st["minors"]
    assert st["service"] == "active"


def assert_vfio_untouched(run: Run) -> None:
    for w in run.writes():
        text = f"{w.get('path')} {w.get('value')}"
        assert not any(b in text for b in VFIO), w
        assert not any(f"iommu_groups/{g}/" in text for g in VFIO_GROUPS), w


def test_repair_rerun_reboot(host: Any, tmp_path: Path) -> None:
    """Broken host -> fixed with P2P passing and before/after heatmaps, the SIGTERM-ignoring service stopped
    in bound, decoys alive; rerun all passed and nothing signalled; after a reboot the groups are identity
    by themselves and --check-only passes."""
    host.reset()
    decoy_before = host_state(host)["decoy"]
    assert decoy_before, "the lab's decoy (vim sglang_notes.md) should run"

    first = run_suite(host, tmp_path)
    assert first.rc == 0, first.output[-3000:]
    assert first.outcomes["test_p2p_bandwidth"] == "passed"
    assert {first.outcomes[s] for s in STEPS} <= {"passed", "fixed"}
    for s in (
        "test_plan",
        "test_service_stopped",
        "test_gpus_released",
        "test_iommu_groups_identity",
        "test_drivers_bound",
        "test_persisted",
        "test_service_restored",
    ):
        assert first.outcomes[s] == "fixed", (s, first.outcomes)
    names = [m["name"] for m in first.evidence("test_plan").get("matrices", [])]
    names += [m["name"] for m in first.evidence("test_p2p_bandwidth").get("matrices", [])]
    assert names == ["P2P bandwidth before", "P2P bandwidth after"]
    after = first.evidence("test_p2p_bandwidth")["matrices"][0]
    assert min(v for row in after["values"] for v in row if v is not None) >= after["threshold"]
    assert_vfio_untouched(first)
    assert any(
        w["path"].endswith("/iommu_groups/30/type") and w["value"].strip() == "identity"
        for w in first.writes()
    )
    # the stand-in ignores SIGTERM forever: stopped by its unit (SIGKILL) within --stop-timeout + 5 s
    measures = {m["name"]: m["value"] for m in first.evidence("test_service_stopped").get("measures", [])}
    assert measures["service stop seconds"] <= STOP_TIMEOUT + 5
    signalled = {s["service"] for s in first.signals()}
    assert signalled == {"sglang-qwen", "nvidia-persistenced"}, first.signals()  # never the decoys
    assert_repaired(host)
    assert host_state(host)["decoy"] == decoy_before  # same PID: the decoy survived

    second = run_suite(host, tmp_path)
    assert second.rc == 0, second.output[-3000:]
    assert set(second.outcomes.values()) == {"passed"}, second.outcomes
    assert second.writes() == [] and second.signals() == [], second.record

    n = len(host.record())
    host.reboot()
    boot = Run(subprocess.CompletedProcess([], 0, "", ""), tmp_path / "none.json", host.record()[n:], 0.0)
    assert boot.writes(), "the boot unit should have written identity"
    assert_vfio_untouched(boot)  # the boot unit touches exactly the repaired groups
    st = host_state(host)
    assert [st["groups"][g] for g in GROUPS] == ["identity"] * 4, st
    assert [st["groups"][g] for g in VFIO_GROUPS] == ["DMA-FQ"] * 4, st
    # The container starts after the host's boot units (as pve-guests.service does): its service
    # comes up on GPUs whose groups are already identity, and NCCL says P2P.
    deadline = time.monotonic() + 30
    while host_state(host)["service"] != "active" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert host_state(host)["service"] == "active"
    log = sh(host, "pct exec 101 -- cat /var/log/sglang/sglang-qwen.log")
    nccl = [line for line in log.splitlines() if " via " in line]
    assert nccl and "via P2P" in nccl[-1], log[-2000:]
    n = len(host.record())
    check = run_suite(host, tmp_path, "--check-only")
    assert check.rc == 0, check.output[-3000:]
    assert set(check.outcomes.values()) == {"passed"}, check.outcomes
    assert host.record()[n:] == []


def test_check_only_on_broken_host(host: Any, tmp_path: Path) -> None:
    """--check-only: non-zero exit, every step would fix with its commands, and zero writes."""
    host.reset()
    run = run_suite(host, tmp_path, "--check-only")
    assert run.rc != 0
    assert [run.outcomes[s] for s in STEPS] == ["would fix"] * 9, run.outcomes
    assert run.record == [], run.record
    assert "echo identity > /sys/kernel/iommu_groups/30/type" in run.output
    assert "echo 0000:17:00.0 > /sys/bus/pci/drivers/nvidia/unbind" in run.output
    assert "systemctl kill -s SIGKILL --kill-whom=all sglang-qwen.service" in run.output
    assert "9a:00" not in run.output.split("would fix (check-only)")[-1]
    assert host_state(host)["service"] == "active"


# The first fix of a repairing run is the plan step's, which takes the run lock: right after it,
# the run stops at a gate until the test lets it go, so the lock is held while the second run tries.
LOCK_GATE_PLUGIN = (
    GATE_WAIT
    + """
import os

_gated = []


def pytest_gpuhost_after_fix(item, target, remediation, actions, outcome, after):
    if not _gated:
        _gated.append(remediation.name)
        gate_wait(os.environ["GPUHOST_TEST_GATE_REACHED"], os.environ["GPUHOST_TEST_GATE_OPEN"], remediation.name)
"""
)


def test_concurrent_run_stops_with_a_clear_message(host: Any, tmp_path: Path) -> None:
    """A second run while one repairs: it waits up to --p2p-lock-wait, then stops naming the holder."""
    host.reset()
    results: dict[str, Run] = {}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    gate = Gate(tmp_path)
    first = threading.Thread(
        target=lambda: results.setdefault(
            "a", run_suite(host, tmp_path / "a", plugin=LOCK_GATE_PLUGIN, env=gate.env(), timeout=300)
        )
    )
    first.start()
    try:
        assert gate.wait_reached(150, first.is_alive) == "plan"  # the plan step took the lock
        assert "owner.json" in sh(host, "ls /var/lib/gpuhost/lock/p2p 2>/dev/null")
        second = run_suite(host, tmp_path / "b", "--p2p-lock-wait=1")
    finally:
        gate.open()
        first.join(300)
    assert second.rc != 0
    assert "another p2p run holds /var/lib/gpuhost/lock/p2p" in second.output
    assert not second.writes(), second.writes()  # the first run was held: every write is the second's
    assert results["a"].rc == 0, results["a"].output[-3000:]
    assert_repaired(host)


HOLD_PLUGIN = '''
"""Right before step 4 unbinds, start a process on the host that holds /dev/nvidia1 (a GPU user
that is not part of the service): the nvidia unbind of that GPU then blocks in the kernel."""
import os
import subprocess
import sys


def pytest_gpuhost_before_fix(item, target, remediation, actions, check_only):
    if remediation.name != "iommu groups identity" or check_only:
        return None
    line = "setsid sleep 600 </dev/nvidia1 >/dev/null 2>&1 & echo $!"
    r = subprocess.run([sys.executable, "-m", "gpulab", "ssh", os.environ["P2P_HOST"], "--", line],
                       capture_output=True, text=True, timeout=30, check=True)
    with open(os.environ["P2P_HOLDER_FILE"], "w") as fh:
        fh.write(r.stdout.strip().splitlines()[-1])
    return None
'''


def test_blocked_unbind_is_reported_rolled_back_and_completed_next_run(host: Any, tmp_path: Path) -> None:
    """A GPU user appears after the holders check: its nvidia unbind blocks; the run reports it within the
    watchdog, rebinds what it unbound, and starts NOTHING (the pending removal would take
    the GPU from under the service): "reboot needed"; once the user is gone the next run converges."""
    host.reset()
    holder_file = tmp_path / "holder.pid"
    env = {"P2P_HOST": host.name, "P2P_HOLDER_FILE": str(holder_file)}
    run = run_suite(host, tmp_path, "--p2p-unbind-timeout=3", plugin=HOLD_PLUGIN, env=env)
    assert run.rc != 0
    assert run.outcomes["test_iommu_groups_identity"] == "failed", run.outcomes
    assert "unbind 0000:18:00.0 nvidia: the write did not return within 3 s" in run.output, run.output[
        run.output.find("FAILURES") :
    ][:3000]
    assert run.seconds < 60
    st = host_state(host)
    assert all(st["drivers"][b] == "nvidia" for b in NVIDIA), st["drivers"]  # nobody left without a driver
    assert all(st["drivers"][b[:-1] + "1"] == "snd_hda_intel" for b in NVIDIA), st["drivers"]
    assert st["service"] != "active"  # never started while the unbind is pending
    assert sh(host, "systemctl is-active nvidia-persistenced.service") != "active"
    notes = "\n".join(run.tests["test_service_restored"]["evidence"]["teardown"]["notes"])
    assert "reboot needed" in notes, notes
    assert "start sglang-qwen.service: done" not in notes, notes
    assert_vfio_untouched(run)
    assert "p2p.json" in sh(host, "ls /var/lib/gpuhost/journal")  # kept for the next run
    host.ssh(f"kill {int(holder_file.read_text())}")
    again = run_suite(host, tmp_path)
    assert again.rc == 0, again.output[-4000:]
    assert_repaired(host)


CT_STOP_PLUGIN = '''
"""Right before step 4 unbinds, stop the service's container as `pct stop` would: kill its init."""
import os
import signal


def pytest_gpuhost_before_fix(item, target, remediation, actions, check_only):
    if remediation.name == "iommu groups identity" and not check_only:
        os.kill(int(os.environ["P2P_CT_INIT"]), signal.SIGKILL)
    return None
'''


def test_stopped_container_is_not_a_lost_host(host: Any, tmp_path: Path) -> None:
    """The container stops mid-run: the host's steps go on, the host's undo (start
    nvidia-persistenced) still runs at the end, the report names the container as unreachable, and the
    journal stays for the run that will start the service."""
    host.reset()
    run = run_suite(host, tmp_path, plugin=CT_STOP_PLUGIN, env={"P2P_CT_INIT": str(host.init_pid(101))})
    assert run.rc != 0
    for step in ("test_iommu_groups_identity", "test_drivers_bound", "test_persisted"):
        assert run.outcomes[step] == "fixed", run.outcomes  # the host is not lost
    assert run.outcomes["test_p2p_bandwidth"] == "passed", run.outcomes
    assert run.outcomes["test_service_restored"] == "failed", run.outcomes
    assert f"{host.address}/101 unreachable" in run.output, run.output[-3000:]
    st = host_state(host)
    assert [st["groups"][g] for g in GROUPS] == ["identity"] * 4, st["groups"]
    assert all(st["drivers"][b] == "nvidia" for b in NVIDIA), st["drivers"]
    assert sh(host, "systemctl is-active nvidia-persistenced.service") == "active"
    teardown = run.tests["test_service_restored"]["evidence"]["teardown"]
    notes = "\n".join(teardown["notes"])
    assert f"undo [{host.address}] start nvidia-persistenced.service: done" in notes, notes
    assert (
        f"undo [{host.address}/101] start sglang-qwen.service: not done: {host.address}/101 unreachable"
        in notes
    )
    reach = {s["label"]: s["value"] for s in teardown["states"]}["reachability"]
    assert reach[host.address] == "reachable" and reach[f"{host.address}/101"].startswith("unreachable"), (
        reach
    )
    journal = json.loads(sh(host, "cat /var/lib/gpuhost/journal/p2p.json"))
    assert journal["service_stopped"] is True  # the next run starts it
    assert_vfio_untouched(run)


def test_old_kernel_is_refused_before_anything_is_touched(lab: Any, tmp_path: Path) -> None:
    """Kernel 6.1: groups of GPU + audio cannot change type; the run says so and changes nothing."""
    from gpulab.profiles.load import load_profile

    old = lab.host(load_profile("proxmox-rtx6000", {"kernel": "6.1.0-18-amd64"}), name=f"p2p61-{os.getpid()}")
    run = run_suite(old, tmp_path)
    assert run.rc != 0 and run.outcomes["test_plan"] == "failed"
    assert "before 6.4) cannot change the type of a group with more than one device" in run.output
    assert "iommu=pt" in run.output
    assert run.record == [], run.record
    old.down()


CUTS = {
    "service-stop": "systemctl stop --no-block -- sglang-qwen.service",
    "unbind": "/unbind",
    "set-type": "/type",
    "bind": "/bind",
}


@pytest.mark.parametrize("cut_at", list(CUTS))
def test_cut_link_at_each_destructive_step_then_converge(host: Any, tmp_path: Path, cut_at: str) -> None:
    """Cut the link right after the first destructive command of a step; heal; one more run converges."""
    host.reset()
    try:
        cut = run_suite(
            host, tmp_path, plugin=CUT_PLUGIN, env={"P2P_CUT_AT": CUTS[cut_at], "P2P_CUT_HOST": host.name}
        )
    finally:
        host.heal_link()
    deadline = time.monotonic() + 20
    while host.ssh("true").returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "CUT after:" in cut.output, cut.output[-3000:]
    assert cut.rc != 0
    assert_vfio_untouched(cut)
    again = run_suite(host, tmp_path, "--p2p-lock-wait=60")
    assert again.rc == 0, again.output[-4000:]
    assert_vfio_untouched(again)
    assert_repaired(host)
    assert "journal of interrupted run" in json.dumps(again.evidence("test_plan")), again.evidence(
        "test_plan"
    )

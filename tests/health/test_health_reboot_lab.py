"""`suites/health --fix=reset,reboot` on a B200 node whose GPU 3 logged Xid 79, over real SSH.

Xid 79 is "GPU has fallen off the bus"; NVIDIA's Xid catalogue resolves it with RESTART_BM (a
reboot), not a GPU reset (fixtures/xid/nvidia-xid-catalog.csv), so the reset step plans a reboot
of the node: the SGLang servers stopped first (bounded), `systemctl reboot`, SSH waited for with a
new boot id, the servers started again. The profile is `b200-nvl8` with its seven SGLang
data-parallel servers run as systemd units, as an operator who names them in the inventory has
them. A process outside those units that holds any GPU of the node stops the reboot.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from gpulab.profiles.load import load_profile
from tests.health.test_health_reset_lab import REPO, _argv, _boot_id, _main_pid

GPU3 = "0000:61:00"  # GPU 3 of b200-nvl8 (minor 3), as the kernel's Xid line names it
XID79 = f"NVRM: Xid (PCI:{GPU3}): 79, pid=2231, name=python3, GPU has fallen off the bus."
UNITS = [f"sglang-dp{i}.service" for i in range(7)]


def _b200_under_systemd() -> Any:
    """b200-nvl8 with its SGLang servers as systemd units (the stock profile starts them by hand)."""
    base = load_profile("b200-nvl8")
    services = []
    for s in base.raw["services"]:
        services.append({**s, "manager": "systemd"} if s.get("kind") == "sglang" else s)
    return load_profile("b200-nvl8", overrides={"name": "b200-xid79", "services": services})


def _run(h: Any, tmp: Path, name: str, *extra: str, fix: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    argv = _argv(h, tmp, name, *extra, fix=fix, service=UNITS)
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    return proc, json.loads((tmp / f"{name}.json").read_text())


def _pids(h: Any) -> dict[str, str]:
    return {u: _main_pid(h, u) for u in UNITS}


def test_xid_79_on_gpu_3_reboots_the_node_with_its_servers_stopped_and_started(
    lab: Any, tmp_path: Path
) -> None:
    h = lab.host(_b200_under_systemd(), name=f"hx{os.getpid() % 100000}")
    after_boot = max(k.t for k in h.profile.kernel_log) + 1.0
    line = json.dumps({"t": after_boot, "msg": XID79}) + "\n"
    assert h.ssh(["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=line).returncode == 0
    boot, before = _boot_id(h), _pids(h)
    assert all("ActiveState=active" in v for v in before.values()), before

    # --check-only shows the plan: which GPU, why, what would be stopped, the reboot; nothing runs.
    proc, doc = _run(h, tmp_path, "plan", "--check-only", fix="reset,reboot")
    cell = doc["hosts"][h.name]["checks"]["reset"]
    assert cell["outcome"] == "would fix", (cell, proc.stdout[-3000:])
    assert f"{GPU3} owes a reboot (Xid 79: {XID79})" in cell["summary"], cell
    for u in UNITS:
        assert f"systemctl stop -- {u}" in proc.stdout, proc.stdout[-3000:]
    assert "systemctl reboot" in proc.stdout and "nvidia-smi -r" not in proc.stdout
    assert _boot_id(h) == boot and _pids(h) == before
    # what else this node fails (b200-nvl8 runs no nvidia-persistenced), for the last night
    other = {
        k for k, c in doc["hosts"][h.name]["checks"].items() if c["outcome"] not in ("passed", "skipped")
    }
    other -= {"xid", "reset"}

    # --fix=reset alone: a reboot is not a reset; the step fails and says what allows it.
    proc, doc = _run(h, tmp_path, "reset-only", fix="reset")
    cell = doc["hosts"][h.name]["checks"]["reset"]
    assert cell["outcome"] == "failed", cell
    assert (
        "the node owes a reboot, which --fix=reset does not do (--fix=reset,reboot allows it); "
        "node not drained (--fix=drain drains it)"
    ) in proc.stdout, proc.stdout[-3000:]
    assert _boot_id(h) == boot and _pids(h) == before

    # A process outside the inventory's units holds GPU 5: no reboot, nothing stopped.
    holder = h.ssh(
        "setsid python3 -c 'import time; f = open(\"/dev/nvidia5\"); time.sleep(600)' "
        ">/dev/null 2>&1 < /dev/null & echo $!"
    ).stdout.strip()
    try:
        proc, doc = _run(h, tmp_path, "refused", "-o", "health_reboot_timeout=60", fix="reset,reboot")
        cell = doc["hosts"][h.name]["checks"]["reset"]
        assert cell["outcome"] == "failed", cell
        assert f"not rebooted: PID {holder}" in proc.stdout and "/dev/nvidia5" in proc.stdout, proc.stdout[
            -3000:
        ]
        assert _boot_id(h) == boot and _pids(h) == before
    finally:
        h.ssh(["kill", "-9", holder])

    # --fix=reset,reboot: the servers stopped, the node rebooted, the servers active again.
    proc, doc = _run(h, tmp_path, "reboot", "-o", "health_reboot_timeout=60", fix="reset,reboot")
    cell = doc["hosts"][h.name]["checks"]["reset"]
    assert cell["outcome"] == "fixed", (cell, proc.stdout[-4000:])
    assert _boot_id(h) != boot
    after = _pids(h)  # a new boot's PIDs may repeat the old ones: the boot id tells them apart
    assert all("ActiveState=active" in v for v in after.values()), after
    report = (tmp_path / "reboot.html").read_text()  # the sequence, in the evidence
    for u in UNITS:
        assert f"reboot: stopped {u}" in report, u
    assert "reboot: SSH answered with boot id" in report

    # The next night passes, and the history shows the recovery.
    proc, doc = _run(
        h, tmp_path, "next", "--check-only", f"--previous={tmp_path / 'reboot.json'}", fix="reset"
    )
    cells = doc["hosts"][h.name]["checks"]
    failed = {k: c["outcome"] for k, c in cells.items() if c["outcome"] not in ("passed", "skipped")}
    assert set(failed) == other, (failed, proc.stdout[-3000:])
    assert f"reboot seen since Xid 79 on {GPU3}" in cells["xid"]["summary"], cells["xid"]
    assert (h.name, "xid") in {(c["host"], c["check"]) for c in doc["comparison"]["recovered"]}


JOURNAL = "/var/lib/gpuhost/journal/health-reset.json"
SLOW = "/etc/systemd/system/sglang-dp6.service.d/slow-stop.conf"


def _journal(h: Any) -> dict[str, Any]:
    r = h.ssh(["cat", JOURNAL])
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}


def test_a_run_cut_between_the_stops_and_the_reboot_is_completed_by_the_next(
    lab: Any, tmp_path: Path
) -> None:
    """The controller is killed while the last server stops for the reboot (it ignores SIGTERM for
    a few seconds), after six stops: the node is left with its servers stopped and no reboot. The
    next run reads the host's journal and takes the reboot the cut run did not, with those servers
    kept stopped through it, and starts them after the boot (the last one is not enabled: only the
    run starts it)."""
    h = lab.host(_b200_under_systemd(), name=f"hx{os.getpid() % 100000}")  # the first test's host
    slow = "[Service]\nEnvironment=GPULAB_IGNORE_SIGTERM=6\n"  # the stand-in's stuck-shutdown knob
    assert (
        h.ssh(["sh", "-c", f"mkdir -p {os.path.dirname(SLOW)} && cat > {SLOW}"], input=slow).returncode == 0
    )
    try:
        # restarted last, so it is the last holder the reboot path finds and stops; not enabled, so
        # only the run brings it back after the boot
        r = h.ssh(
            "systemctl daemon-reload && systemctl disable sglang-dp6.service && systemctl restart sglang-dp6.service"
        )
        assert r.returncode == 0, r.stderr
        after_boot = max(k.t for k in h.profile.kernel_log) + 1.0
        line = json.dumps({"t": after_boot, "msg": XID79}) + "\n"
        assert h.ssh(["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=line).returncode == 0
        boot = _boot_id(h)

        argv = _argv(h, tmp_path, "cut", "-o", "health_reboot_timeout=60", fix="reset,reboot", service=UNITS)
        ctl = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 120
        stops: list[str] = []
        while time.monotonic() < deadline and ctl.poll() is None:
            stops = [s["unit"] for s in _journal(h).get("steps") or [] if s.get("step") == "stop"]
            if len(stops) == len(UNITS):
                break
            time.sleep(0.2)
        assert stops and stops[-1] == "sglang-dp6.service" and len(stops) == len(UNITS), stops
        os.killpg(ctl.pid, signal.SIGKILL)  # cut: six servers stopped, the seventh stopping, no reboot
        ctl.wait(timeout=30)
        for _ in range(60):  # the seventh exits by itself once its SIGTERM grace is over
            if "ActiveState=inactive" in _main_pid(h, "sglang-dp6.service"):
                break
            time.sleep(0.5)
        assert all("ActiveState=inactive" in v for v in _pids(h).values()), _pids(h)
        assert _boot_id(h) == boot and _journal(h).get("phase") == "stop"
        assert h.ssh(f"rm -f {SLOW} && systemctl daemon-reload").returncode == 0

        proc, doc = _run(h, tmp_path, "after-cut", "-o", "health_reboot_timeout=60", fix="reset,reboot")
        cell = doc["hosts"][h.name]["checks"]["reset"]
        assert cell["outcome"] == "fixed", (cell, proc.stdout[-4000:])
        assert "a cut reset run" in cell["summary"] and "sglang-dp6.service" in cell["summary"], cell
        assert _boot_id(h) != boot
        assert all("ActiveState=active" in v for v in _pids(h).values()), _pids(h)
        assert h.ssh(["test", "-e", JOURNAL]).returncode != 0  # retired
        report = (tmp_path / "after-cut.html").read_text()
        assert "kept so through the reboot, put back after it" in report
    finally:
        h.ssh(f"rm -f {SLOW} && systemctl daemon-reload && systemctl enable sglang-dp6.service")

"""`suites/health --fix=reset` on a health-ok lab host over real SSH: plan, reset, confirm, refuse.

GPU 0000:14:00.0 says it needs a reset (`reset_status.reset_required` Yes, the lab's runtime
fault) while the SGLang service (`sglang-qwen`, tp=4) and nvidia-persistenced hold it. The run
stops both, resets that GPU with the lab's `nvidia-smi -r` (which refuses a held GPU as the real
one does), starts both again and confirms from the GPU's own field. A holder outside any service
of the inventory is never stopped: the GPU is not reset and the holder is named. A reset that
returns 0 but leaves the GPU in error (the lab's `reset_sticks`, cleared only by a reboot) fails
the step under `--fix=reset` and reboots the node under `--fix=reset,reboot` (a `systemctl reboot`
inside the lab host boots it again: gpulab.host.supervise).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.health.test_health_lab_gpus import inject

REPO = Path(__file__).resolve().parents[2]
BUS = "0000:14:00.0"


def _argv(
    h: Any, tmp: Path, name: str, *extra: str, fix: str = "reset", service: Any = "sglang-qwen"
) -> list[str]:
    """suites/health against lab host h with --fix=FIX, its fleet JSON at tmp/NAME.json."""
    known = tmp / "known_hosts"
    known.write_text(Path(h.known_hosts).read_text())
    inv = tmp / "fleet.yaml"
    inv.write_text(
        f"all:\n  vars: {{ansible_user: root, service: {json.dumps(service)}, service_port: 30000}}\n"
        f"  hosts:\n    {h.name}: {{ansible_host: {h.address}}}\n"
    )
    argv = [
        sys.executable, "-m", "pytest", "suites/health", "-p", "no:cacheprovider",
        f"--inventory={inv}", "--ssh-identity=/run/gpulab/id_ed25519", f"--known-hosts={known}",
        "--connect-timeout=5", f"--report-dir={tmp}", f"--report-name={name}", f"--fleet-json={tmp}/{name}.json",
        f"--fix={fix}", "-o", "addopts=", "-o", "health_reset_verify_timeout=3", *extra,
    ]  # fmt: skip
    # health_reset_verify_timeout=3: the lab's signals change at once; 3 s, not 30, keeps the
    # stuck GPU's tests short
    return argv


def _suite(
    h: Any, tmp: Path, name: str, *extra: str, fix: str = "reset"
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    argv = _argv(h, tmp, name, *extra, fix=fix)
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    return proc, json.loads((tmp / f"{name}.json").read_text())["hosts"][h.name]["checks"]


def _reset_required(h: Any) -> str:
    r = h.ssh(["nvidia-smi", "-i", BUS, "--query-gpu=reset_status.reset_required", "--format=csv,noheader"])
    return r.stdout.strip()


def _boot_id(h: Any) -> str:
    return h.ssh(["cat", "/proc/sys/kernel/random/boot_id"]).stdout.strip()


def _main_pid(h: Any, unit: str) -> str:
    return h.ssh(["systemctl", "show", "-p", "MainPID,ActiveState", "--", unit]).stdout


def test_a_gpu_that_owes_a_reset_is_reset_with_its_holders_stopped_and_started(
    lab: Any, tmp_path: Path
) -> None:
    h = lab.host("health-ok", name=f"hr{os.getpid() % 100000}")
    inject(h, {"gpus": {BUS: {"reset_required": True}}})
    try:
        assert _reset_required(h) == "Yes"
        before = _main_pid(h, "sglang-qwen.service")
        proc, cells = _suite(h, tmp_path, "plan", "--check-only")
        reset = cells["reset"]
        assert reset["outcome"] == "would fix", (reset, proc.stdout[-3000:])
        out = proc.stdout
        assert (
            f"nvidia-smi -r -i 0000{BUS}" in out
            or f"nvidia-smi -r -i {BUS}" in out
            or "nvidia-smi -r -i" in out
        )
        assert "systemctl stop -- sglang-qwen.service" in out, out[-3000:]
        assert (
            _main_pid(h, "sglang-qwen.service") == before and _reset_required(h) == "Yes"
        )  # nothing touched

        proc, cells = _suite(h, tmp_path, "fix")
        assert cells["reset"]["outcome"] == "fixed", (cells["reset"], proc.stdout[-4000:])
        assert _reset_required(h) == "No"
        after = _main_pid(h, "sglang-qwen.service")
        assert "ActiveState=active" in after and after != before  # stopped, then started again
        assert "ActiveState=active" in _main_pid(h, "nvidia-persistenced.service")
        report = (tmp_path / "fix.html").read_text()
        assert f"compute check passed on {BUS} (all_reduce_perf -g 1 -c 1, 0 wrong)" in report
    finally:
        inject(h, {})


def test_a_reset_whose_gpu_then_fails_the_compute_check_is_not_counted(lab: Any, tmp_path: Path) -> None:
    h = lab.host("health-ok", name=f"hr{os.getpid() % 100000}")  # the host of the first test
    # the reset clears reset_required; compute_fails outlives it (gpulab_tools/all_reduce_perf.py)
    inject(h, {"gpus": {BUS: {"reset_required": True, "compute_fails": True}}})
    try:
        proc, cells = _suite(h, tmp_path, "compute")
        assert cells["reset"]["outcome"] == "failed", (cells["reset"], proc.stdout[-3000:])
        assert _reset_required(h) == "No"  # the signals cleared: only the compute check tells
        assert "fix did not verify" in proc.stdout, proc.stdout[-3000:]
        assert (
            f"compute check failed (all_reduce_perf -g 1 -c 1): {BUS}: failed (rc 2) on {BUS}" in proc.stdout
        ), proc.stdout[-3000:]
        assert "uncorrectable ECC error encountered" in proc.stdout
        assert "ActiveState=active" in _main_pid(h, "sglang-qwen.service")  # started again all the same
    finally:
        inject(h, {})


def test_a_holder_outside_the_inventorys_services_is_named_and_nothing_is_reset(
    lab: Any, tmp_path: Path
) -> None:
    h = lab.host("health-ok", name=f"hq{os.getpid() % 100000}")
    inject(h, {"gpus": {BUS: {"reset_required": True}}})
    minor = h.ssh(
        ["nvidia-smi", "-i", BUS, "--query-gpu=minor_number", "--format=csv,noheader"]
    ).stdout.strip()
    holder = h.ssh(
        f"setsid python3 -c 'import time; f = open(\"/dev/nvidia{minor}\"); time.sleep(600)' "
        ">/dev/null 2>&1 < /dev/null & echo $!"
    ).stdout.strip()
    try:
        before = _main_pid(h, "sglang-qwen.service")
        proc, cells = _suite(h, tmp_path, "refused")
        reset = cells["reset"]
        assert reset["outcome"] == "failed", reset
        # no logind in the lab: an ssh session's process is in ssh.service, which no inventory names
        assert f"PID {holder}" in proc.stdout and "not an inventory service" in proc.stdout, proc.stdout[
            -3000:
        ]
        assert _reset_required(h) == "Yes"  # not reset
        assert _main_pid(h, "sglang-qwen.service") == before  # the service was not stopped
    finally:
        h.ssh(["kill", "-9", holder])
        inject(h, {})


def test_a_reset_that_returns_0_but_leaves_the_gpu_in_error_is_not_counted(lab: Any, tmp_path: Path) -> None:
    h = lab.host("health-ok", name=f"hs{os.getpid() % 100000}")
    inject(h, {"gpus": {BUS: {"reset_required": True, "reset_sticks": True}}})
    boot = _boot_id(h)
    try:
        proc, cells = _suite(h, tmp_path, "sticks")
        reset = cells["reset"]
        assert reset["outcome"] == "failed", reset
        line = (
            f"reset did not clear GPU {BUS} (reset_status.reset_required is Yes); reboot not allowed "
            "(--fix=reset,reboot allows it); node not drained (--fix=drain drains it)"
        )
        assert "fix did not verify" in proc.stdout and line in proc.stdout, proc.stdout[-3000:]
        assert _reset_required(h) == "Yes"
        assert _boot_id(h) == boot  # never rebooted without --fix=reset,reboot
        assert "ActiveState=active" in _main_pid(h, "sglang-qwen.service")  # started again all the same
    finally:
        inject(h, {})


def test_a_reset_that_leaves_the_gpu_in_error_reboots_the_node_under_fix_reset_reboot(
    lab: Any, tmp_path: Path
) -> None:
    h = lab.host("health-ok", name=f"hs{os.getpid() % 100000}")  # the host of the test above
    inject(h, {"gpus": {BUS: {"reset_required": True, "reset_sticks": True}}})
    # an Xid whose action is a GPU reset, on the same GPU: owed under this boot id until a reboot
    xid = "NVRM: Xid (PCI:0000:14:00): 48, pid=2231, name=python3, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 2, subpartition 0."
    after_boot = max(k.t for k in h.profile.kernel_log) + 1.0
    line = json.dumps({"t": after_boot, "msg": xid}) + "\n"
    assert h.ssh(["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=line).returncode == 0
    boot = _boot_id(h)
    try:
        proc, cells = _suite(h, tmp_path, "plan", "--check-only", fix="reset,reboot")
        assert cells["reset"]["outcome"] == "would fix", cells["reset"]
        assert "reboot the node, only if a GPU still owes a reset" in proc.stdout, proc.stdout[-3000:]
        assert "systemctl reboot" in proc.stdout and _boot_id(h) == boot

        proc, cells = _suite(h, tmp_path, "reboot", "-o", "health_reboot_timeout=60", fix="reset,reboot")
        assert cells["reset"]["outcome"] == "fixed", (cells["reset"], proc.stdout[-4000:])
        assert _boot_id(h) != boot  # rebooted: a new boot id
        assert _reset_required(h) == "No"  # the reboot cleared what the reset did not
        assert "ActiveState=active" in _main_pid(h, "sglang-qwen.service")
        assert "ActiveState=active" in _main_pid(h, "nvidia-persistenced.service")

        proc, cells = _suite(h, tmp_path, "after", "--check-only")  # the node passes every check
        failed = {k: c["outcome"] for k, c in cells.items() if c["outcome"] not in ("passed", "skipped")}
        assert not failed, (failed, proc.stdout[-3000:])
        assert "reboot seen since Xid 48 on 0000:14:00" in cells["xid"]["summary"], cells["xid"]  # paid
    finally:
        inject(h, {})
        h.ssh(["sh", "-c", ": > /var/lib/gpulab/kmsg"])  # the Xid, had the reboot not emptied it


def test_a_run_cut_while_the_gpu_is_reset_is_completed_by_the_next(lab: Any, tmp_path: Path) -> None:
    """The controller is killed while `nvidia-smi -r` runs (the lab's `reset_hangs`), with the
    GPU's units stopped and persistence off; the next run reads the host's journal, starts them
    again, turns persistence back on, resets the GPU and retires the journal."""
    h = lab.host("health-ok", name=f"hr{os.getpid() % 100000}")  # the first test's host
    journal = "/var/lib/gpuhost/journal/health-reset.json"
    inject(h, {"gpus": {BUS: {"reset_required": True, "reset_hangs": 8}}})
    try:
        argv = _argv(h, tmp_path, "cut")
        ctl = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 90
        phase = None
        while time.monotonic() < deadline and ctl.poll() is None:
            r = h.ssh(["cat", journal])
            phase = json.loads(r.stdout).get("phase") if r.returncode == 0 and r.stdout.strip() else None
            if phase == "reset":
                break
            time.sleep(0.3)
        assert phase == "reset", phase
        os.killpg(ctl.pid, signal.SIGKILL)  # the controller, cut in the middle of the reset
        ctl.wait(timeout=30)
        assert "ActiveState=inactive" in _main_pid(h, "sglang-qwen.service")  # left stopped
        for _ in range(60):  # the cut run's own `nvidia-smi -r` ends after its hang
            if h.ssh(["pgrep", "-f", "nvidia-smi -r"]).returncode != 0:
                break
            time.sleep(0.5)
        inject(h, {"gpus": {BUS: {"reset_required": True}}})  # the GPU still owes its reset

        proc, cells = _suite(h, tmp_path, "after-cut")
        reset = cells["reset"]
        assert reset["outcome"] == "fixed", (reset, proc.stdout[-4000:])
        # the checks before it saw the units down and persistence off: the cut run's leftovers
        assert "a cut reset run" in reset["summary"] and "sglang-qwen.service" in reset["summary"], reset
        assert "ActiveState=active" in _main_pid(h, "sglang-qwen.service")
        assert "ActiveState=active" in _main_pid(h, "nvidia-persistenced.service")
        assert _reset_required(h) == "No"
        assert h.ssh(["test", "-e", journal]).returncode != 0  # retired
    finally:
        inject(h, {})

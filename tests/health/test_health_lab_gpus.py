"""suites/health against one lab host per failure mode, over real SSH.

Each host boots a profile (fixtures/profiles/health-*.yaml) that emulates one real failure with
what the driver prints; the suite runs with an inventory that says no more than an operator's
would, and the test reads the fleet JSON: the check's outcome and its reasons.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.modules.health.facts import SOURCE_ENV

REPO = Path(__file__).resolve().parents[2]


def boot(lab: Any, profile: str) -> Any:
    """Boot one lab host of `profile`, named for this test process."""
    return lab.host(profile, name=f"hg{os.getpid() % 100000}-{profile[7:15]}")


def inject(h: Any, faults: dict[str, Any]) -> None:
    """Write the lab host's runtime faults (gpulab_tools.load_faults reads them)."""
    r = h.ssh(["sh", "-c", "cat > /var/lib/gpulab/faults.json"], input=json.dumps(faults))
    assert r.returncode == 0, r.stderr


def run_health(h: Any, tmp: Path, *extra: str, host_vars: str = "", name: str = "night") -> dict[str, Any]:
    """Run suites/health --check-only against lab host `h`, return its fleet JSON cells."""
    summary = run_suite(h, tmp, *extra, host_vars=host_vars, name=name)
    return dict(summary["hosts"][h.name]["checks"])


def run_suite(h: Any, tmp: Path, *extra: str, host_vars: str = "", name: str = "night") -> dict[str, Any]:
    """Run suites/health --check-only against lab host `h`, return the fleet JSON."""
    known = tmp / "known_hosts"
    known.write_text(Path(h.known_hosts).read_text())
    inv = tmp / "fleet.yaml"
    inv.write_text(
        "all:\n"
        f"  vars: {{ansible_user: root{host_vars}}}\n"
        f"  hosts:\n    {h.name}: {{ansible_host: {h.address}}}\n"
    )
    argv = [
        sys.executable, "-m", "pytest", "suites/health", "-p", "no:cacheprovider",
        f"--inventory={inv}", "--ssh-identity=/run/gpulab/id_ed25519", f"--known-hosts={known}",
        "--connect-timeout=5", f"--report-dir={tmp}", f"--report-name={name}", f"--fleet-json={tmp}/{name}.json",
        "--check-only", "-o", "addopts=", *extra,
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150, check=False)
    summary: dict[str, Any] = json.loads((tmp / f"{name}.json").read_text())
    assert h.name in summary["hosts"], proc.stdout + proc.stderr
    host = summary["hosts"][h.name]
    assert host["round_trips"] <= 2, host
    return summary


def test_gpu_missing_from_nvidia_smi_fails_without_an_inventory_count(lab: Any, tmp_path: Path) -> None:
    """The probe failed on one of 4 GPUs: nvidia-smi lists 3, the PCI bus says 4; no gpu_count."""
    cells = run_health(boot(lab, "health-gpu-missing"), tmp_path)
    c = cells["gpu_count"]
    assert c["outcome"] == "failed", c
    assert c["reasons"] == [
        "nvidia-smi sees 3 GPUs, the PCI bus has 4 NVIDIA display controllers not on vfio-pci",
        "0000:24:00.0 is an NVIDIA GPU on the PCI bus, driver none, but nvidia-smi does not list it",
    ]


def test_gpu_that_requires_reset_fails_and_a_renamed_field_is_read_by_its_new_name(
    lab: Any, tmp_path: Path
) -> None:
    """nvidia-smi prints [GPU requires reset] in GPU 2's cells, and knows only clocks_event_reasons."""
    h = boot(lab, "health-ok")
    inject(
        h,
        {
            "unknown_fields": ["clocks_throttle_reasons.active"],
            "gpus": {"0000:23:00.0": {"nvml_error": "GPU requires reset"}},
        },
    )
    try:
        cells = run_health(h, tmp_path)
        c = cells["gpu_count"]
        assert c["outcome"] == "failed", c
        assert c["reasons"][0].startswith(
            "GPU 2 (0000:23:00.0): nvidia-smi prints [GPU requires reset] for "
        ), c
        th = cells["throttle"]
        assert th["outcome"] == "failed", th
        assert th["reasons"] == ["GPU 2 (0000:23:00.0): throttle reasons [GPU requires reset]"]
        assert th["state"]["field"] == "clocks_event_reasons.active"
        assert cells["temperature"]["reasons"] == ["GPU 2 (0000:23:00.0): temperature [GPU requires reset]"]
        # A driver that knows neither name: the check says so instead of passing.
        inject(h, {"unknown_fields": ["clocks_throttle_reasons.active", "clocks_event_reasons.active"]})
        th = run_health(h, tmp_path)["throttle"]
        assert th["outcome"] == "skipped", th
        assert "does not know the field clocks_throttle_reasons.active" in th["summary"], th
    finally:
        inject(h, {})


def test_xid_79_fails_night_after_night_until_the_host_reboots(lab: Any, tmp_path: Path) -> None:
    """Xid 79 (reboot, by NVIDIA's catalogue): fails the night it is logged and the next, passes after a reboot."""
    h = lab.host("health-ok", name=f"hg{os.getpid() % 100000}-xid")
    run_suite(h, tmp_path, name="n1")  # baseline
    msg = "NVRM: Xid (PCI:0000:13:00): 79, pid=2231, name=python3, GPU has fallen off the bus."
    after_boot = max(k.t for k in h.profile.kernel_log) + 1.0
    r = h.ssh(
        ["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=json.dumps({"t": after_boot, "msg": msg}) + "\n"
    )
    assert r.returncode == 0, r.stderr

    n2 = run_suite(h, tmp_path, f"--previous={tmp_path / 'n1.json'}", name="n2")
    x2 = n2["hosts"][h.name]["checks"]["xid"]
    assert (
        x2["outcome"] == "failed"
        and x2["summary"] == "1 Xid error(s) since the last run: code 79 (action: reboot)"
    )
    assert x2["state"]["action"] == "reboot"
    # The next night: no new line, the same boot: still failing, and not "recovered".
    n3 = run_suite(h, tmp_path, f"--previous={tmp_path / 'n2.json'}", name="n3")
    x3 = n3["hosts"][h.name]["checks"]["xid"]
    assert x3["outcome"] == "failed" and x3["summary"] == "1 earlier Xid(s) still owed (action: reboot)", x3
    assert x3["reasons"][0].startswith("Xid 79 on 0000:13:00 still needs a reboot")
    assert not any(c["host"] == h.name for c in n3["comparison"]["recovered"])

    # Reboot: the kernel log starts over, and the boot id is new.
    assert h.ssh(["rm", "-f", "/var/lib/gpulab/kmsg"]).returncode == 0
    before = h.ssh(["cat", "/proc/sys/kernel/random/boot_id"]).stdout
    h.reboot()
    assert h.ssh(["cat", "/proc/sys/kernel/random/boot_id"]).stdout != before  # the lab draws one per boot
    n4 = run_suite(h, tmp_path, f"--previous={tmp_path / 'n3.json'}", name="n4")
    x4 = n4["hosts"][h.name]["checks"]["xid"]
    assert x4["outcome"] == "passed", x4
    assert x4["summary"] == "no Xid errors since the last run; reboot seen since Xid 79 on 0000:13:00"
    assert {(c["host"], c["check"]) for c in n4["comparison"]["recovered"]} >= {(h.name, "xid")}


def test_xid_48_fails_night_after_night_until_the_gpu_is_reset(lab: Any, tmp_path: Path) -> None:
    """Xid 48 (a GPU reset, by NVIDIA's catalogue) on GPU 0: fails two nights, passes after `nvidia-smi -r`.

    The GPU says it needs a reset (reset_status.reset_required Yes, the driver's scratch bit) until
    the lab's nvidia-smi -r clears it, as a real reset does; the boot id never changes here.
    """
    h = lab.host("health-ok", name=f"hg{os.getpid() % 100000}-rst")
    run_suite(h, tmp_path, name="n1")  # baseline
    msg = "NVRM: Xid (PCI:0000:13:00): 48, pid=2231, name=python3, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 2, subpartition 0."
    after_boot = max(k.t for k in h.profile.kernel_log) + 1.0
    r = h.ssh(
        ["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=json.dumps({"t": after_boot, "msg": msg}) + "\n"
    )
    assert r.returncode == 0, r.stderr
    inject(h, {"gpus": {"0000:13:00.0": {"reset_required": 1}}})
    boot_id = h.ssh(["cat", "/proc/sys/kernel/random/boot_id"]).stdout
    try:
        n2 = run_suite(h, tmp_path, f"--previous={tmp_path / 'n1.json'}", name="n2")
        x2 = n2["hosts"][h.name]["checks"]["xid"]
        assert x2["outcome"] == "failed", x2
        assert x2["summary"] == "1 Xid error(s) since the last run: code 48 (action: reset_gpu)", x2
        # The next night: no new line, no reset: still failing, and not "recovered".
        n3 = run_suite(h, tmp_path, f"--previous={tmp_path / 'n2.json'}", name="n3")
        x3 = n3["hosts"][h.name]["checks"]["xid"]
        assert x3["outcome"] == "failed", x3
        assert x3["summary"] == "1 earlier Xid(s) still owed (action: reset_gpu)", x3
        assert x3["reasons"][0].startswith(
            "Xid 48 on 0000:13:00 still needs a GPU reset: no reset of that GPU and no reboot seen since"
        ), x3
        assert not any(c["host"] == h.name for c in n3["comparison"]["recovered"])

        # The reset: refused while SGLang and nvidia-persistenced hold the GPU, as the real tool does.
        r = h.ssh(["nvidia-smi", "-r", "-i", "0000:13:00.0"])
        assert r.returncode == 255 and "GPU 00000000:13:00.0: In use by another client" in r.stdout, r
        script = (
            "systemctl stop sglang-qwen.service nvidia-persistenced.service && "
            "nvidia-smi -r -i 0000:13:00.0; rc=$?; "
            "systemctl start nvidia-persistenced.service sglang-qwen.service; exit $rc"
        )
        r = h.ssh(["sh", "-c", script])
        assert r.returncode == 0 and "GPU 00000000:13:00.0 was successfully reset." in r.stdout, r
        assert h.ssh(["cat", "/proc/sys/kernel/random/boot_id"]).stdout == boot_id  # no reboot

        n4 = run_suite(h, tmp_path, f"--previous={tmp_path / 'n3.json'}", name="n4")
        x4 = n4["hosts"][h.name]["checks"]["xid"]
        assert x4["outcome"] == "passed", x4
        assert (
            x4["summary"] == "no Xid errors since the last run; GPU reset seen since Xid 48 on 0000:13:00"
        ), x4
        assert {(c["host"], c["check"]) for c in n4["comparison"]["recovered"]} >= {(h.name, "xid")}
    finally:
        inject(h, {})


def test_clock_event_time_since_the_last_run_fails_then_passes_when_it_stops_growing(
    lab: Any, tmp_path: Path
) -> None:
    """GPU 1 spends 12.5 s in HW thermal slowdown between two runs: the second fails, the third passes."""
    h = boot(lab, "health-ok")
    inject(h, {})
    try:
        assert run_health(h, tmp_path, name="c1")["clock_events"]["outcome"] == "passed"
        inject(h, {"gpus": {"0000:14:00.0": {"clock_event_us": {"hw_thermal_slowdown": 12_500_000}}}})
        c = run_health(h, tmp_path, name="c2")["clock_events"]
        assert c["outcome"] == "failed", c
        assert c["reasons"] == [
            "GPU 1 (0000:14:00.0): clocks held down 12.5 s since the last run (hw_thermal_slowdown 12.5 s; limit 0 s)"
        ]
        c = run_health(h, tmp_path, name="c3")["clock_events"]  # the same count: nothing since
        assert c["outcome"] == "passed", c
        inject(h, {})  # the driver reloaded: every counter starts again at 0 (a new baseline)
        c = run_health(h, tmp_path, name="c4")["clock_events"]
        assert (
            c["outcome"] == "passed" and "counters restarted (new baseline) on 0000:14:00.0" in c["summary"]
        ), c
    finally:
        inject(h, {})


def test_ecc_disabled_on_an_rtx_pro_6000_fails(lab: Any, tmp_path: Path) -> None:
    """GPU 2 runs with ECC off (its counters print [N/A]): the ecc check fails it, it used to skip."""
    h = boot(lab, "health-ok")
    inject(h, {"gpus": {"0000:23:00.0": {"ecc_mode": "Disabled"}}})
    try:
        c = run_health(h, tmp_path)["ecc"]
    finally:
        inject(h, {})
    assert c["outcome"] == "failed", c
    assert c["reasons"] == [
        "GPU 2 (0000:23:00.0): ECC disabled on NVIDIA RTX PRO 6000 Blackwell Server Edition, which supports it "
        "(nvidia-smi -e 1, then a GPU reset or reboot)"
    ]


def test_b200_hbm_above_its_own_limit_fails(lab: Any, tmp_path: Path) -> None:
    """B200 GPU 4's memory at 97 C, its Memory Max Operating Temp 95 C (from nvidia-smi -q)."""
    h = boot(lab, "b200-nvl8")
    inject(h, {})
    try:
        c = run_health(h, tmp_path)["memory_temperature"]
        assert c["outcome"] == "passed", c
        inject(h, {"gpus": {"0000:9d:00.0": {"temperature_memory": 97}}})
        c = run_health(h, tmp_path)["memory_temperature"]
    finally:
        inject(h, {})
    assert c["outcome"] == "failed", c
    assert c["reasons"] == ["GPU 4 (0000:9d:00.0): memory 97 C > 95 C (the GPU's Memory Max Operating Temp)"]


def test_a_missing_model_mount_and_a_read_only_remount_fail(lab: Any, tmp_path: Path) -> None:
    """The inventory names /models: missing (the root file system would be measured), then mounted, then remounted ro."""
    h = boot(lab, "health-ok")
    inv = ", mounts: [/models], data_paths: [/, /models]"
    try:
        cells = run_health(h, tmp_path, host_vars=inv, name="m1")
        assert cells["mounts"]["outcome"] == "failed", cells["mounts"]
        assert cells["mounts"]["reasons"] == [
            "/models: not mounted (the path is on /'s file system; its free space would be /'s)"
        ]
        assert cells["disk_free"]["reasons"] == [
            "/models: not mounted; free space not measured (it would be /'s)"
        ]
        r = h.ssh(["sh", "-c", "mkdir -p /models && mount -t tmpfs -o size=64m gl-models /models"])
        assert r.returncode == 0, r.stderr
        cells = run_health(h, tmp_path, host_vars=inv, name="m2")
        assert cells["mounts"]["outcome"] == "passed", cells["mounts"]
        assert cells["disk_free"]["outcome"] == "passed", cells["disk_free"]
        assert h.ssh(["mount", "-o", "remount,ro", "/models"]).returncode == 0
        cells = run_health(h, tmp_path, host_vars=inv, name="m3")
        assert cells["mounts"]["outcome"] == "failed", cells["mounts"]
        assert cells["mounts"]["reasons"] == [
            "/models: mounted read-only (tmpfs gl-models)",
            "/models: on a read-only mount (/models, tmpfs)",
        ]
    finally:
        h.ssh(["sh", "-c", "umount /models 2>/dev/null; rmdir /models 2>/dev/null; true"])


def test_pcie_aer_errors_since_the_last_run_fail_once(lab: Any, tmp_path: Path) -> None:
    """GPU 3's link logs a non-fatal AER error between two runs (sysfs aer_dev_nonfatal): the second run fails."""
    h = boot(lab, "health-ok")
    inject(h, {})
    try:
        r = h.ssh(["cat", "/sys/bus/pci/devices/0000:24:00.0/aer_dev_nonfatal"])
        assert r.returncode == 0 and r.stdout.endswith("TOTAL_ERR_NONFATAL 0\n"), r
        assert run_health(h, tmp_path, name="a1")["pcie_aer"]["outcome"] == "passed"
        inject(h, {"gpus": {"0000:24:00.0": {"aer": {"nonfatal": 1, "correctable": 3}}}})
        c = run_health(h, tmp_path, name="a2")["pcie_aer"]
        assert c["outcome"] == "failed", c
        assert c["reasons"] == [
            "0000:24:00.0: PCIe AER 1 nonfatal error(s) since the last run (limits: fatal 0, non-fatal 0, correctable 100)"
        ]
        c = run_health(h, tmp_path, name="a3")["pcie_aer"]  # nothing new since
        assert c["outcome"] == "passed", c
    finally:
        inject(h, {})


def test_opt_in_nvbandwidth_fails_gpus_whose_host_copies_are_slow(lab: Any, tmp_path: Path) -> None:
    """GPU 2 at x8 and GPU 3 at Gen4: their host<->device copies (lab nvbandwidth) fall under 48 GB/s.

    dcgmi is not installed on the lab host: said in the summary of what ran, not a failure; the
    diagnostics run in the same facts request (round trips still <= 2, run_suite asserts it).
    """
    h = boot(lab, "health-pcie-degraded")
    inv = ", diag: [nvbandwidth, dcgm], h2d_bandwidth_min_gbps: 48"
    c = run_health(h, tmp_path, host_vars=inv)["diag"]
    assert c["outcome"] == "failed", c
    got = [r.split(" GB/s")[0].rsplit(" ", 1)[0] for r in c["reasons"]]
    assert got == [
        "GPU 2 (0000:23:00.0): host_to_device_memcpy_ce",
        "GPU 3 (0000:24:00.0): host_to_device_memcpy_ce",
        "GPU 2 (0000:23:00.0): device_to_host_memcpy_ce",
        "GPU 3 (0000:24:00.0): device_to_host_memcpy_ce",
    ], c["reasons"]
    assert c["state"]["missing"] == ["dcgmi is not installed on this host"]
    # Not asked for: skipped, nothing run.
    c = run_health(h, tmp_path)["diag"]
    assert c["outcome"] == "skipped" and "opt-in" in c["summary"], c


def test_infiniband_port_down_since_the_last_run_fails(lab: Any, tmp_path: Path) -> None:
    """Two NDR ports and an uncabled Ethernet port (gpulab.kernel.infiniband): mlx5_1/1 drops between runs."""
    from gpulab.kernel import infiniband as ib

    h = lab.host("health-ok", name=f"hg{os.getpid() % 100000}-ib")
    ports = {
        "mlx5_0/1": {},
        "mlx5_1/1": {},
        "mlx5_2/1": {
            "state": "1: DOWN",
            "phys_state": "3: Disabled",
            "link_layer": "Ethernet",
            "rate": "10 Gb/sec (1X QDR)",
        },
    }
    ib.install(h, ports)
    try:
        c = run_health(h, tmp_path, name="i0")["infiniband"]  # the lab host has no nvidia_peermem
        assert c["outcome"] == "failed" and c["reasons"] == [
            "nvidia_peermem is not loaded: no GPUDirect RDMA over these ports (modprobe nvidia_peermem)"
        ], c
        inv = ", ib_peermem_required: false"
        c = run_health(h, tmp_path, host_vars=inv, name="i1")["infiniband"]
        assert c["outcome"] == "passed", c
        assert (
            c["summary"]
            == "2 RDMA port(s) active: mlx5_0/1 400 Gb/sec (4X NDR), mlx5_1/1 400 Gb/sec (4X NDR)"
        )
        ib.set_port(h, "mlx5_1/1", up=False)
        c = run_health(h, tmp_path, host_vars=inv, name="i2")["infiniband"]
        assert c["outcome"] == "failed", c
        assert c["reasons"] == [
            "mlx5_1/1: DOWN / Polling (ACTIVE at the last run)",
            "mlx5_1/1: link went down 1 time(s) since the last run (counters/link_downed)",
        ]
        ib.set_port(h, "mlx5_1/1", up=True, rate="200 Gb/sec (4X HDR)")  # back, but trained lower
        c = run_health(h, tmp_path, host_vars=inv, name="i3")["infiniband"]
        assert c["outcome"] == "failed" and c["reasons"] == [
            "mlx5_1/1: rate 200 Gb/sec (4X HDR) < 400 Gb/sec (its rate at the last run)"
        ], c
    finally:
        ib.remove(h)


def test_row_remap_pending_fails_the_gpu(lab: Any, tmp_path: Path) -> None:
    """nvidia-smi --query-remapped-rows says GPU 1 has a remap pending: remapped_rows fails it."""
    h = boot(lab, "health-ok")
    inject(h, {"gpus": {"0000:14:00.0": {"remapped_rows_pending": 1, "remapped_rows_uncorrectable": 1}}})
    try:
        c = run_health(h, tmp_path)["remapped_rows"]
    finally:
        inject(h, {})
    assert c["outcome"] == "failed", c
    assert c["reasons"] == ["GPU 1 (0000:14:00.0): row remap pending (a GPU reset applies it)"]


@pytest.mark.parametrize(("source", "seen"), [("nvidia-smi", "no link lines"), ("auto", "18 link lines")])
def test_b200_gpu_with_all_nvlinks_down_fails(
    lab: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, seen: str
) -> None:
    """B200 (18 NVLinks per GPU): GPU 3's links all down, GPU 5 has two links <inactive>.

    nvidia-smi prints no link lines for GPU 3; NVML (auto) still counts its 18 links, each
    inactive: the same verdict either way, from the model's link count."""
    monkeypatch.setenv(SOURCE_ENV, source)
    h = boot(lab, "b200-nvl8")
    inject(h, {"gpus": {"0000:61:00.0": {"nvlinks_down": "all"}, "0000:c3:00.0": {"nvlinks_down": [4, 9]}}})
    try:
        c = run_health(h, tmp_path)["nvlink"]
    finally:
        inject(h, {})
    assert c["outcome"] == "failed", c
    assert c["reasons"] == [
        f"GPU 3 (0000:61:00.0): 0 of 18 NVLinks active ({seen})",
        "GPU 5 (0000:c3:00.0): 16 of 18 NVLinks active (18 link lines)",
    ]


FM_UNIT = """[Unit]
Description=FabricManager service (lab stand-in: the real one trains the NVSwitch fabric)

[Service]
ExecStart=/bin/sleep infinity

[Install]
WantedBy=multi-user.target
"""


def test_b200_fabric_in_progress_or_fabric_manager_down_fails(lab: Any, tmp_path: Path) -> None:
    """nvidia-smi -q: GPU 2's fabric still "In Progress"; then nvidia-fabricmanager stopped."""
    h = boot(lab, "b200-nvl8")
    r = h.ssh(["sh", "-c", "cat > /etc/systemd/system/nvidia-fabricmanager.service"], input=FM_UNIT)
    assert r.returncode == 0, r.stderr
    r = h.ssh(["sh", "-c", "systemctl daemon-reload && systemctl start nvidia-fabricmanager.service"])
    assert r.returncode == 0, r.stderr
    try:
        c = run_health(h, tmp_path)["fabric"]
        assert c["outcome"] == "passed", c
        assert c["summary"] == "fabric trained on 8 GPUs; nvidia-fabricmanager.service active"
        inject(h, {"gpus": {"0000:52:00.0": {"fabric_state": "In Progress", "fabric_status": "N/A"}}})
        assert h.ssh(["systemctl", "stop", "nvidia-fabricmanager.service"]).returncode == 0
        c = run_health(h, tmp_path)["fabric"]
        assert c["outcome"] == "failed", c
        assert c["reasons"] == [
            "GPU 2 (0000:52:00.0): fabric state In Progress (not trained: CUDA fails until it is)",
            "nvidia-fabricmanager.service: inactive (dead)",
        ]
    finally:
        inject(h, {})
        h.ssh(
            [
                "sh",
                "-c",
                "systemctl stop nvidia-fabricmanager.service; rm -f /etc/systemd/system/nvidia-fabricmanager.service; systemctl daemon-reload",
            ]
        )


def test_a_gpu_left_in_mig_mode_fails(lab: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU 1 left in MIG mode, GPU 2 with MIG pending for its next reset: the same two reasons
    through nvidia-smi's mig.mode.current/pending and through NVML's nvmlDeviceGetMigMode."""
    h = boot(lab, "health-ok")
    inject(
        h,
        {"gpus": {"0000:14:00.0": {"mig_mode": "Enabled"}, "0000:23:00.0": {"mig_mode_pending": "Enabled"}}},
    )
    try:
        got = {}
        for source in ("nvidia-smi", "auto"):
            monkeypatch.setenv(SOURCE_ENV, source)
            got[source] = run_health(h, tmp_path, name=f"mig-{source}")["mig_mode"]
    finally:
        inject(h, {})
    for source, c in got.items():
        assert c["outcome"] == "failed", (source, c)
        assert c["reasons"] == [
            "GPU 1 (0000:14:00.0): MIG mode Enabled, the inventory expects Disabled "
            "(nvidia-smi -i 1 -mig 0, then a GPU reset)",
            "GPU 2 (0000:23:00.0): MIG mode Enabled pending: the next GPU reset applies it "
            "(nvidia-smi -i 2 -mig 0 undoes it)",
        ], source
    monkeypatch.delenv(SOURCE_ENV)
    assert run_health(h, tmp_path, name="mig-ok")["mig_mode"]["outcome"] == "passed"

"""Fault injection on lab hosts: link cut, sshd killed, frozen host, full disk, reboot, leftovers."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from gpulab.host.cgroups import CGROUP_ROOT, cgroup_tree
from gpulab.host.lab import RUN, Lab, LabError
from gpulab.host.netns import lab_netns_names, netem_available

PROFILE = "proxmox-rtx6000"

MARKER_UNIT = """\
[Unit]
Description=lab test: prove enabled units run at boot

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'cat /proc/sys/kernel/random/boot_id >/dev/null; date +%%s.%%N >> /root/boot-marker'

[Install]
WantedBy=multi-user.target
"""


@pytest.fixture(scope="module")
def host(lab):
    h = lab.host(PROFILE, pristine=True)
    yield h
    # Leave the shared host usable for later modules whatever a failed test left behind.
    for undo in (h.thaw, h.heal_link):
        try:
            undo()
        except Exception:
            pass


def _ssh_fails(host, timeout: float = 4) -> bool:
    try:
        return host.ssh("true", timeout=timeout).returncode == 255
    except subprocess.TimeoutExpired:
        return True


def test_cut_and_heal_link(host):
    host.cut_link()
    try:
        assert _ssh_fails(host)
        # The cut drops packets at the veth; nothing to the lab range may follow the default route.
        route = subprocess.run(["ip", "route", "get", host.address], capture_output=True, text=True).stdout
        assert f"dev gl{host.index}-r" in route
        assert host.ssh("echo inside", via="nsenter").stdout == "inside\n"  # the host itself runs on
    finally:
        host.heal_link()
    assert host.ssh("echo back").stdout == "back\n"


@pytest.mark.skipif(netem_available(), reason="this kernel has netem")
def test_loss_without_netem_is_a_clear_error(host):
    with pytest.raises(LabError, match="no netem qdisc"):
        host.set_netem(loss_pct=5)


def test_delay_slows_the_ssh_port(lab):
    # netem where the kernel has it, else the lab's user-space delay in front of sshd.
    h = lab.host(PROFILE, name=f"delay-{os.getpid()}", delay_ms=100)
    t0 = time.monotonic()
    with socket.create_connection((h.address, 22), timeout=10) as s:
        s.settimeout(10)
        assert s.recv(64).startswith(b"SSH-")
    assert time.monotonic() - t0 >= 0.19  # at least one round trip of 2 x 100 ms
    assert h.ssh("hostname").stdout == "pve-gpu01\n"
    h.down()


def test_kill_sshd_refuses_new_connections(host):
    host.kill_sshd()
    try:
        p = host.ssh("true")
        assert p.returncode == 255 and "refused" in p.stderr
        assert host.ssh("systemctl is-active ssh", via="nsenter").stdout.strip() in ("inactive", "failed")
    finally:
        host.start_sshd()
    assert host.ssh("echo back").returncode == 0


def test_freeze_and_thaw(host):
    host.freeze()
    try:
        t0 = time.monotonic()
        assert _ssh_fails(host, timeout=3)
        assert time.monotonic() - t0 >= 2.5
    finally:
        host.thaw()
    assert host.ssh("echo thawed").stdout == "thawed\n"


def test_fill_disk(host):
    host.fill_disk()
    try:
        p = host.ssh("echo data > /root/more; df --output=avail / | tail -1")
        assert "No space left on device" in p.stderr
    finally:
        host.free_disk()
    assert host.ssh("echo data > /root/more").returncode == 0


def test_reboot_keeps_installed_units_and_resets_sysfs(host):
    setup = (
        "cat > /etc/systemd/system/lab-marker.service && systemctl enable --quiet lab-marker.service"
        " && echo 0000:17:00.1 > /sys/bus/pci/drivers/snd_hda_intel/unbind"
        " && test ! -e /sys/bus/pci/devices/0000:17:00.1/driver"
    )
    p = host.ssh(setup, input=MARKER_UNIT)
    assert p.returncode == 0, p.stderr
    before = host.ssh("cat /root/boot-marker 2>/dev/null | wc -l").stdout.strip()
    secs = host.reboot()
    assert secs < 15
    p = host.ssh(
        "systemctl is-active lab-marker; wc -l < /root/boot-marker; readlink /sys/bus/pci/devices/0000:17:00.1/driver"
    )
    state, runs, driver = p.stdout.split()
    assert state == "active"
    assert int(runs) == int(before) + 1  # it ran at this boot
    assert driver.endswith("drivers/snd_hda_intel")  # sysfs is back to the profile's boot state
    assert host.ssh("pct exec 101 -- systemctl is-system-running").stdout.strip() in ("running", "degraded")
    # The container's enabled unit is back; the editor someone had left open (started by hand) is not.
    assert host.ssh("pct exec 101 -- systemctl is-active sglang-qwen").stdout.strip() in (
        "active",
        "activating",
    )
    assert host.ssh("pct exec 101 -- pgrep -x vim").returncode == 1


def test_reset_gives_a_pristine_host(host):
    host.ssh("touch /root/leftover")
    host.reset()
    p = host.ssh("test -e /root/leftover; echo $?; systemctl is-enabled lab-marker 2>&1")
    assert p.stdout.splitlines()[0] == "1"
    assert "enabled" not in p.stdout.splitlines()[1]
    assert host.record() == []


def test_down_all_removes_leftovers_of_a_crashed_run(lab):
    name = f"crash-{os.getpid()}"
    h = Lab().up(PROFILE, name=name)
    pids = {f.name: int(f.read_text()) for f in (h.dir / "pids").iterdir()}
    # A crashed run: the host is up (and frozen), the process that made it is gone, its meta is lost.
    h.freeze()
    (h.dir / "meta.json").unlink()
    assert name not in Lab().names()
    removed = Lab().down_all(match=name)
    assert removed
    assert not [ns for ns in lab_netns_names() if ns.startswith(f"gl-{name}")]
    assert name not in Path("/proc/mounts").read_text()
    assert not (RUN / name).exists()
    for what, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], (
            what
        )
    assert not list(CGROUP_ROOT.glob(f"*/gpulab/{name}"))


def test_a_cgroup_removed_while_its_tree_is_listed_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host's reset lists its cgroups while commands end and their cgroups go: one that goes
    between being seen and being listed is skipped (Path.rglob raised FileNotFoundError there)."""
    for rel in ("a/lab-exec/x", "a/b"):
        (tmp_path / rel).mkdir(parents=True)
    real = os.scandir

    def vanishing(path: object = ".") -> object:
        if str(path).endswith("lab-exec"):
            (tmp_path / "a/lab-exec/x").rmdir()
            (tmp_path / "a/lab-exec").rmdir()
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", vanishing)
    got = cgroup_tree(tmp_path / "a")
    assert tmp_path / "a" in got and tmp_path / "a/b" in got
    assert cgroup_tree(tmp_path / "gone") == []

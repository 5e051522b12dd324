"""Lab hosts boot with a real systemd and sshd; containers answer through pct exec and their own sshd."""

from __future__ import annotations

import subprocess

import pytest

PROFILE = "proxmox-rtx6000"


@pytest.fixture(scope="module")
def host(lab):
    h = lab.host(PROFILE, pristine=True)
    return h


def test_host_answers_ssh_with_its_hostname(host):
    p = host.ssh("hostname; systemctl is-system-running")
    assert p.returncode in (0, 1), p.stderr
    name, state = p.stdout.split()
    assert name == "pve-gpu01"
    assert state in ("running", "degraded")
    assert host.address.startswith("198.18.")


def test_host_booted_within_target(host):
    # README quotes these numbers; the target is a host up in under 10 s.
    assert host.meta["boot_timings"][host.name] < 10


def test_strict_host_key_checking(host, tmp_path):
    bad = tmp_path / "known_hosts"
    bad.write_text(host.known_hosts.read_text().replace(host.address, "198.18.250.250"))
    argv = host.ssh_argv()
    argv[argv.index(f"UserKnownHostsFile={host.known_hosts}")] = f"UserKnownHostsFile={bad}"
    p = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=20)
    assert p.returncode == 255
    assert "Host key verification failed" in p.stderr


def test_machine_units_do_not_start_in_the_host(host):
    p = host.ssh("systemctl is-active postgresql.service avahi-daemon.service cron.service; true")
    assert "active\n" not in p.stdout.replace("inactive\n", "")
    failed = host.ssh("systemctl --failed --no-legend --plain").stdout
    assert "udev" not in failed and "sysctl" not in failed


def test_gpu_device_files_and_fuse_sysfs(host):
    p = host.ssh("ls /dev | grep nvidia | sort; readlink /sys/bus/pci/devices/0000:17:00.0/driver")
    lines = p.stdout.split()
    assert {"nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"} <= set(lines)
    assert "nvidia4" not in lines  # GPUs 4-7 are on vfio-pci from boot
    assert lines[-1].endswith("drivers/nvidia")


def test_container_through_pct_exec(host):
    p = host.ssh("pct exec 101 -- hostname; pct status 101; pct list")
    assert p.stdout.splitlines()[0] == "sglang-ct"
    assert "status: running" in p.stdout
    assert "sglang-ct" in p.stdout.splitlines()[-1]
    assert host.ssh("pct exec 101 -- sh -c 'exit 7'").returncode == 7
    assert host.ssh("pct exec 101 -- cat", input="piped through\n").stdout == "piped through\n"
    assert host.ssh("lxc-attach -n sglang-ct -- hostname").stdout == "sglang-ct\n"


def test_container_has_own_sshd_and_systemd(host):
    p = host.ssh("hostname; systemctl is-system-running; ip -4 -o addr show eth0", cid=101)
    assert p.stdout.splitlines()[0] == "sglang-ct"
    assert host.container_address(101) in p.stdout


def test_container_shares_the_hosts_gpu_files(host):
    on_host = host.ssh("stat -c %i /dev/nvidia0 /dev/nvidia3").stdout
    in_ct = host.ssh("pct exec 101 -- stat -c %i /dev/nvidia0 /dev/nvidia3").stdout
    assert on_host == in_ct and len(on_host.split()) == 2


def test_pytest_args_point_at_host_and_container(host):
    args = host.pytest_args()
    assert f"--host=ssh://root@{host.address}" in args
    assert "--container=pct:101" in args
    assert any(a.startswith("--known-hosts=") for a in args)


def test_kernel_release_and_cmdline_come_from_the_profile(host):
    p = host.ssh(
        "uname -r; cat /proc/sys/kernel/osrelease /proc/cmdline; echo x > /proc/sys/kernel/osrelease"
    )
    release, osrelease, cmdline = p.stdout.splitlines()
    assert release == osrelease == host.profile.kernel == "6.8.12-4-pve"
    assert cmdline == host.profile.cmdline and "intel_iommu=on" in cmdline
    assert "Read-only file system" in p.stderr  # /proc/sys is read-only, as in a real container


def test_b200_servers_started_by_hand_not_by_systemd(lab):
    h = lab.host("b200-nvl8", pristine=True)
    p = h.ssh(
        "pgrep -f '^python3 -m sglang.launch_server' | while read p; do echo $p $(ps -o ppid= -p $p) $(cut -d: -f3 /proc/$p/cgroup | grep -c system.slice); done"
    )
    rows = [line.split() for line in p.stdout.splitlines()]
    assert len(rows) == 7
    assert all(ppid == "1" and in_unit == "0" for _, ppid, in_unit in rows)  # no unit owns them
    p = h.ssh(
        "test -f /data/PROGRESS.md && ps -eo args | grep -cx 'vim /data/sglang_notes.md'; systemctl list-units --all 'sglang*' --no-legend | wc -l"
    )
    assert p.stdout.split() == ["1", "0"]


def test_cgroup_paths_look_like_a_proxmox_host(host):
    # Each machine has its own cgroup namespace: the host sees the container's units under
    # /lxc/101/ as on real Proxmox, and nothing of the lab's own layout.
    p = host.ssh(
        "grep '^0::' /proc/self/cgroup; grep '^0::' /proc/$(pgrep -f '^python3 -m sglang.launch_server')/cgroup"
    )
    own, sglang = p.stdout.split()
    assert own == "0::/system.slice/ssh.service"
    assert sglang == "0::/lxc/101/system.slice/sglang-qwen.service"

"""suites/p2p's boot unit on the lab's proxmox-rtx6000 host, under the host's real systemd.

Two reboots after a repair. Stand-ins for Proxmox's pve-ha-lrm.service and pve-guests.service
(their [Install] and ordering lines as upstream ships them: pve-ha-manager
debian/pve-ha-lrm.service, pve-manager services/pve-guests.service) record the IOMMU groups and
drivers they see when systemd starts them: both must see the repaired state, because HA-managed
guests are started by pve-ha-lrm, not pve-guests. Then a kernel-side holder (nvidia_uvm, as
github.com/NVIDIA/open-gpu-kernel-modules/issues/1119 and /1374 describe; the lab's ``ctl/kernel_holders``) set by a unit before ours
makes one nvidia unbind block in the kernel: the script stops there, and its EXIT trap must bind
the GPUs it already unbound (the script before the trap exited with them driverless).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.modules import p2p_boot as persist
from tests.p2p.test_p2p_suite import GROUPS, NVIDIA, VFIO_GROUPS, assert_repaired, host_state, run_suite, sh

# What a stand-in writes to /root/seen-NAME when systemd starts it: groups and drivers at that moment.
_SEEN = (
    "for g in 30 31 32 33; do echo group $g $(cat /sys/kernel/iommu_groups/$g/type); done; "
    "for b in 0000:17:00.0 0000:18:00.0 0000:3a:00.0 0000:3b:00.0; do "
    "echo drv $b $(basename $(readlink /sys/bus/pci/devices/$b/driver 2>/dev/null) 2>/dev/null); done"
)

# Upstream ordering lines (the units the lab does not have are ignored by systemd, as on a host without them).
STANDINS = {
    "pve-ha-lrm.service": (
        "Wants=pve-cluster.service watchdog-mux.service pvedaemon.service pve-ha-crm.service lxc.service\n"
        "After=corosync.service lxc.service pve-cluster.service pve-ha-crm.service pve-storage.target "
        "pvedaemon.service pveproxy.service ssh.service syslog.service watchdog-mux.service\n"
    ),
    "pve-guests.service": (
        "Wants=pvestatd.service pveproxy.service spiceproxy.service pve-firewall.service lxc.service\n"
        "After=pveproxy.service pvestatd.service spiceproxy.service pve-firewall.service lxc.service "
        "pve-ha-crm.service pve-ha-lrm.service\n"
    ),
}

# A kernel-side holder before our unit runs: nvidia_uvm holds GPU 1 with no open file, so its nvidia
# unbind waits in nv_pci_remove() (kernel-open/nvidia/nv-pci.c) until the holder lets go.
KHOLDER_UNIT = """[Unit]
Description=lab: nvidia_uvm holds GPU 0000:18:00.0 from the kernel side (open-gpu-kernel-modules/issues/1119 and /1374)
DefaultDependencies=no
Before=gpuhost-iommu-identity.service
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'echo nvidia_uvm > /var/lib/gpulab/ctl/kernel_holders/0000:18:00.0'
[Install]
WantedBy=multi-user.target
"""


@pytest.fixture(scope="module")
def host(lab: Any) -> Any:
    """The proxmox-rtx6000 lab host, booted once for this module."""
    return lab.host("proxmox-rtx6000")


def _unit(name: str, ordering: str) -> str:
    return (
        f"[Unit]\nDescription=lab stand-in for Proxmox's {name}\n{ordering}"
        "[Service]\nType=oneshot\nRemainAfterExit=yes\n"
        f"ExecStart=/bin/sh -c '( {_SEEN} ) > /root/seen-{name}'\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )


def _install(host: Any, name: str, text: str) -> None:
    r = host.ssh(
        f"cat > /etc/systemd/system/{name} && systemctl daemon-reload && systemctl enable {name}", input=text
    )
    assert r.returncode == 0, r.stderr


def _seen(host: Any, name: str) -> dict[str, dict[str, str | None]]:
    out: dict[str, dict[str, str | None]] = {"group": {}, "drv": {}}
    for line in sh(host, f"cat /root/seen-{name}").splitlines():
        parts = line.split()
        out[parts[0]][parts[1]] = parts[2] if len(parts) > 2 else None
    return out


def test_boot_unit_orders_before_every_gpu_user_and_always_rebinds(host: Any, tmp_path: Path) -> None:
    host.reset()
    first = run_suite(host, tmp_path)
    assert first.rc == 0, first.output[-3000:]
    assert_repaired(host)
    for name, ordering in STANDINS.items():
        _install(host, name, _unit(name, ordering))

    # 1. A clean reboot: the unit runs after coldplug and before nvidia-persistenced, pve-ha-lrm and
    #    pve-guests, as systemd itself reports and as the stand-ins saw.
    host.reboot()
    props = sh(host, f"systemctl show -p After -p Before -p WantedBy -p ActiveState {persist.UNIT_NAME}")
    before = next(line for line in props.splitlines() if line.startswith("Before="))
    after = next(line for line in props.splitlines() if line.startswith("After="))
    for unit in ("nvidia-persistenced.service", "pve-ha-lrm.service", "pve-guests.service", "lxc.service"):
        assert unit in before.split("=", 1)[1].split(), props
    for unit in ("systemd-udev-trigger.service", "systemd-modules-load.service", "basic.target"):
        assert unit in after.split("=", 1)[1].split(), props
    assert "WantedBy=multi-user.target" in props and "ActiveState=active" in props, props
    for name in STANDINS:
        seen = _seen(host, name)
        assert [seen["group"][str(g)] for g in GROUPS] == ["identity"] * 4, (name, seen)
        assert [seen["drv"][b] for b in NVIDIA] == ["nvidia"] * 4, (name, seen)
    st = host_state(host)
    assert [st["groups"][g] for g in VFIO_GROUPS] == ["DMA-FQ"] * 4, st

    # 2. A reboot where GPU 1's unbind blocks in the kernel: the script stops at group 31 after 10 s,
    #    and the trap binds group 30's functions again (and the held GPU keeps its driver for now).
    _install(host, "lab-kholder.service", KHOLDER_UNIT)
    try:
        host.reboot()
        st = host_state(host)
        assert st["groups"][30] == "identity", st["groups"]
        assert st["drivers"]["0000:17:00.0"] == "nvidia", st["drivers"]  # the old script left it without one
        assert st["drivers"]["0000:17:00.1"] == "snd_hda_intel", st["drivers"]
        assert st["drivers"]["0000:18:00.1"] == "snd_hda_intel", st["drivers"]  # never unbound
        assert [st["groups"][g] for g in (32, 33)] == ["DMA-FQ"] * 2, st["groups"]  # stopped at 31
        assert [st["drivers"][b] for b in NVIDIA[2:]] == ["nvidia"] * 2, st["drivers"]
        log = sh(host, f"journalctl -b -u {persist.UNIT_NAME} --no-pager -o cat")
        assert "unbind 0000:18:00.0 from nvidia blocked for 10 s" in log, log
        assert sh(host, f"systemctl is-active {persist.UNIT_NAME}") == "failed"
        for name in STANDINS:  # ordered after the unit even when it fails
            assert _seen(host, name)["drv"]["0000:17:00.0"] == "nvidia", name
    finally:
        host.reset()

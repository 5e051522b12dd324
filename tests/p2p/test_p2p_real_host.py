"""suites/p2p on the lab's AMD EPYC SEV-SNP machine (the suite side), over real SSH.

The AMD profile (`proxmox-epyc-snp`, docs/LAB-SOURCES.md) refuses or breaks identity domains per
kernel series. The suite must refuse before it stops the service or writes anything, and, when a
type write is refused anyway (its facts did not show SNP), roll back and restore the service.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.p2p.test_p2p_suite import NVIDIA, host_state, run_suite, sh

AMD = "proxmox-epyc-snp"
GROUPS = [30, 31, 32, 33]
# the seed's module parameters without nvidia-drm's KMS (which holds the GPUs on driver 570)
NO_MODESET = {
    "nvidia_drm": {"modeset": False, "fbdev": False},
    "nvidia": {"NVreg_EnableGpuFirmware": 1},
    "kvm_amd": {"sev": True, "sev_es": True, "sev_snp": True},
}


def _touched(run: Any) -> list[dict[str, Any]]:
    """Record lines that change the host: sysfs writes (type, unbind, bind) and signals."""
    return [r for r in run.record if r.get("kind", "sysfs") in ("sysfs", "signal")]


@pytest.fixture(scope="module")
def snp(lab: Any) -> Any:
    """The AMD SEV-SNP host at its default kernel (6.14: the write would be accepted, then DMA fails)."""
    return lab.host(AMD)


@pytest.mark.parametrize("check_only", [False, True], ids=["real", "check-only"])
def test_snp_host_is_refused_before_anything_changes(snp: Any, tmp_path: Path, check_only: bool) -> None:
    """`pytest suites/p2p` exits non-zero naming SEV-SNP and the real options; no write, unbind or signal."""
    snp.reset()
    run = run_suite(snp, tmp_path, *(["--check-only"] if check_only else []))
    assert run.rc != 0
    assert run.outcomes["test_plan"] == "failed", run.outcomes
    out = run.output
    assert "SEV-SNP is enabled on this host's AMD IOMMU" in out, out[-3000:]
    assert "AMD-Vi: IOMMU SNP support enabled" in out
    assert "accepted" in out and "ILLEGAL_DEV_TABLE_ENTRY" in out  # 6.14's behaviour named
    for option in ("move the inference GPUs to a host without SEV-SNP", "SHM transport", "iommu=pt"):
        assert option in out, option
    assert "not a fix for a host that must keep its SNP VM" in out.replace("neither is a fix", "not a fix")
    assert _touched(run) == [], run.record
    st = host_state(snp)
    assert st["service"] == "active"
    assert [st["groups"][g] for g in GROUPS] == ["DMA-FQ"] * 4, st["groups"]


def test_snp_on_a_6_8_backport_kernel_is_decided_from_its_log(lab: Any, tmp_path: Path) -> None:
    """A 6.8 distribution kernel carrying the 6.9 SNP host support (mainline 6.8 has none): no kvm_amd
    sev_snp parameter yet; the AMD-Vi boot line decides, not the release; ENODEV and the backport named."""
    from gpulab.profiles.snp_variants import epyc_snp_backport

    host = lab.host(epyc_snp_backport("6.8.12-4-pve"), name=f"snp68-{os.getpid()}")
    run = run_suite(host, tmp_path)
    assert run.rc != 0 and run.outcomes["test_plan"] == "failed", run.outcomes
    assert "SEV-SNP is enabled" in run.output and "ENODEV" in run.output
    assert "distribution backport" in run.output
    assert _touched(run) == [], run.record
    host.down()


def test_refused_type_write_rolls_back_and_restores_the_service(lab: Any, tmp_path: Path) -> None:
    """The SNP facts are gone (kernel log rotated, a 6.8 backport has no kvm_amd sev_snp): the suite writes, the
    kernel refuses (ENODEV); the run rebinds, restarts nvidia-persistenced and the service, and says so."""
    from gpulab.profiles.snp_variants import epyc_snp_backport

    prof = epyc_snp_backport("6.8.12-4-pve", snp_log=False, module_params=NO_MODESET)
    host = lab.host(prof, name=f"snpfault-{os.getpid()}")
    run = run_suite(host, tmp_path)
    assert run.rc != 0
    assert run.outcomes["test_plan"] == "fixed", run.outcomes
    assert run.outcomes["test_iommu_groups_identity"] == "failed", run.outcomes
    out = run.output
    assert "ENODEV: the IOMMU driver refused an identity domain" in out, out[-3000:]
    assert "rolling back" in out or "rolling back" in str(run.doc)
    st = host_state(host)
    assert all(st["drivers"][b] == "nvidia" for b in NVIDIA), st["drivers"]
    assert all(st["drivers"][b[:-1] + "1"] == "snd_hda_intel" for b in NVIDIA), st["drivers"]
    assert st["service"] == "active"
    assert [st["groups"][g] for g in GROUPS] == ["DMA-FQ"] * 4, st["groups"]
    assert host.ssh("systemctl is-active nvidia-persistenced.service").stdout.strip() == "active"
    assert not [
        r
        for r in run.record
        if r.get("kind") == "sysfs" and r.get("err") == 0 and r["path"].endswith("/type")
    ]
    host.down()


def test_silent_fallback_to_dma_is_reported_and_rolled_back(lab: Any, tmp_path: Path) -> None:
    """6.4 with the SNP host backport, SNP lines gone from its log: the identity write returns success
    and the group reads DMA (iommu_group_alloc_default_domain()'s fallback). The suite says the group
    is not identity and what it read, puts the type back, rebinds every function and the service."""
    from gpulab.profiles.snp_variants import epyc_snp_backport

    prof = epyc_snp_backport("6.4.0", snp_log=False, module_params=NO_MODESET)
    host = lab.host(prof, name=f"snpfb-{os.getpid()}")
    run = run_suite(host, tmp_path)
    assert run.rc != 0
    assert run.outcomes["test_plan"] == "fixed", run.outcomes
    assert run.outcomes["test_iommu_groups_identity"] == "failed", run.outcomes
    out = run.output + str(run.doc)
    assert "returned success but the group reads 'DMA', not 'identity'" in out, out[-3000:]
    assert "fell back to a DMA domain" in out and "the group is not identity" in out
    st = host_state(host)
    assert all(st["drivers"][b] == "nvidia" for b in NVIDIA), st["drivers"]
    assert all(st["drivers"][b[:-1] + "1"] == "snd_hda_intel" for b in NVIDIA), st["drivers"]
    assert st["service"] == "active"
    assert [st["groups"][g] for g in GROUPS] == ["DMA-FQ"] * 4, st["groups"]
    host.down()


# nvidia-smi as a real one behaves after a rebind (docs/LAB-SOURCES.md asks the lab's tool for it): the
# first open of a GPU whose firmware is down boots it, gsp_boot_s per GPU, one GPU after the other.
FIRST_OPEN_SMI = """#!/bin/sh
for f in /var/lib/gpulab/ctl/gsp/*; do
  [ "$(cat "$f")" = 0 ] && { echo open > "$f"; } 2>/dev/null
done
exec REAL "$@"
"""


def test_first_nvidia_smi_after_rebind_waits_for_the_firmware(lab: Any, tmp_path: Path) -> None:
    """6 s of firmware start per GPU: the first nvidia-smi after the rebind outlasts its 20 s limit; the
    suite waits for the GPUs to come up instead of failing step 5."""
    from gpulab.profiles.load import load_profile

    host = lab.host(load_profile("proxmox-rtx6000", {"gsp_boot_s": 6.0}), name=f"p2pgsp-{os.getpid()}")
    real = host.ssh("command -v nvidia-smi").stdout.strip()
    assert real and not real.startswith("/usr/local/sbin")
    wrapper = FIRST_OPEN_SMI.replace("REAL", real)
    r = host.ssh(
        "mkdir -p /usr/local/sbin && cat > /usr/local/sbin/nvidia-smi && chmod 755 /usr/local/sbin/nvidia-smi",
        input=wrapper,
    )
    assert r.returncode == 0, r.stderr
    run = run_suite(host, tmp_path, timeout=300)
    assert run.rc == 0, str(run.tests.get("test_drivers_bound"))[-4000:]
    assert run.outcomes["test_drivers_bound"] == "fixed", run.outcomes
    notes = "\n".join(run.evidence("test_drivers_bound").get("notes", []))
    assert "firmware start on first open" in notes, notes
    host.down()


def test_kernel_side_holder_is_seen_at_its_real_path(lab: Any, tmp_path: Path) -> None:
    """nvidia_uvm holding a GPU with no open file (open-gpu-kernel-modules/issues/1119 and /1374): the lab host serves
    /sys/module at its real path (gpulab/host/boot.py), the suite reads the count there and stops with "needs a reboot path" before it stops, signals or unbinds anything."""
    host = lab.host("proxmox-rtx6000")
    host.reset()
    try:
        users = int(sh(host, "cat /sys/module/nvidia_uvm/refcnt"))  # the service's CUDA processes
        sh(host, "echo nvidia_uvm > /var/lib/gpulab/ctl/kernel_holders/0000:18:00.0")
        assert int(sh(host, "cat /sys/module/nvidia_uvm/refcnt")) == users + 1
        run = run_suite(host, tmp_path)
        assert run.rc != 0
        assert "needs a reboot path" in run.output and "nvidia_uvm is in use by the kernel" in run.output, (
            run.output[-3000:]
        )
        changes = [
            r
            for r in run.record
            if r.get("kind") == "signal" or str(r.get("path", "")).endswith(("bind", "/type"))
        ]
        assert changes == [], changes
        assert host_state(host)["service"] == "active"
    finally:
        host.reset()

"""SEV-SNP on the AMD IOMMU per kernel series, as the lab emulates it (the lab side).

Mainline enables SNP on the IOMMU from 6.9 (the SNP host setup of tag x86_sev_for_v6.9_rc1): a
mainline 6.8 kernel has none and prints no SNP line; a distribution kernel older than 6.9 may carry
it as a backport (``gpulab.profiles.snp_variants``) and then says so in its kernel log. From 5.11 to 6.4 a
refused identity domain falls back to DMA without an error (drivers/iommu/iommu.c
iommu_group_alloc_default_domain()). docs/LAB-SOURCES.md has the rows.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import yaml

from gpulab.profiles.load import load_profile
from gpulab.profiles.snp_variants import BACKPORT_LABEL, SNP_LINE, epyc_snp_backport
from gpulab.profiles.types import Profile
from tests.helpers.sysfs_io import rd

StandaloneMount = pytest.importorskip(
    "gpulab.kernel.sysfs", reason="the lab's sysfs needs mfusepy and libfuse", exc_type=ImportError
).StandaloneMount

needs_fuse = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)

AMD = "proxmox-epyc-snp"
GPU0, AUD0 = "0000:17:00.0", "0000:17:00.1"
# a driver whose unbind tears nvidia-modeset down first (nv_pci_remove() -> nvidia_modeset_remove()):
# these tests free a group without nvidia-drm's KMS hold getting in the way
NEW_DRIVER = {"driver_version": "580.105.08"}
FALLBACK = "iommu: Failed to allocate default IOMMU domain of type 4 for group (null) - Falling back to IOMMU_DOMAIN_DMA"


def sysw(p: str | Path, value: str) -> None:
    fd = os.open(p, os.O_WRONLY)
    try:
        os.write(fd, (value + "\n").encode())
    finally:
        os.close(fd)


def as_file(prof: Profile, tmp: Path) -> str:
    """Write a built profile as a YAML file the standalone daemon can load."""
    out = tmp / f"{prof.name}.yaml"
    out.write_text(yaml.safe_dump(dict(prof.raw)))
    return str(out)


def kmsg(m: StandaloneMount) -> list[str]:
    p = Path(m.state) / "kmsg"
    return [json.loads(x)["msg"] for x in p.read_text().splitlines()] if p.exists() else []


def free_group(m: StandaloneMount) -> Path:
    """Unbind GPU0 and its audio function (group 30, no owner left); return the group's type file."""
    sysw(Path(m.mnt) / "pci/drivers/nvidia/unbind", GPU0)
    sysw(Path(m.mnt) / "pci/drivers/snd_hda_intel/unbind", AUD0)
    return Path(m.mnt) / "iommu_groups/30/type"


def test_mainline_6_8_has_no_snp_on_its_iommu() -> None:
    """The seed's machine moved to a mainline 6.8 kernel: no SNP host support before 6.9, so no SNP
    on the IOMMU, no SNP line in its log, and nothing SNP-specific about an identity write."""
    prof = load_profile(AMD, {"kernel": "6.8.12-4-pve", **NEW_DRIVER})
    assert not prof.snp_kernel and not prof.snp_enabled and prof.snp_identity == ""
    assert not [x.msg for x in prof.kernel_log if "SNP" in x.msg]
    assert load_profile(AMD, {"kernel": "6.9.0"}).snp_enabled  # mainline SNP host support


def test_backport_kernel_is_labelled_and_prints_the_snp_line() -> None:
    prof = epyc_snp_backport("6.8.12-4-pve")
    assert prof.iommu.snp_backport and prof.snp_enabled and prof.snp_identity == "ENODEV"
    msgs = [x.msg for x in prof.kernel_log]
    assert BACKPORT_LABEL in msgs[0] and "6.8.12-4-pve" in msgs[0]
    assert SNP_LINE in msgs
    assert epyc_snp_backport("6.2.16-20-pve").snp_identity == "fallback"
    assert epyc_snp_backport("6.4.0").snp_identity == "fallback"
    hidden = epyc_snp_backport("6.2.16-20-pve", snp_log=False)
    assert hidden.snp_enabled and not [x.msg for x in hidden.kernel_log if "SNP" in x.msg]


@needs_fuse
def test_identity_on_mainline_6_8_amd_is_accepted(tmp_path: Path) -> None:
    prof = load_profile(AMD, {"kernel": "6.8.12-4-pve", **NEW_DRIVER})
    with StandaloneMount(as_file(prof, tmp_path), tmp_path / "m") as m:
        t = free_group(m)
        sysw(t, "identity")
        assert rd(t) == "identity"


@needs_fuse
def test_backport_6_8_refuses_identity_with_enodev(tmp_path: Path) -> None:
    with StandaloneMount(as_file(epyc_snp_backport(**NEW_DRIVER), tmp_path), tmp_path / "m") as m:
        t = free_group(m)
        with pytest.raises(OSError) as exc:
            sysw(t, "identity")
        assert exc.value.errno == errno.ENODEV
        assert rd(t) == "DMA-FQ"


@needs_fuse
def test_6_4_falls_back_to_dma_without_an_error(tmp_path: Path) -> None:
    """iommu_group_alloc_default_domain(): the driver gives no identity domain under SNP, the core
    allocates IOMMU_DOMAIN_DMA instead, warns, and the write succeeds; the type reads DMA. 6.4 is
    where this reaches the seed's GPUs: their groups hold an audio function too."""
    with StandaloneMount(as_file(epyc_snp_backport("6.4.0", **NEW_DRIVER), tmp_path), tmp_path / "m") as m:
        t = free_group(m)
        sysw(t, "identity")  # no error
        assert rd(t) == "DMA"
        assert FALLBACK in kmsg(m)
        sysw(t, "DMA-FQ")  # the original type can be put back while unbound
        assert rd(t) == "DMA-FQ"


@needs_fuse
def test_5_11_to_6_3_refuse_the_two_function_group_before_any_allocation(tmp_path: Path) -> None:
    """Before 6.4 iommu_group_store_type() refuses a group of more than one device with EINVAL before it
    allocates anything: the GPU with its audio function never reaches the fallback."""
    prof = epyc_snp_backport("6.2.16-20-pve", **NEW_DRIVER)
    with StandaloneMount(as_file(prof, tmp_path), tmp_path / "m") as m:
        t = free_group(m)
        with pytest.raises(OSError) as exc:
            sysw(t, "identity")
        assert exc.value.errno == errno.EINVAL and rd(t) == "DMA-FQ"
        assert FALLBACK not in kmsg(m)

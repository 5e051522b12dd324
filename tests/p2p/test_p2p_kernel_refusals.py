"""What the kernel will refuse or never finish, decided from step 1's facts (the suite side).

Pure functions of pytest_gpuhost.modules.{iommu,gpu}; the lab tests in test_p2p_real_host.py run
the suite end to end on the AMD SEV-SNP profile. Kernel-side holders are tested here as well, one
fact set per case, without booting a lab host.
"""

from __future__ import annotations

import errno

import pytest

from pytest_gpuhost.modules import gpu, iommu
from pytest_gpuhost.modules.iommu import IommuGroup, SnpFacts, snp_facts, snp_refusal
from pytest_gpuhost.modules.pci import PciFunction

SNP_LOG = (
    "[    0.803311] AMD-Vi: IOMMU SNP support enabled.\n[    0.812345] AMD-Vi: Interrupt remapping enabled\n"
)
INTEL_LOG = "[    0.1] DMAR: IOMMU enabled\n"
CMDLINE = "BOOT_IMAGE=/boot/vmlinuz root=/dev/mapper/pve-root ro quiet mem_encrypt=on"


def test_snp_from_the_kernel_log_line() -> None:
    f = snp_facts(CMDLINE, SNP_LOG, None, [])
    assert f.vendor == "amd" and f.snp and f.unknown is None
    assert "AMD-Vi: IOMMU SNP support enabled" in f.evidence[0]


def test_snp_from_kvm_amd_when_the_log_rotated() -> None:
    f = snp_facts(CMDLINE, "[ 9.1] nvidia: loading\n", "Y", ["/sys/class/iommu/ivhd0"])
    assert f.snp and f.vendor == "amd"
    assert f.evidence == [f"{iommu.SNP_PARAM} = Y"]


PT_LOG = (
    "[    0.80] AMD-Vi: SNP: IOMMU disabled or configured in passthrough mode, SNP cannot be supported.\n"
)


def test_iommu_pt_means_snp_off() -> None:
    """iommu_snp_enable() refuses SNP in passthrough mode: such a host is not SNP (and is identity anyway)."""
    f = snp_facts(CMDLINE + " iommu=pt", PT_LOG, None, [])
    assert not f.snp
    assert snp_refusal(f, "6.14.8-2-pve", [30]) is None


def test_amd_iommu_pt_is_no_option_and_leaves_snp_on() -> None:
    """parse_amd_iommu_options() knows no "pt": passthrough stays off, SNP stays on (6.13-6.19 lose the GPU)."""
    f = snp_facts(CMDLINE + " amd_iommu=pt", SNP_LOG, None, ["/sys/class/iommu/ivhd0"])
    assert f.snp
    assert snp_refusal(f, "6.14.8-2-pve", [30]) is not None
    # with the kernel log unreadable, amd_iommu=pt must not rule SNP out
    blind = snp_facts(CMDLINE + " amd_iommu=pt", None, None, ["/sys/class/iommu/ivhd0"])
    assert blind.unknown is not None and "not ruled out" in blind.unknown


def test_the_kernel_log_wins_over_the_command_line() -> None:
    assert snp_facts(CMDLINE + " iommu=pt", SNP_LOG, None, []).snp


def test_intel_and_amd_without_snp_are_not_refused() -> None:
    assert not snp_facts(CMDLINE, INTEL_LOG, None, ["/sys/class/iommu/dmar0"]).snp
    amd = snp_facts(CMDLINE, "[ 0.8] AMD-Vi: Interrupt remapping enabled\n", "N", ["/sys/class/iommu/ivhd0"])
    assert amd.vendor == "amd" and not amd.snp and amd.unknown is None


def test_unreadable_log_is_said_not_guessed() -> None:
    f = snp_facts(CMDLINE, None, None, [])
    assert not f.snp and f.unknown and "not ruled out" in f.unknown


@pytest.mark.parametrize(
    ("kernel", "named"),
    [
        ("6.8.12-4-pve", "ENODEV"),
        ("6.11.0", "ENOMEM"),
        ("6.14.8-2-pve", "ILLEGAL_DEV_TABLE_ENTRY"),
        ("7.0.0", "EINVAL"),
    ],
)
def test_refusal_names_the_series_behaviour_and_the_options(kernel: str, named: str) -> None:
    why = snp_refusal(SnpFacts("amd", True, ["kernel log: x"]), kernel, [30, 31])
    assert why is not None
    assert "SEV-SNP" in why and named in why and "groups 30, 31" in why
    assert "host without SEV-SNP" in why and "SHM transport" in why
    assert "iommu=pt" in why and "must keep its SNP VM" in why
    assert "Nothing was changed" in why


def test_no_refusal_without_a_group_to_change() -> None:
    assert snp_refusal(SnpFacts("amd", True, ["x"]), "6.14.0", []) is None


@pytest.mark.parametrize("code", [errno.ENODEV, errno.ENOMEM])
def test_refused_write_errno_is_explained(code: int) -> None:
    """A write refused anyway (SNP not visible in the facts) says what the errno means on an SNP IOMMU."""

    class Result:
        ok = False
        timed_out = False
        errno = code

    class Conn:
        name = "h"

        def write_file(
            self, path: str, data: str | bytes, *, timeout: float | None = None, mode: str = "w"
        ) -> Result:
            return Result()

        def call(self, op: str, **params: object) -> dict[str, object]:
            raise AssertionError("no read-back after a refused write")

    group = IommuGroup(30, "DMA-FQ", [PciFunction(bdf="0000:17:00.0", driver=None)])
    with pytest.raises(iommu.IommuError) as exc:
        iommu.set_type(Conn(), group, "identity", kernel="6.8.12-4-pve")
    assert exc.value.errno == code
    assert "refused an identity domain" in str(exc.value) and "SEV-SNP" in str(exc.value)


def _files(
    drm: str | None = None,
    uvm: str | None = None,
    modeset: str = "Y",
    version: str | None = "580.105.08",
    fbdev: str = "Y",
) -> dict[str, str | None]:
    return {
        gpu.MODESET: modeset,
        gpu.FBDEV: fbdev,
        gpu.DRM_REFCNT: drm,
        gpu.UVM_REFCNT: uvm,
        gpu.NV_VERSION: None if version is None else version + "\n",
    }


def test_modeset_fbdev_holds_the_gpu_without_an_open_file() -> None:
    found = gpu.kernel_holders(_files(drm="1", uvm="0", version="570.133.07"), set())
    assert len(found) == 1 and "nvidia_drm" in found[0] and "refcnt 1" in found[0] and "modeset=Y" in found[0]


def test_modeset_holds_the_gpu_with_refcnt_zero_before_580_105_08() -> None:
    """nvkms_open_gpu() raises the GPU's usage count, not nvidia_drm's refcnt: refcnt 0 still blocks an
    unbind on a driver whose nv_pci_remove() has no nvidia_modeset_remove() (before 580.105.08)."""
    for version, fbdev in (("570.133.07", "Y"), ("580.95.05", "N"), ("580.94.03", "Y")):
        found = gpu.kernel_holders(_files(drm="0", uvm="0", version=version, fbdev=fbdev), {})
        assert len(found) == 1, (version, found)
        assert "nvkms_open_gpu()" in found[0] and f"driver {version} predates 580.105.08" in found[0]
        assert "refcnt 0" in found[0] and f"fbdev={fbdev}" in found[0]
    # from 580.105.08 (580.94.06 on its branch) the unbind tears nvidia-modeset down first
    for version in ("580.105.08", "580.94.06", "590.48.01", "595.45.04"):
        assert gpu.kernel_holders(_files(drm="1", uvm="0", version=version), {}) == [], version
    # the version unread: an unbind that may never return is not risked
    found = gpu.kernel_holders(_files(drm="0", uvm="0", version=None), {})
    assert found and "driver version unknown" in found[0]
    # modeset=N: nvidia-drm registers no KMS device, whatever its refcnt
    assert gpu.kernel_holders(_files(drm="1", uvm="0", modeset="N", version="570.133.07"), set()) == []


def test_uvm_held_by_the_kernel_versus_by_a_process() -> None:
    assert gpu.kernel_holders(_files(drm="0", uvm="2"), {"/dev/nvidia-uvm"}) == []
    found = gpu.kernel_holders(_files(drm="0", uvm="2"), {"/dev/nvidia0"})
    assert len(found) == 1 and "nvidia_uvm" in found[0]


def test_no_module_loaded_or_unused_is_no_holder() -> None:
    assert gpu.kernel_holders({}, set()) == []
    assert gpu.kernel_holders(_files(drm="0", uvm="0"), set()) == []
    assert (
        gpu.kernel_holders(_files(drm="1", uvm="0"), {"/dev/dri/card1"}) == []
    )  # a process: step 3 names it


def test_uvm_references_of_open_files_are_not_the_kernels() -> None:
    """SGLang with tp=4: each CUDA context opens /dev/nvidia-uvm twice, two references per open file.

    One process per GPU, each with two uvm descriptors, reads refcnt 16 (4 x 2 x 2): no kernel
    holder. One reference more is the kernel's; a bare set of files cannot tell.
    """
    holders = [
        gpu.Holder(
            10 + i,
            "python3",
            "sglang --tp 4",
            [f"/dev/nvidia{i}", "/dev/nvidia-uvm"],
            "",
            {f"/dev/nvidia{i}": 1, "/dev/nvidia-uvm": 2},
        )
        for i in range(4)
    ]
    counts = gpu.open_counts(holders)
    assert counts["/dev/nvidia-uvm"] == 8
    assert gpu.kernel_holders(_files(drm="0", uvm="16"), counts) == []
    found = gpu.kernel_holders(_files(drm="0", uvm="17"), counts)
    assert found and "refcnt 17, 8 descriptor(s)" in found[0], found
    assert gpu.kernel_holders(_files(drm="0", uvm="2"), {"/dev/nvidia-uvm"}) == []
    found = gpu.kernel_holders(_files(drm="0", uvm="2"), {"/dev/nvidia0": 1})
    assert found and "0 descriptor(s)" in found[0], found


def test_parse_holders_reads_the_agents_fd_counts() -> None:
    raw = [
        {
            "pid": 5,
            "comm": "python3",
            "cmdline": "x",
            "files": ["/dev/nvidia-uvm"],
            "fds": {"/dev/nvidia-uvm": 2},
        }
    ]
    assert gpu.open_counts(gpu.parse_holders(raw)) == {"/dev/nvidia-uvm": 2}

"""The lab reproduces what real kernels and NVIDIA drivers do (the lab side).

Each test names the behaviour and its source; docs/LAB-SOURCES.md has the table. The sysfs
daemon is mounted standalone (no lab host boot), on the AMD EPYC SEV-SNP profile of the seed's
machine (``proxmox-epyc-snp``) and on the Intel second machine (``proxmox-rtx6000``).
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpulab.kernel import acs
from gpulab.kernel.model import find_holders
from gpulab.profiles.load import PROFILE_DIR, ProfileError, load_profile, parse_profile
from tests.helpers.gate import wait_blocked
from tests.helpers.sysfs_io import errno_of, rd, sysw

StandaloneMount = pytest.importorskip(
    "gpulab.kernel.sysfs", reason="the lab's sysfs needs mfusepy and libfuse", exc_type=ImportError
).StandaloneMount

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)

AMD = "proxmox-epyc-snp"
INTEL = "proxmox-rtx6000"
GPU0, AUD0, GPU1 = "0000:17:00.0", "0000:17:00.1", "0000:18:00.0"
DSP0, ROOT_PORT = "0000:16:00.0", "0000:14:01.0"
VFIO_GPU, VFIO_GROUP = "0000:9a:00.0", 34


def kmsg(m: StandaloneMount) -> list[str]:
    p = Path(m.state) / "kmsg"
    if not p.exists():
        return []
    return [json.loads(x)["msg"] for x in p.read_text().splitlines()]


def P(m: StandaloneMount, rel: str) -> Path:  # noqa: N802
    return Path(m.mnt) / rel


def variant(tmp: Path, base: str, **changes: object) -> str:
    """Write a copy of profile ``base`` with top-level ``changes`` and return its path."""
    data = yaml.safe_load((PROFILE_DIR / f"{base}.yaml").read_text())
    data.update(changes)
    out = tmp / f"{base}-variant.yaml"
    out.write_text(yaml.safe_dump(data))
    return str(out)


# The seed's nvidia-drm runs with modeset=Y, and on its driver (570) nvkms_open_gpu() holds every
# GPU so that no unbind returns (tests/lab/test_lab_nvkms.py): these tests unbind on a driver whose
# unbind tears nvidia-modeset down first.
NEW_DRIVER = "580.105.08"


@pytest.fixture(scope="module")
def amd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneMount]:
    """The AMD SNP profile at its default kernel (6.14), with a short firmware boot."""
    work = tmp_path_factory.mktemp("amd")
    with StandaloneMount(variant(work, AMD, gsp_boot_s=0.6, driver_version=NEW_DRIVER), work / "m") as m:
        yield m


@pytest.fixture
def a(amd: StandaloneMount) -> Iterator[StandaloneMount]:
    sysw(P(amd, "ctl/reset"), "1")
    yield amd
    sysw(P(amd, "ctl/reset"), "1")


def _free_group(m: StandaloneMount) -> Path:
    """Unbind GPU0 and its audio function so that group 30 has owner_cnt 0; return its type file."""
    sysw(P(m, "pci/drivers/nvidia/unbind"), GPU0)
    sysw(P(m, "pci/drivers/snd_hda_intel/unbind"), AUD0)
    return P(m, "iommu_groups/30/type")


# ------------------------------------------------------------------ SEV-SNP and identity domains


@pytest.mark.parametrize(
    ("kernel", "expect"),
    [
        # 6.9-6.10 (mainline SNP host support from 6.9; a mainline 6.8 has none,
        # tests/lab/test_lab_snp_kernels.py): amd_iommu_domain_alloc() returns NULL under SNP,
        # iommu_setup_default_domain() returns -ENODEV
        ("6.10.0", errno.ENODEV),
        # once allocation errors pass through as ERR_PTR: "Cannot allocate memory" (ba17de98545d's log)
        ("6.12.0", errno.ENOMEM),
        # 7.0: ba17de98545d "iommu/amd: Block identity domain when SNP enabled"
        ("7.0.0", errno.EINVAL),
    ],
)
def test_snp_refuses_identity_per_series(tmp_path: Path, kernel: str, expect: int) -> None:
    with StandaloneMount(
        variant(tmp_path, AMD, driver_version=NEW_DRIVER), tmp_path / "m", kernel=kernel
    ) as m:
        # no KVM SNP host support before 6.11: the SNP fact to rely on is the AMD-Vi boot line
        kvm_snp = load_profile(AMD, {"kernel": kernel}).kernel_version >= (6, 11)
        assert P(m, "module/kvm_amd/parameters/sev_snp").exists() == kvm_snp
        t = _free_group(m)
        assert errno_of(t, "identity") == expect
        assert rd(t) == "DMA-FQ"  # nothing changed
        sysw(t, "DMA")  # translated types stay allowed
        assert rd(t) == "DMA"


def test_snp_6_14_accepts_identity_then_dma_fails(a: StandaloneMount) -> None:
    """6.13+ (4402f2627d30, global identity domain) skips the SNP check: the write succeeds and the
    device's first DMA faults with ILLEGAL_DEV_TABLE_ENTRY (commit ba17de98545d's log)."""
    t = _free_group(a)
    sysw(t, "identity")
    assert rd(t) == "identity"
    sysw(P(a, "pci/drivers/nvidia/bind"), GPU0)  # probe does not start the GPU
    assert errno_of(P(a, f"ctl/gsp/{GPU0}"), "open") == errno.EIO
    lines = kmsg(a)
    assert any("AMD-Vi: Event logged [ILLEGAL_DEV_TABLE_ENTRY device=17:00.0" in x for x in lines), lines
    assert f"NVRM: GPU {GPU0}: rm_init_adapter failed, device minor number 0" in lines
    state = json.loads(rd(P(a, "ctl/state.json")))
    assert state["dma_broken_groups"] == [30]


def test_intel_second_machine_still_accepts_identity(tmp_path: Path) -> None:
    with StandaloneMount(INTEL, tmp_path) as m:
        t = _free_group(m)
        sysw(t, "identity")
        assert rd(t) == "identity"


def test_snp_facts_as_a_real_host_shows_them(a: StandaloneMount) -> None:
    """What the suite can read: kvm_amd's sev_snp parameter (/sys/module), the boot log lines
    (iommu_snp_enable(), kvm_amd), and a command line without iommu=pt."""
    assert rd(P(a, "module/kvm_amd/parameters/sev_snp")) == "Y"
    prof = load_profile(AMD)
    log = [k.msg for k in prof.kernel_log]
    assert "AMD-Vi: IOMMU SNP support enabled." in log
    assert any(x.startswith("kvm_amd: SEV-SNP enabled") for x in log)
    assert not any("DMAR" in x for x in log)
    assert "iommu=pt" not in prof.cmdline and prof.snp_enabled
    # iommu=pt turns SNP off (iommu_snp_enable(): "SNP: IOMMU disabled or configured in passthrough mode")
    assert not load_profile(AMD, {"default_domain": "identity"}).snp_enabled
    assert load_profile(INTEL).snp_identity == "" and load_profile(INTEL).iommu.vendor == "intel"


# ------------------------------------------------------------------ kernel-side GPU holders


def _unbind_in_thread(path: Path, bdf: str) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            sysw(path, bdf)
            out["rc"] = 0
        except OSError as e:
            out["rc"] = e.errno

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def test_kernel_holder_blocks_unbind_without_an_open_file(a: StandaloneMount) -> None:
    """nvidia-drm (modeset=1, fbdev) holds the GPU's usage count with no /dev file open:
    nv_pci_remove() waits; a /proc/*/fd scan finds nothing; /proc/modules and refcnt show it."""
    sysw(P(a, f"ctl/kernel_holders/{GPU1}"), "nvidia_drm")
    assert rd(P(a, "module/nvidia_drm/parameters/modeset")) == "Y"
    assert rd(P(a, "module/nvidia_drm/parameters/fbdev")) == "Y"
    assert rd(P(a, "module/nvidia_drm/refcnt")) == "1"
    mods = {ln.split()[0]: ln.split() for ln in rd(P(a, "proc/modules")).splitlines()}
    assert mods["nvidia_drm"][2] == "1" and mods["nvidia_modeset"][3] == "nvidia_drm,"
    assert sorted(os.listdir(P(a, "module/nvidia/holders"))) == ["nvidia_modeset", "nvidia_uvm"]
    dev1 = Path(a.dev) / "nvidia1"
    assert find_holders([dev1]) == {str(dev1): []}  # nothing for a /proc scan to find
    th, out = _unbind_in_thread(P(a, "pci/drivers/nvidia/unbind"), GPU1)
    wait_blocked(a.state, GPU1)
    assert th.is_alive(), "unbind returned while nvidia_drm held the GPU"
    assert f"NVRM: Attempting to remove device {GPU1} with non-zero usage count!" in kmsg(a)
    sysw(P(a, f"ctl/kernel_holders/{GPU1}"), "-nvidia_drm")
    th.join(3)
    assert not th.is_alive() and out["rc"] == 0
    assert errno_of(P(a, f"ctl/kernel_holders/{GPU1}"), "nvidia_drm") == errno.ENODEV
    assert errno_of(P(a, f"ctl/kernel_holders/{GPU0}"), "nouveau") == errno.EINVAL


def test_kernel_holders_from_the_profile_and_drm_nodes(tmp_path: Path) -> None:
    prof = variant(
        tmp_path, AMD, kernel_holders=[{"bdf": GPU0, "module": "nvidia_uvm"}], driver_version=NEW_DRIVER
    )
    with StandaloneMount(prof, tmp_path / "m") as m:
        assert rd(P(m, f"ctl/kernel_holders/{GPU0}")) == "nvidia_uvm"
        assert rd(P(m, "module/nvidia_uvm/refcnt")) == "1"
        # nvidia-drm with modeset=Y registers a DRM device per GPU (drm_dev_register())
        assert sorted(os.listdir(P(m, f"pci/devices/{GPU0}/drm"))) == ["card0", "renderD128"]
        assert rd(P(m, f"pci/devices/{GPU0}/drm/card0/dev")) == "226:0"
        assert not P(m, f"pci/devices/{VFIO_GPU}/drm").exists()
    bad = yaml.safe_load((PROFILE_DIR / f"{AMD}.yaml").read_text())
    bad["kernel_holders"] = [{"bdf": GPU0, "module": "nvidia_peermem"}]
    with pytest.raises(ProfileError, match=r"kernel_holders\[0\]\.module"):
        parse_profile(bad, "x.yaml")


# ------------------------------------------------------------------ errno details of the type file


def test_owner_cnt_counts_only_dma_api_drivers_from_6_4(tmp_path: Path) -> None:
    """6.4+ iommu_group_store_type(): EPERM while group->owner_cnt; pcieport, pci-stub and vfio-pci
    set driver_managed_dma and do not count; a VM that opened its vfio group does."""
    with StandaloneMount(INTEL, tmp_path / "i") as m:
        rp = P(m, "iommu_groups/10/type")  # the root port, bound to pcieport
        sysw(rp, "identity")
        assert rd(rp) == "identity"
        assert errno_of(P(m, f"iommu_groups/{VFIO_GROUP}/type"), "identity") == errno.EPERM  # VM running
        sysw(P(m, "pci/drivers/nvidia/unbind"), GPU0)
        assert errno_of(P(m, "iommu_groups/30/type"), "identity") == errno.EPERM  # snd_hda_intel
    idle = variant(tmp_path, INTEL, vfio_claimed=False)
    with StandaloneMount(idle, tmp_path / "v") as m:
        g = P(m, f"iommu_groups/{VFIO_GROUP}/type")
        sysw(g, "identity")  # bound to vfio-pci, no VM: owner_cnt 0
        assert rd(g) == "identity"


def test_type_file_before_5_11(tmp_path: Path) -> None:
    """5.2..5.10: IOMMU_GROUP_ATTR(type, 0444, iommu_group_show_type, NULL): readable, and opening
    it for writing fails in kernfs_fop_open() with EACCES; before 5.2 there is no such file."""
    with StandaloneMount(INTEL, tmp_path / "a", kernel="5.10.0") as m:
        t = P(m, "iommu_groups/30/type")
        assert rd(t) == "DMA"  # no DMA-FQ before 5.15
        with pytest.raises(PermissionError):
            os.open(t, os.O_WRONLY)
    with StandaloneMount(INTEL, tmp_path / "b", kernel="5.1.0") as m:
        assert not P(m, "iommu_groups/30/type").exists()
        assert sorted(os.listdir(P(m, "iommu_groups/30"))) == ["devices", "reserved_regions"]


# ------------------------------------------------------------------ ACS, grouping, P2P routing


def test_kernel_enables_acs_at_boot_and_groups_follow(a: StandaloneMount) -> None:
    """pci_std_enable_acs(): SV RR CR UF on every ACS-capable port when the IOMMU is on
    (lspci: ACSCtl: SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+)."""
    c = P(a, f"pci/devices/{DSP0}/config").read_bytes()
    assert c[0x100:0x104] == bytes.fromhex("0d000100")
    assert int.from_bytes(c[0x104:0x106], "little") == 0x5F  # ACSCap
    assert int.from_bytes(c[0x106:0x108], "little") == 0x1D  # ACSCtl: SV RR CR UF
    gpu = P(a, f"pci/devices/{GPU0}/config").read_bytes()
    assert gpu[0x100:0x102] == b"\0\0"  # endpoints have no ACS capability
    assert sorted(os.listdir(P(a, "iommu_groups/30/devices"))) == [GPU0, AUD0]
    prof = load_profile(AMD)
    assert acs.check_groups(prof) == ""
    # a switch without ACS puts the GPU in its downstream port's group: such a profile is refused
    data = yaml.safe_load((PROFILE_DIR / f"{AMD}.yaml").read_text())
    for f in data["pci"]:
        if f["bdf"] == DSP0:
            f["acs_cap"] = []
    with pytest.raises(ProfileError, match=r"kernel groups 0000:16:00\.0 with 0000:16:00\.0, 0000:17:00\.0"):
        parse_profile(data, "x.yaml")


def test_p2p_route_switch_versus_root_complex() -> None:
    amd, intel = load_profile(AMD), load_profile(INTEL)
    same_switch = acs.p2p_route(amd, GPU0, GPU1)
    assert same_switch is not None and same_switch.kind == "root-complex" and same_switch.redirected
    assert same_switch.gbps == 40.0
    old = acs.p2p_route(intel, GPU0, GPU1)  # the Intel profile keeps ACS off (old model)
    assert old is not None and (old.kind, old.redirected, old.gbps) == ("switch", False, 52.0)
    across = acs.p2p_route(amd, GPU0, "0000:3a:00.0")
    assert across is not None and (across.kind, across.redirected) == ("root-complex", False)
    assert acs.p2p_route(amd, GPU0, VFIO_GPU).kind == "cross-socket"  # type: ignore[union-attr]


# ------------------------------------------------------------------ firmware on first open


def test_first_open_after_rebind_waits_for_the_firmware(a: StandaloneMount) -> None:
    """nv_open_device() -> rm_init_adapter() boots GSP-RM on the first open after a bind."""
    g = P(a, f"ctl/gsp/{GPU1}")
    assert rd(g) == "1"  # opened at boot by nvidia-persistenced
    t0 = time.monotonic()
    sysw(g, "open")
    assert time.monotonic() - t0 < 0.3
    sysw(P(a, "pci/drivers/nvidia/unbind"), GPU1)
    sysw(P(a, "pci/drivers/nvidia/bind"), GPU1)
    assert rd(g) == "0"
    t0 = time.monotonic()
    sysw(g, "open")
    took = time.monotonic() - t0
    assert took >= 0.55, took
    assert rd(g) == "1"
    t0 = time.monotonic()
    sysw(g, "open")
    assert time.monotonic() - t0 < 0.3

"""The lab's FUSE sysfs, mounted standalone: the kernel's errno rules, symlinks, blocking unbind, record."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulab.kernel.model import HostModel
from gpulab.profiles.load import ProfileError, default_domain_for, load_profile, parse_profile
from tests.helpers.gate import wait_blocked
from tests.helpers.sysfs_io import errno_of, rd, sysw

StandaloneMount = pytest.importorskip(
    "gpulab.kernel.sysfs", reason="the lab's sysfs needs mfusepy and libfuse", exc_type=ImportError
).StandaloneMount

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)

GPU0, AUD0, GPU1, AUD1 = "0000:17:00.0", "0000:17:00.1", "0000:18:00.0", "0000:18:00.1"
VFIO_GPU = "0000:9a:00.0"
ROOT_PORT, ROOT_PORT_GROUP = "0000:14:01.0", 10


def records(m: StandaloneMount) -> list[dict[str, object]]:
    p = Path(m.state) / "record.jsonl"
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines()]


@pytest.fixture(scope="module")
def mount6(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneMount]:
    with StandaloneMount("proxmox-rtx6000", tmp_path_factory.mktemp("sysfs68")) as m:
        yield m


@pytest.fixture
def m(mount6: StandaloneMount) -> Iterator[StandaloneMount]:
    """The 6.8 mount, back at its boot state before and after each test."""
    sysw(Path(mount6.mnt) / "ctl/reset", "1")
    yield mount6
    sysw(Path(mount6.mnt) / "ctl/reset", "1")


def P(m: StandaloneMount, rel: str) -> Path:  # noqa: N802
    return Path(m.mnt) / rel


def test_profile_validation_errors_are_one_line() -> None:
    prof = load_profile("proxmox-rtx6000")
    assert prof.type_era == "eperm" and len(prof.gpus) == 8 and prof.groups()[30] == [GPU0, AUD0]
    assert load_profile("proxmox-rtx6000", {"kernel": "6.1.0"}).type_era == "ebusy"
    b200 = load_profile("b200-nvl8")
    lk = b200.link(b200.gpus[0].bdf, b200.gpus[7].bdf)
    assert lk is not None and lk.type == "nvlink" and lk.gbps == 750.0
    assert prof.link(GPU0, GPU1) == prof.link(GPU1, GPU0) and prof.link(GPU0, GPU1).type == "pcie-switch"  # type: ignore[union-attr]
    assert [s.name for s in b200.services if s.kind == "sglang"] == [f"sglang-dp{i}" for i in range(7)]
    raw = dict(prof.raw)
    raw["pci"] = [dict(raw["pci"][0], bdf="17:00.0")] + list(raw["pci"][1:])
    with pytest.raises(ProfileError) as ei:
        parse_profile(raw, "x.yaml")
    assert str(ei.value) == "x.yaml: pci[0].bdf: '17:00.0' is not a PCI address like 0000:17:00.0"
    with pytest.raises(ProfileError, match=r"^no profile named 'nope'"):
        load_profile("nope")
    with pytest.raises(ProfileError, match=r"kernel: 'x' is not a kernel release"):
        load_profile("b200-nvl8", {"kernel": "x"})
    # the schema (gpulab/profiles/schema.yaml) knows every key: a typo is refused, not ignored
    with pytest.raises(ProfileError, match=r"^x\.yaml: \(top level\): .*'kernel_enable_acs' was unexpected"):
        parse_profile(dict(prof.raw, kernel_enable_acs=True), "x.yaml")
    gpus = [dict(prof.raw["gpus"][0], health={"temprature": 90}), *prof.raw["gpus"][1:]]
    with pytest.raises(ProfileError, match=r"^x\.yaml: gpus\[0\]\.health: .*'temprature' was unexpected"):
        parse_profile(dict(prof.raw, gpus=gpus), "x.yaml")
    with pytest.raises(ProfileError, match=r"^x\.yaml: gpus\[0\]\.bdf: 0000:fe:00\.0 is not in pci$"):
        parse_profile(dict(prof.raw, gpus=[dict(prof.raw["gpus"][0], bdf="0000:fe:00.0")]), "x.yaml")


def test_default_domain_from_the_kernel_command_line() -> None:
    base = "BOOT_IMAGE=/boot/vmlinuz-6.8.12-4-pve root=/dev/mapper/pve-root ro quiet intel_iommu=on"
    assert default_domain_for(base, "DMA-FQ") == "DMA-FQ"
    assert default_domain_for(base + " iommu=pt", "DMA-FQ") == "identity"
    assert default_domain_for(base + " iommu.passthrough=1", "DMA") == "identity"
    assert default_domain_for(base + " iommu=pt iommu=nopt", "identity") == "DMA-FQ"
    assert default_domain_for(base + " iommu.strict=1", "DMA-FQ") == "DMA"
    assert default_domain_for("ro quiet", "identity") == "identity"


def test_layout_attributes_and_relative_links(m: StandaloneMount) -> None:
    prof = load_profile("proxmox-rtx6000")
    assert sorted(os.listdir(P(m, "pci/devices"))) == sorted(f.bdf for f in prof.pci)
    d = P(m, f"pci/devices/{GPU0}")
    assert rd(d / "vendor") == "0x10de" and rd(d / "device") == "0x2bb5" and rd(d / "class") == "0x030200"
    assert rd(d / "current_link_speed") == "32.0 GT/s PCIe" and rd(d / "current_link_width") == "16"
    assert rd(d / "max_link_speed") == "32.0 GT/s PCIe" and rd(d / "numa_node") == "0"
    assert rd(d / "driver_override") == "(null)"
    assert os.readlink(d / "driver") == "../../../../bus/pci/drivers/nvidia"
    assert os.readlink(d / "iommu_group") == "../../../../kernel/iommu_groups/30"
    # resolved from where the lab binds the subtrees inside the host
    host_dev = f"/sys/bus/pci/devices/{GPU0}"
    assert (
        os.path.normpath(os.path.join(host_dev, os.readlink(d / "driver"))) == "/sys/bus/pci/drivers/nvidia"
    )
    assert (
        os.path.normpath(os.path.join(host_dev, os.readlink(d / "iommu_group")))
        == "/sys/kernel/iommu_groups/30"
    )
    grp_link = P(m, f"iommu_groups/30/devices/{AUD0}")
    assert os.path.normpath(os.path.join("/sys/kernel/iommu_groups/30/devices", os.readlink(grp_link))) == (
        f"/sys/bus/pci/devices/{AUD0}"
    )
    drv_link = P(m, f"pci/drivers/nvidia/{GPU0}")
    assert os.path.normpath(os.path.join("/sys/bus/pci/drivers/nvidia", os.readlink(drv_link))) == host_dev
    assert sorted(os.listdir(P(m, "iommu_groups/30/devices"))) == [GPU0, AUD0]
    assert sorted(b for b in os.listdir(P(m, "pci/drivers/nvidia")) if b.startswith("0000:")) == [
        GPU0, GPU1, "0000:3a:00.0", "0000:3b:00.0",
    ]  # fmt: skip
    assert os.path.basename(os.readlink(P(m, f"pci/devices/{VFIO_GPU}/driver"))) == "vfio-pci"
    assert os.path.basename(os.readlink(P(m, f"pci/devices/{VFIO_GPU[:-1]}1/driver"))) == "vfio-pci"
    assert rd(P(m, f"pci/devices/{VFIO_GPU}/driver_override")) == "vfio-pci"
    assert rd(P(m, "iommu_groups/30/type")) == "DMA-FQ"


def test_type_rules_kernel_6_8(m: StandaloneMount) -> None:
    t = P(m, "iommu_groups/30/type")
    assert errno_of(t, "identity") == errno.EPERM  # GPU bound
    assert errno_of(t, "bogus") == errno.EINVAL
    assert errno_of(P(m, f"iommu_groups/{34}/type"), "identity") == errno.EPERM  # vfio-pci group
    sysw(P(m, "pci/drivers/nvidia/unbind"), GPU0)
    assert errno_of(t, "identity") == errno.EPERM  # audio function still bound
    sysw(P(m, "pci/drivers/snd_hda_intel/unbind"), AUD0)
    sysw(t, "identity")  # multi-device group is fine once all are unbound
    assert rd(t) == "identity"
    sysw(t, "auto")
    assert rd(t) == "DMA-FQ"
    sysw(t, "DMA")
    sysw(P(m, "pci/drivers/nvidia/bind"), GPU0)
    assert errno_of(t, "identity") == errno.EPERM
    sysw(t, "DMA-FQ")  # DMA -> DMA-FQ is allowed under a bound driver
    assert rd(t) == "DMA-FQ"
    assert errno_of(t, "DMA-FQ") == errno.EPERM  # anything else is not


def test_bind_unbind_errnos_and_links(m: StandaloneMount) -> None:
    nv = P(m, "pci/drivers/nvidia")
    assert errno_of(nv / "unbind", AUD0) == errno.ENODEV  # bound, but to snd_hda_intel
    assert errno_of(nv / "unbind", "0000:99:99.0") == errno.ENODEV
    assert errno_of(nv / "bind", GPU0) == errno.EBUSY
    assert errno_of(nv / "bind", "0000:99:99.0") == errno.ENODEV
    assert errno_of(nv / "bind", ROOT_PORT) == errno.ENODEV  # does not match a bridge
    dev = P(m, f"pci/devices/{GPU0}")
    sysw(nv / "unbind", GPU0)
    assert not os.path.lexists(dev / "driver") and "driver" not in os.listdir(dev)
    assert not os.path.lexists(nv / GPU0)
    assert errno_of(nv / "unbind", GPU0) == errno.ENODEV
    assert errno_of(P(m, "pci/drivers/vfio-pci/bind"), GPU0) == errno.ENODEV  # no id, no override
    sysw(nv / "bind", GPU0)
    assert os.readlink(dev / "driver") == "../../../../bus/pci/drivers/nvidia"
    assert os.path.islink(nv / GPU0)
    # driver_override steers drivers_probe; nvidia refuses a device overridden to vfio-pci
    sysw(nv / "unbind", GPU1)
    sysw(P(m, f"pci/devices/{GPU1}/driver_override"), "vfio-pci")
    assert errno_of(nv / "bind", GPU1) == errno.ENODEV
    sysw(P(m, "pci/drivers_probe"), GPU1)
    assert os.path.basename(os.readlink(P(m, f"pci/devices/{GPU1}/driver"))) == "vfio-pci"
    sysw(P(m, "pci/drivers/vfio-pci/unbind"), GPU1)
    sysw(P(m, f"pci/devices/{GPU1}/driver_override"), "")
    assert rd(P(m, f"pci/devices/{GPU1}/driver_override")) == "(null)"
    # vfio-pci ids= grab a GPU at probe time: the trap of drivers_probe
    sysw(P(m, "pci/drivers/vfio-pci/new_id"), "10de 2bb5")
    assert os.path.basename(os.readlink(P(m, f"pci/devices/{GPU1}/driver"))) == "vfio-pci"
    assert errno_of(P(m, "pci/drivers/vfio-pci/new_id"), "10de 2bb5") == errno.EEXIST
    # read-only attributes and write-only files answer like kernfs
    assert errno_of(dev / "vendor", "0x1234") == errno.EACCES
    with pytest.raises(PermissionError):
        rd(nv / "bind")


def test_config_space_bus_numbers_and_acs(m: StandaloneMount) -> None:
    gpu = P(m, f"pci/devices/{GPU0}/config").read_bytes()
    assert (
        len(gpu) == 4096
        and gpu[0:4] == bytes.fromhex("de10b52b")
        and gpu[0x09:0x0C] == bytes.fromhex("000203")
    )
    assert gpu[0x0E] == 0 and gpu[0x34] == 0x40 and gpu[0x40] == 0x10
    assert int.from_bytes(gpu[0x52:0x54], "little") == 5 | 16 << 4  # Gen5 x16 link status
    dsp, rp = "0000:16:00.0", ROOT_PORT
    assert (
        rd(P(m, f"pci/devices/{dsp}/secondary_bus_number")),
        rd(P(m, f"pci/devices/{dsp}/subordinate_bus_number")),
    ) == ("23", "23")
    assert (
        rd(P(m, f"pci/devices/{rp}/secondary_bus_number")),
        rd(P(m, f"pci/devices/{rp}/subordinate_bus_number")),
    ) == ("21", "24")
    cfg = P(m, f"pci/devices/{dsp}/config")
    c = cfg.read_bytes()
    assert c[0x0E] == 1 and c[0x19] == 0x17 and c[0x100:0x104] == bytes.fromhex("0d000100")
    assert int.from_bytes(c[0x106:0x108], "little") == 0
    fd = os.open(cfg, os.O_WRONLY)
    try:
        os.pwrite(fd, (0b1101).to_bytes(2, "little"), 0x106)  # setpci ECAP_ACS+6.w=000d
        os.pwrite(fd, b"\xff\xff", 0x00)  # read-only: ignored
    finally:
        os.close(fd)
    c = cfg.read_bytes()
    assert int.from_bytes(c[0x106:0x108], "little") == 0b1101 and c[0:2] == bytes.fromhex("0010")
    assert records(m)[-2]["value"] == "@0x106:0d00"


def test_minor_numbers_follow_bind_order(m: StandaloneMount) -> None:
    nv = P(m, "pci/drivers/nvidia")
    assert rd(P(m, f"ctl/minor/{GPU0}")) == "0" and rd(P(m, f"ctl/minor/{GPU1}")) == "1"
    sysw(nv / "unbind", GPU0)
    sysw(nv / "unbind", GPU1)
    assert not P(m, f"ctl/minor/{GPU0}").exists()
    sysw(nv / "bind", GPU1)
    sysw(nv / "bind", GPU0)
    assert rd(P(m, f"ctl/minor/{GPU1}")) == "0" and rd(P(m, f"ctl/minor/{GPU0}")) == "1"
    sysw(P(m, "ctl/reset"), "1")
    assert rd(P(m, f"ctl/minor/{GPU0}")) == "0"


def _unbind_in_thread(path: Path, bdf: str) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            sysw(path, bdf)
            out["rc"] = 0
        except OSError as e:
            out["rc"] = e.errno
        out["s"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def test_nvidia_unbind_blocks_while_a_process_holds_the_gpu(m: StandaloneMount) -> None:
    start = len(records(m))
    held = open(Path(m.dev) / "nvidia0", "rb")  # noqa: SIM115
    try:
        th, out = _unbind_in_thread(P(m, "pci/drivers/nvidia/unbind"), GPU0)
        wait_blocked(m.state, GPU0, start)
        time.sleep(0.4)  # held this long after it blocked: blocked_s below is at least that
        assert th.is_alive(), "unbind returned while /dev/nvidia0 was held"
        assert os.path.islink(P(m, f"pci/devices/{GPU0}/driver"))
        # other devices stay usable meanwhile
        sysw(P(m, "pci/drivers/nvidia/unbind"), GPU1)
    finally:
        held.close()
    th.join(3)
    assert not th.is_alive() and out["rc"] == 0
    assert not os.path.lexists(P(m, f"pci/devices/{GPU0}/driver"))
    recs = [r for r in records(m)[start:] if r.get("value") == GPU0]
    assert [r["result"] for r in recs] == ["blocked", "ok"]
    assert recs[1]["path"] == "/sys/bus/pci/drivers/nvidia/unbind" and float(str(recs[1]["blocked_s"])) >= 0.3


def test_legacy_persistence_does_not_block_unbind(m: StandaloneMount) -> None:
    """nv_pci_remove() tears legacy persistence down (rm_disable_gpu_state_persistence())."""
    pers = P(m, f"ctl/persistence/{GPU1}")
    sysw(pers, "1")
    assert rd(pers) == "1"
    th, out = _unbind_in_thread(P(m, "pci/drivers/nvidia/unbind"), GPU1)
    th.join(3)
    assert not th.is_alive() and out["rc"] == 0
    assert rd(pers) == "0"
    assert errno_of(pers, "1") == errno.ENODEV  # no longer bound to nvidia
    sysw(P(m, "pci/drivers/nvidia/bind"), GPU1)
    assert errno_of(pers, "2") == errno.EINVAL


def test_reset_releases_a_pending_unbind(m: StandaloneMount) -> None:
    held = open(Path(m.dev) / "nvidia3", "rb")  # noqa: SIM115
    try:
        start = len(records(m))
        th, out = _unbind_in_thread(P(m, "pci/drivers/nvidia/unbind"), "0000:3b:00.0")
        wait_blocked(m.state, "0000:3b:00.0", start)
        assert th.is_alive()
        sysw(P(m, "ctl/reset"), "1")
        th.join(3)
        assert out["rc"] == errno.EINTR
        assert os.path.islink(P(m, "pci/devices/0000:3b:00.0/driver"))
    finally:
        held.close()


def test_every_write_is_recorded(m: StandaloneMount) -> None:
    start = len(records(m))
    errno_of(P(m, "iommu_groups/31/type"), "identity")
    sysw(P(m, "pci/drivers/nvidia/unbind"), GPU1)
    recs = records(m)[start:]
    assert recs[0] == {**recs[0], "path": "/sys/kernel/iommu_groups/31/type", "value": "identity",
                       "errno": errno.EPERM, "result": "EPERM", "pid": os.getpid()}  # fmt: skip
    assert recs[1]["path"] == "/sys/bus/pci/drivers/nvidia/unbind" and recs[1]["result"] == "ok"
    assert all(isinstance(r["t"], float) for r in recs)


def test_kernel_6_1_era_and_unprivileged_writers() -> None:
    work = tempfile.mkdtemp(prefix="gl-h4-")  # 0755 path so an unprivileged user can reach it
    os.chmod(work, 0o755)
    try:
        _kernel_6_1_era(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _kernel_6_1_era(work: str) -> None:
    with StandaloneMount("proxmox-rtx6000", work, kernel="6.1.0") as m:
        nobody = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c",
             'cat "$1/devices/0000:17:00.0/vendor" && wc -c < "$1/devices/0000:17:00.0/config" && '
             'echo 0000:17:00.0 > "$1/drivers/nvidia/unbind"', "sh",
             P(m, "pci")],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        assert (
            nobody.stdout == "0x10de\n64\n"
            and "Permission denied" in nobody.stderr
            and nobody.returncode != 0
        )
        t = P(m, "iommu_groups/30/type")
        assert errno_of(t, "identity") == errno.EINVAL  # GPU + audio: more than one device
        sysw(P(m, "pci/drivers/nvidia/unbind"), GPU0)
        sysw(P(m, "pci/drivers/snd_hda_intel/unbind"), AUD0)
        assert errno_of(t, "identity") == errno.EINVAL  # still two devices
        rp = P(m, f"iommu_groups/{ROOT_PORT_GROUP}/type")
        assert errno_of(rp, "identity") == errno.EBUSY  # single device, bound to pcieport
        assert errno_of(rp, "nonsense") == errno.EINVAL
        sysw(P(m, "pci/drivers/pcieport/unbind"), ROOT_PORT)
        sysw(rp, "identity")
        assert rd(rp) == "identity"
        assert [r["result"] for r in records(m)][:2] == ["EINVAL", "ok"]


def test_sigterm_ends_a_blocked_daemon_and_unmounts(tmp_path: Path) -> None:
    m = StandaloneMount("proxmox-rtx6000", tmp_path)
    with m:
        held = open(Path(m.dev) / "nvidia0", "rb")  # noqa: SIM115
        try:
            th, out = _unbind_in_thread(P(m, "pci/drivers/nvidia/unbind"), GPU0)
            wait_blocked(m.state, GPU0)
            t0 = time.monotonic()
            rc = m.stop(timeout=5)
            assert rc == 0 and time.monotonic() - t0 < 4
            th.join(3)
            assert not th.is_alive() and out["rc"] != 0
        finally:
            held.close()
        assert not os.path.ismount(m.mnt)


# ----------------------------------------------------------------------
# The lab sysfs tree builds only the node asked for: every listed name resolves, nothing else does.
#
# In process (no FUSE mount): `SysfsTree` over a `HostModel` of each profile. A device directory's
# listing (`_device_names`) and its lookups (`_device_attr`) are written separately, so this checks
# that they agree, for every function of every profile.


SysfsTree = pytest.importorskip(
    "gpulab.kernel.sysfs_tree", reason="the lab's sysfs needs libfuse", exc_type=ImportError
).SysfsTree
mfusepy = pytest.importorskip("mfusepy")  # loaded by gpulab.kernel.sysfs_tree just above

PROFILES = sorted(
    p.stem for p in (Path(__file__).resolve().parents[2] / "fixtures" / "profiles").glob("*.yaml")
)
ABSENT = (
    "nothing",
    "secondary_bus_number",
    "current_link_speed",
    "aer_dev_fatal",
    "driver",
    "drm",
    "iommu_group",
)


class _Tree(SysfsTree):
    def __init__(self, model: HostModel) -> None:
        self.model = model


@pytest.mark.parametrize("profile", PROFILES)
def test_listing_and_lookup_agree(profile: str, tmp_path: Path) -> None:
    tree = _Tree(HostModel(load_profile(profile), str(tmp_path), str(tmp_path)))
    for bdf in tree.model.functions:
        base = f"/pci/devices/{bdf}"
        listed = tree.lookup(base).children()
        assert listed == sorted(set(listed)), bdf
        for name in listed:
            node = tree.lookup(f"{base}/{name}")
            if node.read is not None:
                assert node.read().endswith("\n"), (bdf, name)
            if node.kind == "dir" and name == "power":  # a port's runtime PM: control, runtime_status
                assert node.children() == ["control", "runtime_status"], bdf
                assert tree.lookup(f"{base}/power/control").read() in ("on\n", "auto\n")
                continue
            if node.kind == "dir":  # drm/: cardN, renderD(128+N), each with dev and uevent
                for sub in node.children():
                    assert tree.lookup(f"{base}/{name}/{sub}").kind == "dir"
                    dev = tree.lookup(f"{base}/{name}/{sub}/dev").read
                    assert dev is not None
                    assert dev() == f"226:{sub.removeprefix('card').removeprefix('renderD')}\n"
        for name in ABSENT:
            if name not in listed:
                with pytest.raises(mfusepy.FuseOSError) as exc:
                    tree.lookup(f"{base}/{name}")
                assert exc.value.errno == errno.ENOENT, (bdf, name)
        with pytest.raises(mfusepy.FuseOSError):
            tree.lookup(f"{base}/vendor/x")

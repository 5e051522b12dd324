"""suites/p2p planning on recorded facts: scope, vfio safety, journal resume, boot script, thresholds."""

from __future__ import annotations

import copy
import errno
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_gpuhost.modules import gpu, iommu, p2p
from pytest_gpuhost.modules import p2p_boot as persist
from suites.p2p.plan import make_plan, parse_gpus_option

ROOT = Path(__file__).resolve().parents[2]
# `gpus`/`gpu_holders`/`persistence`/`nvidia_smi_gpus` facts read from the proxmox-rtx6000 lab host
FACTS = json.loads((ROOT / "fixtures" / "outputs" / "p2p-facts-proxmox-rtx6000-broken.json").read_text())
NVIDIA = ["0000:17:00.0", "0000:18:00.0", "0000:3a:00.0", "0000:3b:00.0"]
VFIO = ["0000:9a:00.0", "0000:9b:00.0", "0000:ba:00.0", "0000:bb:00.0"]
KERNEL = "6.8.12-4-pve"


def gpus_from(facts: dict[str, Any]) -> list[gpu.GpuInfo]:
    return gpu.from_facts(facts["gpus"], facts["gpu_holders"])


def test_default_scope_is_nvidia_and_never_vfio() -> None:
    plan = make_plan(gpus_from(FACTS), kernel=KERNEL)
    assert plan.gpus == NVIDIA
    assert set(plan.excluded) == set(VFIO)
    assert all("vfio-pci" in why for why in plan.excluded.values())
    assert [g.number for g in plan.groups] == [30, 31, 32, 33]
    assert plan.needs_identity == [30, 31, 32, 33]
    assert plan.needs_repair and not plan.errors
    touched = {f.bdf for g in plan.groups for f in g.functions}
    assert touched == set(NVIDIA) | {b[:-1] + "1" for b in NVIDIA}
    assert not touched & ({b for b in VFIO} | {b[:-1] + "1" for b in VFIO})


def test_unbind_gpu_first_rebind_in_minor_order() -> None:
    plan = make_plan(gpus_from(FACTS), kernel=KERNEL)
    assert [f.bdf for f in plan.groups[0].unbind_order] == ["0000:17:00.0", "0000:17:00.1"]
    order = [f.bdf for f in plan.rebind_order]
    assert order[:4] == NVIDIA and all(b.endswith(".1") for b in order[4:])
    assert plan.minors == {b: i for i, b in enumerate(NVIDIA)}
    assert {f.driver for f in plan.rebind_order} == {"nvidia", "snd_hda_intel"}


def test_gpus_option_by_minor_and_by_address() -> None:
    assert parse_gpus_option(None) is None
    assert parse_gpus_option("0, 1") == ["0", "1"]
    with pytest.raises(ValueError, match="neither a PCI address"):
        parse_gpus_option("0000:17:00")
    plan = make_plan(gpus_from(FACTS), kernel=KERNEL, selected=["0", "0000:3b:00.0"])
    assert plan.gpus == ["0000:17:00.0", "0000:3b:00.0"]
    assert plan.excluded["0000:18:00.0"] == "not listed in --gpus"


def test_gpus_option_naming_a_vfio_gpu_is_refused() -> None:
    plan = make_plan(gpus_from(FACTS), kernel=KERNEL, selected=["0000:17:00.0", "0000:9a:00.0"])
    assert plan.gpus == ["0000:17:00.0"]
    assert any("0000:9a:00.0" in e and "vfio-pci" in e for e in plan.errors)


def test_group_with_a_vfio_function_is_never_in_scope() -> None:
    facts = copy.deepcopy(FACTS)
    entry = next(g for g in facts["gpus"] if g["bdf"] == "0000:18:00.0")
    entry["group_members"][1]["driver"] = "vfio-pci"  # audio function handed to a VM
    plan = make_plan(gpus_from(facts), kernel=KERNEL)
    assert "0000:18:00.0" not in plan.gpus
    assert "vfio-pci" in plan.excluded["0000:18:00.0"]
    assert 31 not in [g.number for g in plan.groups]


@pytest.mark.parametrize(
    ("kernel", "needle"),
    [
        ("6.1.0-18-amd64", "before 6.4) cannot change the type of a group with more than one device"),
        ("5.10.0-28", "(5.2-5.10) shows /sys/kernel/iommu_groups/N/type read-only"),
        ("4.19.0-27-amd64", "no /sys/kernel/iommu_groups/N/type (5.2+"),
    ],
)
def test_old_kernels_are_refused_before_anything_is_touched(kernel: str, needle: str) -> None:
    plan = make_plan(gpus_from(FACTS), kernel=kernel)
    assert plan.errors and needle in plan.errors[0] and "iommu=pt" in plan.errors[0]
    facts = copy.deepcopy(FACTS)
    for g in facts["gpus"]:
        g["group_members"] = g["group_members"][:1]  # single-device groups: 5.11-6.3 can change those
    assert make_plan(gpus_from(facts), kernel="6.1.0-18-amd64").errors == []


def test_healthy_host_needs_nothing() -> None:
    facts = copy.deepcopy(FACTS)
    for g in facts["gpus"]:
        if g["driver"] == "nvidia":
            g["group_type"] = "identity"
    plan = make_plan(gpus_from(facts), kernel=KERNEL)
    assert not plan.needs_repair and plan.groups_to_fix == [] and plan.gpus == NVIDIA


def test_interrupted_run_is_resumed_from_its_journal() -> None:
    """A run cut after unbinding GPU 0 left it without a driver: the journal keeps it in scope."""
    journal = {
        "run_id": "cafe",
        "phase": "unbind",
        "plan": make_plan(gpus_from(FACTS), kernel=KERNEL).to_dict(),
    }
    facts = copy.deepcopy(FACTS)
    entry = facts["gpus"][0]
    entry["driver"], entry["minor"] = None, None
    entry["group_members"][0]["driver"] = None
    entry["group_members"][1]["driver"] = None
    entry["group_type"] = "identity"
    without = make_plan(gpus_from(facts), kernel=KERNEL)
    assert "0000:17:00.0" not in without.gpus  # no journal: an unbound GPU is not ours to touch
    plan = make_plan(gpus_from(facts), kernel=KERNEL, journal=journal)
    assert plan.gpus == NVIDIA and plan.resumed_from == "cafe"
    assert {f.bdf for f in plan.unbound} == {"0000:17:00.0", "0000:17:00.1"}
    assert plan.minors["0000:17:00.0"] == 0
    assert plan.groups[0].original_type == "DMA-FQ" and plan.groups[0].identity
    assert plan.groups[0] in plan.groups_to_fix  # identity already, but its functions need rebinding
    assert plan.needs_repair


def test_boot_script_touches_exactly_the_planned_groups(tmp_path: Path) -> None:
    plan = make_plan(gpus_from(FACTS), kernel=KERNEL)
    text = persist.script_text(plan)
    assert text == persist.script_text(make_plan(gpus_from(FACTS), kernel=KERNEL))  # deterministic
    for n in (30, 31, 32, 33):
        assert f"group_identity {n} " in text
    assert "9a:00" not in text and "ba:00" not in text and "group_identity 34" not in text
    binds = [ln.split()[1] for ln in text.splitlines() if ln.startswith("rebind ")]
    assert binds == [f.bdf for f in plan.rebind_order]
    script = tmp_path / "s.sh"
    script.write_text(text)
    assert subprocess.run(["sh", "-n", str(script)], capture_output=True).returncode == 0
    unit = persist.unit_text()
    assert "Before=nvidia-persistenced.service pve-ha-lrm.service pve-guests.service" in unit
    assert (
        "Type=oneshot" in unit and "WantedBy=multi-user.target" in unit and "DefaultDependencies" not in unit
    )
    assert "trap finish EXIT" in text and text.index("rebind_all() {") < text.index("group_identity 30")
    assert "gpu_users" in text and "blocked for 10 s" in text  # never blocks the boot on a GPU in use


def test_boot_script_is_a_record_of_drivers_and_minors() -> None:
    plan = make_plan(gpus_from(FACTS), kernel=KERNEL)
    record = persist.recorded_functions(persist.script_text(plan))
    assert record["0000:3a:00.0"] == {"bdf": "0000:3a:00.0", "driver": "nvidia", "is_gpu": True, "minor": 2}
    assert record["0000:3a:00.1"]["driver"] == "snd_hda_intel" and not record["0000:3a:00.1"]["is_gpu"]
    assert set(record) == {f.bdf for f in plan.rebind_order}
    # a boot-time unbind that completed late left GPU 0 without a driver and no journal: the record keeps it in scope
    facts = copy.deepcopy(FACTS)
    facts["gpus"][0]["driver"] = facts["gpus"][0]["group_members"][0]["driver"] = None
    facts["gpus"][0]["minor"] = None
    as_journal = {"run_id": None, "plan": {"groups": [{"number": -1, "functions": [record["0000:17:00.0"]]}]}}
    again = make_plan(gpus_from(facts), kernel=KERNEL, journal=as_journal)
    assert again.gpus == NVIDIA and again.minors["0000:17:00.0"] == 0 and again.needs_repair
    assert again.resumed_from is None


def test_kernel_command_line_that_makes_groups_identity_at_boot() -> None:
    assert persist.boot_identity("BOOT_IMAGE=/boot/vmlinuz ro iommu=pt") == "iommu=pt"
    assert persist.boot_identity("ro quiet intel_iommu=on") is None
    assert persist.boot_identity(FACTS["host_info"]["cmdline"]) is None  # the broken Proxmox host


def test_expected_bandwidth_and_thresholds() -> None:
    gen5 = {"speed": "32.0 GT/s PCIe", "width": 16}
    gen4 = {"speed": "16.0 GT/s PCIe", "width": 16}
    assert p2p.pcie_gbps("32.0 GT/s PCIe", 16) == 63.0
    assert p2p.expected_gbps(gen4, gen4) == 31.5
    assert p2p.expected_gbps(gen5, {"speed": "32.0 GT/s PCIe", "width": 8}) == 31.5  # the narrower link
    assert p2p.expected_gbps(gen5, gen5, "NV18", "NVIDIA H100 80GB HBM3") == 450.0
    assert p2p.expected_gbps(gen5, gen5, "NV18", "NVIDIA B200") == 900.0
    ok = {(x, y): "OK" for x in "abc" for y in "abc" if x != y}
    m = p2p.P2PMatrix(
        ["a", "b", "c"], {("a", "b"): 52.0, ("b", "a"): 51.0, ("a", "c"): 12.0, ("c", "a"): None}, "test", ok
    )
    links = {x: gen5 for x in "abc"}
    verdicts = {(v.a, v.b): v for v in p2p.judge(m, links)}
    assert verdicts[("a", "b")].ok and verdicts[("a", "b")].threshold == 31.5
    assert not verdicts[("a", "c")].ok and "12 GB/s < 31.5" in verdicts[("a", "c")].describe()
    assert not verdicts[("c", "a")].ok and "not measured" in verdicts[("c", "a")].describe()
    assert all(v.threshold == 10 for v in p2p.judge(m, links, min_gbps=10))
    assert (
        p2p.norm_bdf("00000000:3A:00.0") == "0000:3a:00.0"
        and p2p.norm_bdf("00000000:34:00") == "0000:34:00.0"
    )


def test_bandwidth_without_p2p_capability_never_passes() -> None:
    """Host-staged copies reach ~37 GB/s on Gen5 with P2P off (NVIDIA/nccl#1264): capability gates each pair."""
    gen5 = {"speed": "32.0 GT/s PCIe", "width": 16}
    links = {x: gen5 for x in "ab"}
    values: dict[tuple[str, str], float | None] = {("a", "b"): 52.0, ("b", "a"): 52.0}
    for caps in ({("a", "b"): "CNS", ("b", "a"): "NS"}, {}):
        verdicts = p2p.judge(p2p.P2PMatrix(["a", "b"], values, "test", caps), links)
        assert [v.ok for v in verdicts] == [False, False]
        assert "no P2P" in verdicts[0].describe() and "bandwidth is no proof" in verdicts[0].describe()
    verdicts = p2p.judge(
        p2p.P2PMatrix(["a", "b"], values, "test", {("a", "b"): "OK", ("b", "a"): "OK"}), links
    )
    assert [v.ok for v in verdicts] == [True, True]


class _Writer:
    """Answers one sysfs write with an errno, as the agent's watched write reports it."""

    name = "host"

    def __init__(self, code: int) -> None:
        self.code = code

    def write_file(self, path: str, data: Any, *, timeout: float | None = None, mode: str = "w") -> Any:
        return SimpleNamespace(ok=False, errno=self.code, error=errno.errorcode[self.code], timed_out=False)

    def call(self, op: str, **params: Any) -> Any:
        raise AssertionError("a refused write must not be read back")


@pytest.mark.parametrize(
    ("code", "kernel", "members", "needle"),
    [
        (
            errno.EPERM,
            "6.8.12-4-pve",
            1,
            "owner_cnt is not zero: bound to a driver that uses the kernel DMA API",
        ),
        (errno.EPERM, "6.1.0-18-amd64", 1, "EPERM: a device of the group is still bound"),
        (errno.EBUSY, "6.1.0-18-amd64", 1, "EBUSY: device still bound"),
        (errno.EINVAL, "6.1.0-18-amd64", 2, "before 6.4) cannot change the type of a group with 2 devices"),
        (errno.EINVAL, "6.8.12-4-pve", 2, "does not accept 'identity'"),
        (errno.EACCES, "6.8.12-4-pve", 1, "CAP_SYS_ADMIN"),
        (errno.EACCES, "5.10.0-28-amd64", 1, "(5.2-5.10) shows the group type read-only"),
        (errno.ENOENT, "4.19.0-27-amd64", 1, "older than 5.2"),
    ],
)
def test_group_type_errors_say_what_the_kernel_meant(
    code: int, kernel: str, members: int, needle: str
) -> None:
    from pytest_gpuhost.modules.pci import PciFunction

    group = iommu.IommuGroup(
        30, "DMA-FQ", [PciFunction(f"0000:17:00.{i}", driver="nvidia") for i in range(members)]
    )
    with pytest.raises(iommu.IommuError) as err:
        iommu.set_type(_Writer(code), group, "identity", kernel=kernel)
    assert needle in str(err.value) and err.value.errno == code


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stop-timeout=soon"], "not a number"),
        (["--p2p-min-fraction=3"], "out of range"),
        (["--gpus=0000:17:00"], "neither a PCI address"),
        (["--health-url=localhost:30000"], "not an http(s) URL"),
    ],
)
def test_bad_options_are_usage_errors(args: list[str], message: str) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "suites/p2p",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 4, r.stdout + r.stderr
    assert message in r.stderr


def test_run_lock_and_journal_on_a_local_target(tmp_path: Path) -> None:
    """Two agents: the second is refused while the first lives, and takes over once it is gone."""
    from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url
    from pytest_gpuhost.modules.journal import Journal, LockBusy

    opts = TargetOptions(command_timeout=10)
    a = open_connection(parse_host_url("local://"), opts)
    b = open_connection(parse_host_url("local://"), opts)
    try:
        ja = Journal(a, "p2p", base=str(tmp_path))
        jb = Journal(b, "p2p", base=str(tmp_path))
        assert ja.acquire(wait=0, owner={"controller": "run-a"})["took_over"] is None
        ja.write(phase="unbind", plan={"groups": []})
        seen = jb.read()
        assert seen is not None and seen["phase"] == "unbind"
        t0 = time.monotonic()
        with pytest.raises(LockBusy, match="another p2p run holds .* run-a"):
            jb.acquire(wait=1)
        assert 0.9 <= time.monotonic() - t0 < 5
        a.close()  # its agent exits: the lock it held is stale now
        deadline = time.monotonic() + 10
        while True:
            try:
                got = jb.acquire(wait=0)
                break
            except LockBusy:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert "is gone" in got["took_over"]["why"]
        jb.write(phase="done")
        jb.retire()
        assert jb.read() is None and (tmp_path / "journal" / "p2p.json.done").exists()
        jb.release()
        assert not (tmp_path / "lock" / "p2p").exists()
    finally:
        a.close()
        b.close()


def test_a_driverless_audio_function_still_makes_the_group_unchangeable_before_6_4() -> None:
    """5.11-6.3 refuse a group of two devices with EINVAL whatever the members' drivers.

    iommu_group_store_type() checks iommu_group_device_count() != 1 before it looks at any driver
    (drivers/iommu/iommu.c, v5.11 to v6.3); the real 6.1 kernel under QEMU answered EINVAL for a
    group whose members had no driver (docs/LAB-SOURCES.md). The plan must refuse at step 1, not
    stop the service, unbind and roll back for nothing.
    """
    facts = copy.deepcopy(FACTS)
    for g in facts["gpus"]:
        for m in g["group_members"][1:]:
            m["driver"] = None  # the GPU's HDMI audio function without snd_hda_intel
    plan = make_plan(gpus_from(facts), kernel="6.1.0-18-amd64")
    assert (
        plan.errors
        and "before 6.4) cannot change the type of a group with more than one device" in (plan.errors[0])
    )
    assert make_plan(gpus_from(facts), kernel=KERNEL).errors == []  # 6.4+: unbound members are fine

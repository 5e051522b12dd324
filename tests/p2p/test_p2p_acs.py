"""suites/p2p and PCIe ACS, and the kernel's errno rules per series (the suite side).

Unit tests: modules/acs.py (the kernel's pci_acs_enabled() rules, ACS redirect between two GPUs of
one switch), the plan (a group shared with a VM's device, pcieport members from 6.4), the agent's
`pci_paths` probe on config space bytes. Lab tests (over SSH): `gpulab.profiles.p2p_variants` gives the
Intel Proxmox host with the kernel enabling ACS and a root port without ACS, so that a GPU on
nvidia and a VM's GPU share one IOMMU group; a kernel 5.10 host has the read-only `type` file.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_pci_path
from pytest_gpuhost.modules import acs
from suites.p2p.plan import make_plan, redirect_advice
from tests.p2p.test_p2p_plan import FACTS, KERNEL, gpus_from
from tests.p2p.test_p2p_suite import run_suite, sh

FULL = ("SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd")
CAP = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "DirectTrans")


def _port(
    bdf: str, kind: str, ctl: tuple[str, ...] = FULL, present: bool = True, cap: tuple[str, ...] = CAP
) -> dict:
    return {
        "bdf": bdf,
        "type": kind,
        "multifunction": False,
        "acs": {"present": present, "cap": list(cap), "ctl": list(ctl)},
    }


def _paths(root_acs: bool = True, redirect: bool = True) -> dict[str, Any]:
    """pci_paths of the rtx6000 tree: two GPUs per switch, two switches per root port pair."""
    dsp_ctl = FULL if redirect else ("SrcValid", "UpstreamFwd")
    out = {}
    for gpu, dsp, up, rp in (
        ("0000:17:00.0", "0000:16:00.0", "0000:15:00.0", "0000:14:01.0"),
        ("0000:18:00.0", "0000:16:01.0", "0000:15:00.0", "0000:14:01.0"),
        ("0000:3a:00.0", "0000:39:00.0", "0000:38:00.0", "0000:37:01.0"),
        ("0000:3b:00.0", "0000:39:01.0", "0000:38:00.0", "0000:37:01.0"),
    ):
        root = _port(rp, "root") if root_acs or rp != "0000:37:01.0" else _port(rp, "root", (), False, ())
        out[gpu] = {
            "driver": "nvidia",
            "ports": [_port(dsp, "downstream", dsp_ctl), _port(up, "upstream", (), False, ()), root],
        }
    return out


def test_kernel_isolation_rules_per_port_type() -> None:
    """pci_acs_enabled(): root/downstream ports need SV RR CR UF; a single-function upstream port never;
    a bit the port does not implement counts as on; an unreadable port is unknown, not isolated."""
    assert acs.Port("a", "upstream", present=False).isolates() is True
    assert acs.Port("a", "root", present=False).isolates() is False
    assert (
        acs.Port("a", "downstream", present=True, cap=CAP, ctl=("SrcValid", "ReqRedir")).isolates() is False
    )
    assert acs.Port("a", "downstream", present=True, cap=("SrcValid",), ctl=("SrcValid",)).isolates() is True
    assert acs.Port("a", "downstream", present=True, cap=CAP, ctl=FULL).isolates() is True
    assert acs.Port("a", None).isolates() is None
    assert acs.Port("a", "upstream", multifunction=True, present=False).isolates() is False
    gap = acs.isolation_gaps(acs.parse_paths(_paths(root_acs=False))["0000:3a:00.0"])
    assert [p.bdf for p in gap] == ["0000:37:01.0"]
    assert gap[0].describe() == "0000:37:01.0 (root port): no ACS capability"


def test_redirect_only_for_pairs_that_turn_in_a_switch() -> None:
    paths = acs.parse_paths(_paths())
    r = acs.redirect(paths, "0000:17:00.0", "0000:18:00.0")
    assert r is not None and r.switch == "0000:15:00.0" and r.ports == ("0000:16:00.0", "0000:16:01.0")
    assert acs.redirect(paths, "0000:17:00.0", "0000:3a:00.0") is None  # different root ports
    assert acs.redirect(acs.parse_paths(_paths(redirect=False)), "0000:17:00.0", "0000:18:00.0") is None
    assert acs.parse_paths({"error": "x"}) == {} and acs.parse_paths(None) == {}
    hostile = {
        "0000:17:00.0": {
            "driver": "nvidia",
            "ports": [_port("$(reboot)", "root"), _port("0000:16:00.0", "<b>")],
        },
        "../../etc": {"driver": "nvidia", "ports": []},
    }
    parsed = acs.parse_paths(hostile)
    assert list(parsed) == ["0000:17:00.0"] and [p.bdf for p in parsed["0000:17:00.0"].ports] == [
        "0000:16:00.0"
    ]
    assert parsed["0000:17:00.0"].ports[0].type is None and parsed["0000:17:00.0"].ports[0].isolates() is None


def test_plan_names_redirected_pairs_with_the_boot_option_and_its_cost() -> None:
    plan = make_plan(gpus_from(FACTS), kernel=KERNEL, paths=acs.parse_paths(_paths()))
    assert [(r.a, r.b) for r in plan.redirects] == [
        ("0000:17:00.0", "0000:18:00.0"),
        ("0000:3a:00.0", "0000:3b:00.0"),
    ]
    assert "ACS redirect: 2 pair(s)" in plan.summary()
    text = redirect_advice(plan.redirects)
    assert "identity domains alone do not restore direct P2P" in text
    assert "pci=disable_acs_redir=0000:16:00.0;0000:16:01.0;0000:39:00.0;0000:39:01.0" in text
    assert "pci_std_enable_acs()" in text and "one IOMMU group" in text and "aaca43fda742" in text
    assert make_plan(gpus_from(FACTS), kernel=KERNEL).redirects == []  # no pci_paths fact: nothing claimed


def _shared_facts() -> dict[str, Any]:
    """3a:00.0 on nvidia and 3b:00.0 (a VM's) in one group 14 below root port 37:01.0 without ACS."""
    facts = copy.deepcopy(FACTS)
    members = [
        {
            "bdf": "0000:37:01.0",
            "class": "0x060400",
            "vendor": "0x8086",
            "driver": "pcieport",
            "iommu_group": 14,
        },
        {
            "bdf": "0000:38:00.0",
            "class": "0x060400",
            "vendor": "0x1000",
            "driver": "pcieport",
            "iommu_group": 14,
        },
        {
            "bdf": "0000:3a:00.0",
            "class": "0x030200",
            "vendor": "0x10de",
            "driver": "nvidia",
            "iommu_group": 14,
        },
        {
            "bdf": "0000:3a:00.1",
            "class": "0x040300",
            "vendor": "0x10de",
            "driver": "snd_hda_intel",
            "iommu_group": 14,
        },
        {
            "bdf": "0000:3b:00.0",
            "class": "0x030200",
            "vendor": "0x10de",
            "driver": "vfio-pci",
            "iommu_group": 14,
        },
        {
            "bdf": "0000:3b:00.1",
            "class": "0x040300",
            "vendor": "0x10de",
            "driver": "vfio-pci",
            "iommu_group": 14,
        },
    ]
    for g in facts["gpus"]:
        if g["bdf"] in ("0000:3a:00.0", "0000:3b:00.0"):
            g["iommu_group"] = 14
            g["group_members"] = copy.deepcopy(members)
            if g["bdf"] == "0000:3b:00.0":
                g["driver"], g["minor"] = "vfio-pci", None
    return facts


def test_group_shared_with_a_vms_device_is_refused_naming_both_and_the_port() -> None:
    plan = make_plan(gpus_from(_shared_facts()), kernel=KERNEL, paths=acs.parse_paths(_paths(root_acs=False)))
    assert "0000:3a:00.0" not in plan.gpus and 14 not in [g.number for g in plan.groups]
    why = plan.excluded["0000:3a:00.0"]
    assert "group 14 holds 0000:3a:00.0 (nvidia) and 0000:3b:00.0, 0000:3b:00.1 (vfio-pci, a VM's)" in why
    assert "ACS missing on 0000:37:01.0 (root port): no ACS capability" in why
    assert "never touched" in why and plan.shared[14] in plan.summary()
    assert "enable ACS for that port in the BIOS" in why and "give the whole group to one side" in why
    assert "pcie_acs_override" in why and "without the IOMMU seeing it" in why
    touched = {f.bdf for g in plan.groups for f in g.functions}
    assert not touched & {"0000:3b:00.0", "0000:3b:00.1", "0000:3a:00.0"}
    named = make_plan(gpus_from(_shared_facts()), kernel=KERNEL, selected=["0000:3a:00.0"])
    assert any("0000:3a:00.0" in e and "refusing" in e for e in named.errors)


def test_pcieport_members_stay_bound_from_6_4_and_block_before() -> None:
    facts = _shared_facts()
    for g in facts["gpus"]:
        for m in g.get("group_members", []):
            if m["bdf"].startswith("0000:3b:00"):
                m["driver"] = "nvidia" if m["bdf"].endswith(".0") else "snd_hda_intel"
        if g["bdf"] == "0000:3b:00.0":
            g["driver"], g["minor"] = "nvidia", 3
    plan = make_plan(gpus_from(facts), kernel=KERNEL)
    g14 = next(g for g in plan.groups if g.number == 14)
    assert g14.kept == ["0000:37:01.0 (pcieport)", "0000:38:00.0 (pcieport)"]
    assert [f.bdf for f in g14.unbind_order] == [
        "0000:3a:00.0",
        "0000:3b:00.0",
        "0000:3a:00.1",
        "0000:3b:00.1",
    ]
    old = make_plan(gpus_from(facts), kernel="6.1.0-18-amd64")
    # 5.11-6.3: a group of several devices cannot change; every member counts (pcieport too)
    assert old.errors and "group 14: 0000:37:01.0, 0000:38:00.0, 0000:3a:00.0" in old.errors[0]


def _config(ptype: int, acs_ctl: int | None, size: int = 4096) -> bytes:
    c = bytearray(max(size, 0x44))
    c[0x06] = 0x10
    c[0x34] = 0x40
    c[0x40], c[0x42] = 0x10, 0x2 | (ptype << 4)
    if acs_ctl is not None and size > 0x108:
        c[0x100:0x104] = (0x000D | (1 << 16)).to_bytes(4, "little")
        c[0x104:0x106] = (0x5F).to_bytes(2, "little")
        c[0x106:0x108] = acs_ctl.to_bytes(2, "little")
    return bytes(c[:size])


def test_probe_reads_port_type_and_acs_from_config_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for bdf, data in (
        ("0000:16:00.0", _config(6, 0x1D)),
        ("0000:37:01.0", _config(4, None)),
        ("0000:38:00.0", _config(5, None, 64)),  # not root: 64 bytes of config space
    ):
        (tmp_path / bdf).mkdir()
        (tmp_path / bdf / "config").write_bytes(data)
    monkeypatch.setattr(probe_pci_path, "SYS_PCI", str(tmp_path))
    dsp = probe_pci_path.port("0000:16:00.0")
    assert dsp["type"] == "downstream" and dsp["acs"]["ctl"] == list(FULL)
    assert "TransBlk" in dsp["acs"]["cap"] and dsp["acs"]["present"]
    rp = probe_pci_path.port("0000:37:01.0")
    assert rp["type"] == "root" and rp["acs"] == {"present": False, "cap": [], "ctl": []}
    assert probe_pci_path.port("0000:38:00.0") == {
        "bdf": "0000:38:00.0",
        "type": None,
        "multifunction": False,
        "acs": None,
    }


# ---------------------------------------------------------------------------------------------- lab


def _report_text(run: Any) -> str:
    return run.output + json.dumps(run.doc)


def test_vm_device_in_the_gpus_group_is_refused_and_never_touched(lab: Any, tmp_path: Path) -> None:
    """Root port 37:01.0 without ACS: 3a:00.0 (nvidia) shares group 14 with the VM's 3b:00.0. The run
    repairs groups 30 and 31, refuses group 14 naming both devices and the port, never writes anything
    of 3b:00 or group 14, and says that ACS redirect keeps 17:00.0 <-> 18:00.0 on the root complex."""
    from gpulab.profiles.p2p_variants import rtx6000_root_port_without_acs

    host = lab.host(rtx6000_root_port_without_acs(), name=f"p2pacs-{os.getpid()}")
    run = run_suite(host, tmp_path)
    text = _report_text(run)
    assert "group 14 holds 0000:3a:00.0 (nvidia) and 0000:3b:00.0, 0000:3b:00.1 (vfio-pci, a VM's)" in text, (
        text[-4000:]
    )
    assert "ACS missing on 0000:37:01.0 (root port): no ACS capability" in text
    for w in run.writes():
        where = f"{w.get('path')} {w.get('value')}"
        assert "0000:3b:00" not in where and "iommu_groups/14/" not in where and "0000:3a:00" not in where, w
    assert (
        sh(host, "cat /sys/kernel/iommu_groups/30/type /sys/kernel/iommu_groups/31/type").split()
        == ["identity"] * 2
    )
    assert sh(host, "cat /sys/kernel/iommu_groups/14/type") == "DMA-FQ"
    drivers = sh(
        host,
        "for b in 3b:00.0 3b:00.1 17:00.0 18:00.0; do basename $(readlink /sys/bus/pci/devices/0000:$b/driver); done",
    )
    assert drivers.split() == ["vfio-pci", "vfio-pci", "nvidia", "nvidia"]
    # every switch port has ReqRedir/CmpltRedir on (the kernel's boot default): step 1 names the pair under
    # switch 15:00.0; the lab's tools give it no P2P, so step 6 fails and says why
    assert "identity domains alone do not restore direct P2P for 0000:17:00.0 <-> 0000:18:00.0" in json.dumps(
        run.tests["test_plan"]
    )
    assert "pci=disable_acs_redir=0000:16:00.0;0000:16:01.0" in text
    if run.outcomes["test_p2p_bandwidth"] == "failed":
        assert "identity domains alone do not restore direct P2P" in json.dumps(
            run.tests["test_p2p_bandwidth"]
        )
    host.down()


def test_pcieport_stays_bound_while_the_group_changes_on_6_4_plus(lab: Any, tmp_path: Path) -> None:
    """Kernel 6.8: group 14 holds the root port, the switch and GPUs 2-3; pcieport does not count in
    group->owner_cnt, so only the GPUs and their audio are unbound and the type write succeeds."""
    from gpulab.profiles.p2p_variants import rtx6000_root_port_without_acs

    host = lab.host(rtx6000_root_port_without_acs(vm_gpu=None), name=f"p2ppcie-{os.getpid()}")
    run = run_suite(host, tmp_path)
    unbinds = [w for w in run.writes() if str(w.get("path", "")).endswith("/unbind")]
    assert unbinds, run.output[-3000:]
    assert not [w for w in unbinds if "pcieport" in str(w.get("path"))], unbinds
    assert any(
        str(w.get("path", "")).endswith("iommu_groups/14/type") and w.get("errno") == 0 for w in run.writes()
    )
    assert sh(host, "cat /sys/kernel/iommu_groups/14/type") == "identity"
    drivers = sh(
        host,
        "for b in 37:01.0 38:00.0 3a:00.0 3b:00.0; do basename $(readlink /sys/bus/pci/devices/0000:$b/driver); done",
    )
    assert drivers.split() == ["pcieport", "pcieport", "nvidia", "nvidia"]
    assert "stay bound: from kernel 6.4" in _report_text(run)
    host.down()


def test_kernel_5_10_type_file_is_read_only_and_nothing_is_touched(lab: Any, tmp_path: Path) -> None:
    """5.2-5.10: /sys/kernel/iommu_groups/N/type is readable, its write fails with EACCES even as root:
    the run says so (and what to do) before anything is stopped or written."""
    from gpulab.profiles.load import load_profile

    host = lab.host(
        load_profile("proxmox-rtx6000", {"kernel": "5.10.0-28-amd64"}), name=f"p2p510-{os.getpid()}"
    )
    assert sh(host, "cat /sys/kernel/iommu_groups/30/type") == "DMA"
    run = run_suite(host, tmp_path)
    assert run.rc != 0 and run.outcomes["test_plan"] == "failed", run.outcomes
    assert "(5.2-5.10) shows /sys/kernel/iommu_groups/N/type read-only" in run.output, run.output[-3000:]
    assert "EACCES even as root" in run.output and "iommu=pt" in run.output
    assert run.record == [], run.record
    host.down()


def test_lab_grouping_counts_unimplemented_acs_bits_as_on() -> None:
    """gpulab.kernel.acs follows pci_acs_flags_enabled(): a downstream port that implements only SV and UF,
    both on, isolates (RR/CR are hard-wired); one without the capability does not."""
    import dataclasses

    from gpulab.kernel import acs
    from gpulab.profiles.p2p_variants import rtx6000_root_port_without_acs

    base = rtx6000_root_port_without_acs(vm_gpu=None)

    def group_of(cap: tuple[str, ...], ctl: tuple[str, ...]) -> set[str]:
        pci = tuple(dataclasses.replace(f, acs_cap=cap) if f.bdf == "0000:16:00.0" else f for f in base.pci)
        prof = dataclasses.replace(base, pci=pci)
        parts = acs.kernel_group_partition(
            prof,
            lambda b: ctl if b == "0000:16:00.0" else acs.boot_acs_ctl(prof, prof.function(b)),
        )
        return next(s for s in parts if "0000:17:00.0" in s)

    sv_uf = ("SrcValid", "UpstreamFwd")
    assert group_of(sv_uf, sv_uf) == {"0000:17:00.0", "0000:17:00.1"}
    assert "0000:16:00.0" in group_of(sv_uf, ("SrcValid",))
    assert "0000:16:00.0" in group_of((), ())


@pytest.mark.parametrize(
    ("driver", "needle"),
    [
        ("vfio-pci", "a user claimed the group: a VM holds 0000:17:00.0 through vfio"),
        ("pcieport", "another user claimed the group"),
        ("nvidia", "bound to a driver that uses the kernel DMA API: 0000:17:00.0 (nvidia)"),
    ],
)
def test_eperm_from_6_4_says_what_counts_in_owner_cnt(driver: str, needle: str) -> None:
    import errno as e

    from pytest_gpuhost.modules import iommu
    from pytest_gpuhost.modules.pci import PciFunction
    from tests.p2p.test_p2p_plan import _Writer

    group = iommu.IommuGroup(30, "DMA-FQ", [PciFunction("0000:17:00.0", driver=driver)])
    with pytest.raises(iommu.IommuError) as err:
        iommu.set_type(_Writer(e.EPERM), group, "identity", kernel="6.8.12-4-pve")
    assert needle in str(err.value) and "vfio-pci, pci-stub and pcieport never count" in str(err.value)
    assert iommu.blocks_type_change(driver, "6.8.12-4-pve") is (driver == "nvidia")
    assert iommu.blocks_type_change(driver, "6.1.0-18-amd64") is True

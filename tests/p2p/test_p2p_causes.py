"""The P2P diagnosis (modules/p2p_causes.py): verdicts from facts, parsers on real captures, the probe.

Real captures are in fixtures/outputs/ (README there says where each comes from): `nvidia-smi -q`
BAR1 sections, p2pBandwidthLatencyTest and nvbandwidth latency matrices. No public capture of an
NCCL 2.31 diagnostics report with a failing pair exists yet: the parser is tested on the format
NCCL's user guide documents ("NCCL DIAG [OK] ...", "[INFO] p2p: only 52/56 ...") and on lines in
the failure shapes RCCL's test of the inherited feature looks for.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_p2p_causes
from pytest_gpuhost.modules import acs, nccl, p2p, p2p_causes, p2p_reports
from pytest_gpuhost.run.options import BadValue
from suites.p2p.collective import nccl_diagnostics
from suites.p2p.options import _expect

OUT = Path(__file__).resolve().parents[2] / "fixtures" / "outputs"
G = ["0000:17:00.0", "0000:18:00.0", "0000:3a:00.0", "0000:3b:00.0"]
GEN5 = {
    "current_link_speed": "32.0 GT/s PCIe",
    "current_link_width": "16",
    "max_link_speed": "32.0 GT/s PCIe",
    "max_link_width": "16",
}
AER0 = {"aer_dev_fatal": {"SDES": 0, "TOTAL_ERR_FATAL": 0}, "aer_dev_nonfatal": {"SDES": 0}}


def fact(**over: Any) -> dict[str, Any]:
    """A healthy `p2p_causes` fact of the rtx6000 tree (two switches on one NUMA node)."""
    chains = {
        G[0]: ["0000:16:00.0", "0000:15:00.0", "0000:14:01.0"],
        G[1]: ["0000:16:01.0", "0000:15:00.0", "0000:14:01.0"],
        G[2]: ["0000:39:00.0", "0000:38:00.0", "0000:37:01.0"],
        G[3]: ["0000:39:01.0", "0000:38:00.0", "0000:37:01.0"],
    }
    gpus = {
        b: {
            "driver": "nvidia",
            "bar1": 128 << 30,
            "numa_node": 0,
            "link": dict(GEN5),
            "aer": AER0,
            "ports": c,
        }
        for b, c in chains.items()
    }
    ports = {
        p: {"power_control": "on", "runtime_status": "active", "link": dict(GEN5), "aer": AER0}
        for c in chains.values()
        for p in c
    }
    base = {
        "gpus": gpus,
        "ports": ports,
        "cmdline": "BOOT_IMAGE=/vmlinuz ro intel_iommu=on iommu=pt pcie_port_pm=off pcie_aspm=off",
        "uvm_loaded": True,
        "uvm_disable_hmm": "Y",
        "modprobe": {"/etc/modprobe.d/nvidia-uvm.conf": "options nvidia_uvm uvm_disable_hmm=1\n"},
    }
    base.update(over)
    return base


def found(d: p2p_causes.Diagnosis) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in d.found:
        out.setdefault(c.cause, []).append(c.where)
    return out


def test_a_healthy_host_has_every_cause_checked_and_none_found() -> None:
    rw = {(a, b): {"r": "OK", "w": "OK"} for i, a in enumerate(G) for b in G[i + 1 :]}
    d = p2p_causes.diagnose(
        fact(), G, group_types=dict.fromkeys(G, "identity"), p2p_rw=rw, loaded_links=dict.fromkeys(G, GEN5)
    )
    assert d.found == []
    assert {c.cause for c in d.causes} == {
        "IOMMU mode",
        "ACS redirect",
        "BAR1 size",
        "HMM in nvidia_uvm",
        "PCIe port PM / ASPM",
        "port runtime PM",
        "AER Surprise Down",
        "link under load",
        "driver P2P capability",
        "NUMA placement",
    }
    assert d.summary().endswith("none found")
    assert not d.uvm_fix and d.cmdline_add == []
    assert d.table()["columns"] == ["cause", "where", "verdict", "fact read", "fix", "by"]


def test_each_cause_found_from_its_fact() -> None:
    f = fact(cmdline="ro quiet intel_iommu=on", uvm_disable_hmm="N", modprobe={})
    f["gpus"][G[0]]["bar1"] = 256 << 20
    f["ports"]["0000:16:00.0"]["power_control"] = "auto"
    f["ports"]["0000:14:01.0"]["aer"] = {"aer_dev_fatal": {"SDES": 4}, "aer_dev_nonfatal": {"SDES": 1}}
    red = acs.Redirect(G[2], G[3], "0000:38:00.0", ["0000:39:00.0", "0000:39:01.0"])
    rw = {(G[0], G[1]): {"r": "NS", "w": "OK"}}
    loaded = {G[1]: dict(GEN5, current_link_speed="16.0 GT/s PCIe", current_link_width="8")}
    d = p2p_causes.diagnose(
        f, G, group_types={G[0]: "DMA-FQ"}, redirects=[red], p2p_rw=rw, memory_mib=dict.fromkeys(G, 97887),
        loaded_links=loaded,
    )  # fmt: skip
    got = found(d)
    assert got["IOMMU mode"] == [G[0]]
    assert got["ACS redirect"] == [f"{G[2]} <-> {G[3]}"]
    assert got["BAR1 size"] == [G[0]]
    assert got["HMM in nvidia_uvm"] == ["host"] and d.uvm_fix
    assert got["PCIe port PM / ASPM"] == ["cmdline"] and d.cmdline_add == [
        "pcie_port_pm=off",
        "pcie_aspm=off",
    ]
    assert got["port runtime PM"] == ["0000:16:00.0"]
    assert got["AER Surprise Down"] == ["0000:14:01.0"]
    assert got["link under load"] == [G[1]]
    assert got["driver P2P capability"] == [f"{G[0]} <-> {G[1]}"]
    by = {(c.cause, c.where): c for c in d.causes}
    assert by[("AER Surprise Down", "0000:14:01.0")].fact.startswith("5 Surprise Down")
    assert "Re-Size BAR Support" in by[("BAR1 size", G[0])].fix and by[("BAR1 size", G[0])].who == "BIOS"
    assert "pci=disable_acs_redir=0000:39:00.0;0000:39:01.0" in by[("ACS redirect", f"{G[2]} <-> {G[3]}")].fix
    assert by[("PCIe port PM / ASPM", "cmdline")].fix.endswith("then reboot")


def test_bar1_smaller_than_memory_is_found_even_above_256_mib() -> None:
    f = fact()
    f["gpus"][G[0]]["bar1"] = 32 << 30  # a fixed 32 GiB BAR1 on a 96 GiB card
    d = p2p_causes.diagnose(f, G, memory_mib=dict.fromkeys(G, 97887))
    assert found(d)["BAR1 size"] == [G[0]]


def test_bar1_from_nvidia_smi_when_sysfs_has_none() -> None:
    f = fact()
    f["gpus"][G[0]]["bar1"] = None
    smi = p2p_reports.parse_smi_bar1(
        "GPU 00000000:17:00.0\n    FB Memory Usage\n        Total : 97887 MiB\n"
        + (OUT / "nvidia-smi-q-bar1-256mib-595.txt").read_text()
    )
    d = p2p_causes.diagnose(f, G, smi_bar1=smi)
    (c,) = [c for c in d.causes if c.cause == "BAR1 size" and c.where == G[0]]
    assert c.verdict == "found" and "nvidia-smi -q BAR1 Total" in c.fact and "97887 MiB" in c.fact


def test_hmm_verdicts_loaded_and_configured() -> None:
    def hmm(**kw: Any) -> p2p_causes.Cause:
        d = p2p_causes.diagnose(fact(**kw), G)
        (c,) = [c for c in d.causes if c.cause == "HMM in nvidia_uvm"]
        return c

    assert hmm().verdict == "ok"
    # configured, not yet loaded that way: found (the file is there; it applies at the next load)
    c = hmm(uvm_disable_hmm="N")
    assert c.verdict == "found" and "next boot" in c.fix and p2p_causes.UVM_CONF not in c.fix
    # loaded with HMM off by hand, nothing for the next load: found, the file is written
    c = hmm(modprobe={})
    assert c.verdict == "found" and f"write {p2p_causes.UVM_CONF}" in c.fix
    # a driver without the parameter: unknown, never "broken"
    c = hmm(uvm_disable_hmm=None, modprobe={})
    assert c.verdict == "unknown" and c.who == "operator"
    c = hmm(uvm_loaded=False, uvm_disable_hmm=None, modprobe={})
    assert c.verdict == "unknown" and "nvidia_uvm not loaded" in c.fact
    # configured on explicitly in a later file
    c = hmm(
        modprobe={
            "/etc/modprobe.d/a.conf": "options nvidia_uvm uvm_disable_hmm=1\n",
            "/etc/modprobe.d/z.conf": "options nvidia-uvm uvm_disable_hmm=0 # later wins\n",
        }
    )
    assert c.verdict == "found" and "z.conf" in c.fact


def test_modprobe_order_etc_hides_lib_and_last_option_wins() -> None:
    confs = {
        "/etc/modprobe.d/nvidia.conf": "options nvidia_uvm uvm_disable_hmm=1\n",
        "/lib/modprobe.d/nvidia.conf": "options nvidia_uvm uvm_disable_hmm=0\n",  # hidden by /etc's
        "/lib/modprobe.d/50-x.conf": "# options nvidia_uvm uvm_disable_hmm=0\noptions nvidia other=1\n",
    }
    assert p2p_causes.modprobe_uvm_value(confs) == ("1", "/etc/modprobe.d/nvidia.conf")
    assert p2p_causes.modprobe_uvm_value({}) == (None, "")
    bad = {"/etc/modprobe.d/q.conf": 'options nvidia_uvm uvm_disable_hmm="1\n'}  # unbalanced quote
    assert p2p_causes.modprobe_uvm_value(bad)[1] == "/etc/modprobe.d/q.conf"


def test_hostile_strings_are_escaped_on_one_line() -> None:
    f = fact(
        uvm_disable_hmm="N",
        modprobe={"/etc/modprobe.d/x\n\x1b[2J.conf": "options nvidia_uvm uvm_disable_hmm=0"},
    )
    f["ports"]["0000:16:00.0"]["power_control"] = "auto\x1b]0;pwned\x07"
    d = p2p_causes.diagnose(f, G)
    for row in d.table()["rows"]:
        for cell in row:
            assert "\x1b" not in cell and "\n" not in cell and "\x07" not in cell, row


def test_vm_gpus_are_listed_as_excluded_and_never_judged() -> None:
    f = fact()
    f["gpus"]["0000:9a:00.0"] = dict(f["gpus"][G[0]], bar1=256 << 20, driver="vfio-pci")
    d = p2p_causes.diagnose(f, G, excluded={"0000:9a:00.0": "on vfio-pci (belongs to a VM): never touched"})
    assert [c.cause for c in d.causes if c.where == "0000:9a:00.0"] == ["scope"]
    assert not any("9a:00" in c.where for c in d.causes if c.cause != "scope")


def test_placement_and_expectation_per_pair() -> None:
    f = fact()
    f["gpus"][G[3]] = dict(
        f["gpus"][G[3]], numa_node=1, ports=["0000:99:00.0", "0000:98:00.0", "0000:97:01.0"]
    )
    gp, ports = f["gpus"], f["ports"]
    assert p2p_causes.placement(G[0], G[1], gp, ports) == "same switch"
    assert p2p_causes.placement(G[0], G[2], gp, ports) == "same NUMA node"
    assert p2p_causes.placement(G[0], G[3], gp, ports) == "across NUMA nodes"
    rp = copy.deepcopy(gp)
    rp[G[1]]["ports"] = ["0000:14:01.0"]  # directly below the same root port
    assert p2p_causes.placement(G[0], G[1], rp, ports) == "same root port"
    e = p2p_causes.expectation(G[0], G[3], gp, ports)
    assert (e.placement, e.link_gbps, e.gbps) == ("across NUMA nodes", 63.0, 39.1)
    assert "39-51 GB/s" in e.source
    e = p2p_causes.expectation(G[0], G[3], gp, ports, overrides={"across NUMA nodes": 0.5})
    assert e.gbps == 31.5 and "override" in e.source
    # the link both trained to: a GPU that came up at Gen4 x8 halves the pair's expectation
    slow = {G[1]: dict(GEN5, current_link_speed="16.0 GT/s PCIe", current_link_width="8")}
    assert p2p_causes.expectation(G[0], G[1], gp, ports, links=slow).link_gbps == 15.8


def test_judge_uses_the_placement_expectation_but_keeps_nvlink() -> None:
    m = p2p.P2PMatrix([G[0], G[1]], {(G[0], G[1]): 30.0, (G[1], G[0]): 30.0}, "test")
    m.capability = {(G[0], G[1]): "OK", (G[1], G[0]): "OK"}
    links = {
        b: {"speed": "32.0 GT/s PCIe", "width": 16, "max_speed": "32.0 GT/s PCIe", "max_width": 16} for b in G
    }
    plain = p2p.judge(m, links)
    assert plain[0].threshold == 31.5 and not plain[0].ok  # half of 63 GB/s: 30 fails
    placed = p2p.judge(m, links, placed={frozenset((G[0], G[1])): 39.1})
    assert placed[0].threshold == 19.6 and placed[0].ok  # half of the cross-socket 39.1
    nv = p2p.judge(m, links, placed={frozenset((G[0], G[1])): 39.1}, topo={(G[0], G[1]): "NV4"})
    assert nv[0].expected == 100.0


def test_latency_from_p2p_bandwidth_latency_test_and_nvbandwidth() -> None:
    four = (OUT / "p2pBandwidthLatencyTest-4gpu-latency.txt").read_text()
    lat = p2p_reports.latency_us(four)
    assert lat[(0, 1)] == 2.31 and lat[(3, 2)] == 2.23 and (0, 0) not in lat  # P2P=Enabled block
    assert {p2p_reports.latency_verdict(v) for v in lat.values()} == {"on"}
    disabled = four.split("P2P=Enabled")[0]
    off = p2p_reports.latency_us(disabled)
    assert off[(0, 1)] == 14.95 and {p2p_reports.latency_verdict(v) for v in off.values()} == {"off"}
    h100 = p2p_reports.latency_us((OUT / "p2pBandwidthLatencyTest-h100x8-latency.txt").read_text())
    assert len(h100) == 56 and max(h100.values()) == 3.35
    nvb = p2p_reports.latency_us((OUT / "nvbandwidth-h100x8-v0.10-latency-sm.txt").read_text())
    assert len(nvb) == 56 and nvb[(0, 1)] == 0.826 and nvb[(7, 3)] == 0.822
    assert p2p_reports.latency_verdict(6.0) == "unknown" and p2p_reports.latency_verdict(None) == "unknown"


def test_bar1_sections_of_real_nvidia_smi_q() -> None:
    assert p2p_reports.parse_smi_bar1((OUT / "nvidia-smi-q-bar1-256mib-595.txt").read_text()) == {
        "#0": {"bar1_mib": 256}
    }
    got = p2p_reports.parse_smi_bar1((OUT / "nvidia-smi-q-bar1-rtx4090-32gib-530.txt").read_text())
    assert got == {"#0": {"bar1_mib": 32768}, "#1": {"bar1_mib": 32768}}
    full = (OUT / "nvidia-smi-q-550.90.12-h200-tlimit.txt").read_text()
    assert all("bar1_mib" not in v for v in p2p_reports.parse_smi_bar1(full).values())


def test_nccl_diagnostics_documented_reports() -> None:
    ok = p2p_reports.parse_nccl_diag((OUT / "nccl-diag-2.31-documented.txt").read_text())
    assert ok.present and ok.ok and "56 peer accesses" in ok.summary
    part = p2p_reports.parse_nccl_diag((OUT / "nccl-diag-2.31-partial-documented.txt").read_text())
    assert part.present and not part.ok and "52/56" in part.describe()
    none = p2p_reports.parse_nccl_diag("NCCL INFO NCCL version 2.21.5+cuda12.4\n")
    assert not none.present
    # failure lines in the shapes RCCL's test of the feature matches (no public capture names a pair yet)
    text = (
        "h:1 NCCL DIAG [INFO] p2p: write mismatch GPU 1 (0000:18:00.0) -> GPU 2 (0000:3a:00.0)\n"
        "h:1 NCCL DIAG [INFO] p2p: read mismatch rank 0 -> rank 3\n"
    )
    bad = p2p_reports.parse_nccl_diag(text)
    assert bad.pairs == [("0000:18:00.0", "0000:3a:00.0"), ("rank 0", "rank 3")]


def test_nccl_diagnostics_name_failing_pairs_by_pci_address() -> None:
    arm = nccl.Arm("P2P", list(G), ["all_reduce_perf"], {}, 120.0)
    arm.diag = ["h:1 NCCL DIAG [INFO] p2p: read mismatch rank 0 -> rank 3"]
    assert nccl_diagnostics(arm) == (
        f"NCCL diagnostics report failing P2P: {G[0]} (rank 0) <-> {G[3]} (rank 3): "
        "[INFO] p2p: read mismatch rank 0 -> rank 3"
    )
    arm.diag = []
    arm.result.nccl_version = "2.28.9+cuda12.9"
    assert "no report (NCCL 2.28.9+cuda12.9; the report needs NCCL 2.31" in nccl_diagnostics(arm)


def test_expect_option() -> None:
    assert _expect("same-switch=0.9, across-numa-nodes=0.5") == {"same switch": 0.9, "across NUMA nodes": 0.5}
    with pytest.raises(BadValue, match="not a placement"):
        _expect("same-rack=0.5")
    with pytest.raises(BadValue, match="between 0.01 and 1"):
        _expect("same-switch=3")


def test_probe_reads_bar1_aer_and_modprobe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res = "0x00000000f0000000 0x00000000f0ffffff 0x0000000000040200\n0x0000200000000000 0x000020000fffffff 0x000000000014220c\n"
    assert probe_p2p_causes.bar1_bytes(res) == 256 << 20
    assert probe_p2p_causes.bar1_bytes("") is None
    assert probe_p2p_causes.bar1_bytes("x\n0x0 0x0 0x0\n") is None
    assert probe_p2p_causes.aer_counts("SDES 2\nTLP 0\nTOTAL_ERR_FATAL 2\n") == {
        "SDES": 2,
        "TLP": 0,
        "TOTAL_ERR_FATAL": 2,
    }
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "a.conf").write_text("options nvidia_uvm uvm_disable_hmm=1\n")
    (etc / "b.conf").write_text("blacklist nouveau\n")
    monkeypatch.setattr(probe_p2p_causes, "MODPROBE_DIRS", (str(etc),))
    assert probe_p2p_causes.modprobe_confs() == {
        str(etc / "a.conf"): "options nvidia_uvm uvm_disable_hmm=1\n"
    }

"""suites/p2p's diagnosis of every cause of slow or broken P2P, against lab variants of the seed's host.

Each variant of `proxmox-rtx6000` (gpulab/profiles/p2p_variants.py) carries one cause, or all of
them: BAR1 256 MiB (Resizable BAR off), nvidia_uvm with HMM (the collective hangs), port runtime
PM with a Surprise Down history, GPUs across sockets. The suite runs in a subprocess over real
SSH as an operator runs it; what it found is read from its JSON report (the "P2P diagnosis"
table of step 1), what it changed from the lab's record and the host over SSH.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gpulab.profiles import p2p_variants
from pytest_gpuhost.modules import p2p_causes
from tests.p2p.test_p2p_suite import CUT_PLUGIN, NVIDIA, STEPS, Run, assert_vfio_untouched, run_suite, sh

CAUSES = (
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
)


def table(run: Run) -> list[dict[str, str]]:
    """The diagnosis table of step 1, as dicts by column."""
    states = run.evidence("test_plan").get("states", [])
    found = [s["value"] for s in states if s["label"] == "P2P diagnosis"]
    assert found, f"no diagnosis table in step 1's evidence: {[s['label'] for s in states]}"
    cols = found[-1]["columns"]
    return [dict(zip(cols, row, strict=True)) for row in found[-1]["rows"]]


def rows(run: Run, cause: str, verdict: str | None = None) -> list[dict[str, str]]:
    return [r for r in table(run) if r["cause"] == cause and (verdict is None or r["verdict"] == verdict)]


def set_faults(host: Any, faults: dict[str, Any]) -> None:
    r = host.ssh(["sh", "-c", "cat > /var/lib/gpulab/faults.json"], input=json.dumps(faults))
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def all_causes(lab: Any) -> Any:
    """The seed's host with every cause at once."""
    return lab.host(p2p_variants.rtx6000_all_causes())


def test_all_causes_check_only_lists_each_and_writes_nothing(all_causes: Any, tmp_path: Path) -> None:
    """--check-only on the host with every cause: the plan names each one with the fact it read and its
    fix, writes nothing, and never judges the VM's GPUs."""
    host = all_causes
    host.reset()
    sh(host, f"rm -f {p2p_causes.UVM_CONF}")
    set_faults(host, {"gpus": {"0000:16:00.0": {"aer": {"surprise_down": 2}}}})
    try:
        run = run_suite(host, tmp_path, "--check-only")
    finally:
        set_faults(host, {})
    assert run.rc != 0
    assert run.record == [], run.record
    assert sh(host, f"test -e {p2p_causes.UVM_CONF} && echo there") == ""  # named, not written
    checked = {r["cause"] for r in table(run)}
    assert set(CAUSES) <= checked, checked
    assert {r["where"] for r in rows(run, "IOMMU mode", "found")} == set(NVIDIA)
    bar1 = rows(run, "BAR1 size", "found")
    assert {r["where"] for r in bar1} == set(NVIDIA)
    assert all("BAR1 256 MiB" in r["fact read"] and "Resizable BAR" in r["fix"] for r in bar1), bar1
    assert all(r["by"] == "BIOS" for r in bar1)
    (hmm,) = rows(run, "HMM in nvidia_uvm", "found")
    assert "loaded uvm_disable_hmm=0" in hmm["fact read"] and p2p_causes.UVM_CONF in hmm["fix"]
    (cmd,) = rows(run, "PCIe port PM / ASPM", "found")
    assert "pcie_port_pm=off" in cmd["fix"] and "reboot" in cmd["fix"]
    pm = rows(run, "port runtime PM", "found")
    assert {"0000:16:00.0", "0000:14:01.0", "0000:39:01.0"} <= {r["where"] for r in pm}
    (sd,) = rows(run, "AER Surprise Down", "found")
    assert sd["where"] == "0000:16:00.0" and sd["fact read"].startswith("2 Surprise Down"), sd
    links = rows(run, "link under load")
    assert {r["where"] for r in links} == set(NVIDIA) and all(r["verdict"] == "ok" for r in links), links
    assert all(r["fact read"] == "32.0 GT/s PCIe x16 of 32.0 GT/s PCIe x16 (read under load)" for r in links)
    placements = {r["fact read"].split(";")[0] for r in rows(run, "NUMA placement")}
    assert placements == {"same switch", "same NUMA node"}, placements
    # the VM's GPUs are out of scope: named as excluded, never judged
    judged = {r["where"] for r in table(run) if r["cause"] != "scope"}
    assert not any(v in w for w in judged for v in ("9a:00", "9b:00", "ba:00", "bb:00")), judged
    out = run.output
    assert "P2P diagnosis: 10 causes checked (IOMMU mode, ACS redirect, BAR1 size," in out, out[-3000:]
    assert f"write {p2p_causes.UVM_CONF}" in out
    assert "add pcie_port_pm=off pcie_aspm=off" in out
    assert "Re-Size BAR Support" in out


def test_all_causes_repair_fixes_what_is_in_scope_and_rerun_passes(all_causes: Any, tmp_path: Path) -> None:
    """The repair sets the groups identity and, with the plan, writes the nvidia_uvm modprobe.d file
    (journaled, read back);
    the BIOS and cmdline causes stay named, nothing of the VM is touched, and a rerun passes."""
    host = all_causes
    host.reset()
    sh(host, f"rm -f {p2p_causes.UVM_CONF}")
    first = run_suite(host, tmp_path)
    assert first.rc == 0, first.output[-4000:]
    assert {first.outcomes[s] for s in STEPS} <= {"passed", "fixed"}, first.outcomes
    assert sh(host, f"cat {p2p_causes.UVM_CONF}") + "\n" == p2p_causes.UVM_CONF_TEXT
    notes = "\n".join(first.evidence("test_plan").get("notes", []))
    assert f"{p2p_causes.UVM_CONF} written: options nvidia_uvm uvm_disable_hmm=1" in notes, notes
    assert "next boot" in notes and f"rm {p2p_causes.UVM_CONF}" in notes
    assert_vfio_untouched(first)
    assert rows(first, "BAR1 size", "found"), "the BIOS cause stays named"
    second = run_suite(host, tmp_path)
    assert second.rc == 0, second.output[-4000:]
    assert set(second.outcomes.values()) == {"passed"}, second.outcomes
    assert second.writes() == [], second.record
    assert rows(second, "IOMMU mode", "ok") and not rows(second, "IOMMU mode", "found")
    (hmm,) = rows(second, "HMM in nvidia_uvm")
    assert f"configured uvm_disable_hmm=1 in {p2p_causes.UVM_CONF}" in hmm["fact read"], hmm


def test_uvm_conf_write_is_journaled_before_it_is_made(all_causes: Any, tmp_path: Path) -> None:
    """A run cut right after it wrote the modprobe.d file leaves the write in the journal (with the file's
    previous state: none); the next run completes the repair and keeps the file as written."""
    host = all_causes
    host.reset()
    sh(host, f"rm -f {p2p_causes.UVM_CONF}")
    try:
        cut = run_suite(
            host,
            tmp_path,
            plugin=CUT_PLUGIN,
            env={"P2P_CUT_AT": p2p_causes.UVM_CONF, "P2P_CUT_HOST": host.name},
        )
    finally:
        host.heal_link()
    deadline = time.monotonic() + 20
    while host.ssh("true").returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "CUT after:" in cut.output, cut.output[-3000:]
    print([line for line in cut.output.splitlines() if "CUT after" in line])
    journal = json.loads(sh(host, "cat /var/lib/gpuhost/journal/p2p.json"))
    (step,) = [s for s in journal["steps"] if "write-uvm-conf" in json.dumps(s)]
    assert p2p_causes.UVM_CONF in json.dumps(step) and '"previous": null' in json.dumps(step), step
    again = run_suite(host, tmp_path, "--p2p-lock-wait=60")
    assert again.rc == 0, again.output[-4000:]
    assert sh(host, f"cat {p2p_causes.UVM_CONF}") + "\n" == p2p_causes.UVM_CONF_TEXT
    assert_vfio_untouched(again)


def test_a_holder_the_run_did_not_start_fails_gpus_released_and_nothing_is_unbound(
    lab: Any, tmp_path: Path
) -> None:
    """A process outside the service holds /dev/nvidia0 (nvidia-persistenced already stopped, so it is
    the only reason): "gpus released" fails naming its pid, never kills it, and nothing is unbound."""
    host = lab.host("proxmox-rtx6000")
    host.reset()
    sh(host, "systemctl stop nvidia-persistenced.service; nvidia-smi -pm 0 >/dev/null 2>&1; true")
    pid = int(sh(host, "setsid sleep 600 </dev/nvidia0 >/dev/null 2>&1 & echo $!"))
    try:
        run = run_suite(host, tmp_path, "--p2p-unbind-timeout=3")
        alive = sh(host, f"kill -0 {pid} && echo alive")
    finally:
        host.ssh(f"kill {pid}")
    assert run.rc != 0
    assert run.outcomes["test_gpus_released"] == "failed", run.outcomes
    assert run.outcomes["test_iommu_groups_identity"] != "fixed", run.outcomes
    failure = run.output[run.output.find("FAILURES") :]
    assert f"pid {pid} (sleep)" in failure, failure[:3000]
    assert alive == "alive"  # reported, never killed
    assert not [w for w in run.writes() if w.get("path", "").endswith("/unbind")], run.writes()
    st = sh(
        host,
        "for b in " + " ".join(NVIDIA) + "; do basename $(readlink /sys/bus/pci/devices/$b/driver); done",
    )
    assert st.split() == ["nvidia"] * 4, st


def test_small_bar1_alone_is_named_with_the_bios_setting(lab: Any, tmp_path: Path) -> None:
    """Resizable BAR off: each in-scope GPU's BAR1 (256 MiB of 96 GiB) is named with the BIOS setting; the
    run changes nothing for it (a BIOS cause), and no other cause is reported found but the IOMMU's."""
    host = lab.host(p2p_variants.rtx6000_small_bar1())
    run = run_suite(host, tmp_path, "--check-only")
    assert run.record == []
    bar1 = rows(run, "BAR1 size", "found")
    assert {r["where"] for r in bar1} == set(NVIDIA)
    assert all("BAR1 256 MiB (sysfs resource region 1), memory 97887 MiB" in r["fact read"] for r in bar1), (
        bar1
    )
    assert all("Re-Size BAR Support" in r["fix"] and r["by"] == "BIOS" for r in bar1)
    assert not rows(run, "HMM in nvidia_uvm", "found") and not rows(run, "port runtime PM", "found")
    assert not rows(run, "AER Surprise Down", "found")


def test_hmm_on_alone_hangs_the_collective_and_is_configured_off(lab: Any, tmp_path: Path) -> None:
    """nvidia_uvm loaded with HMM: the collective hangs over P2P after the IOMMU repair; the diagnosis names
    HMM as loaded; step 1 has written the modprobe.d file by then (it applies at the next boot)."""
    host = lab.host(p2p_variants.rtx6000_hmm_on())
    host.reset()
    sh(host, f"rm -f {p2p_causes.UVM_CONF}")
    run = run_suite(host, tmp_path, "--p2p-nccl-timeout=5")
    (hmm,) = rows(run, "HMM in nvidia_uvm", "found")
    assert "loaded uvm_disable_hmm=0" in hmm["fact read"] and "not configured" in hmm["fact read"], hmm
    assert run.outcomes["test_p2p_collective"] == "failed", run.outcomes
    assert "hung after 5 s" in run.output, run.output[-3000:]
    assert run.outcomes["test_plan"] == "fixed", run.outcomes  # written with the plan, before the collective
    assert sh(host, f"cat {p2p_causes.UVM_CONF}") + "\n" == p2p_causes.UVM_CONF_TEXT
    assert_vfio_untouched(run)


def test_port_pm_with_surprise_down_history_alone(lab: Any, tmp_path: Path) -> None:
    """Port runtime PM on and a Surprise Down history on a root port: each port and the AER count are
    named, with pcie_port_pm=off pcie_aspm=off and the reboot; the boot configuration is never written."""
    host = lab.host(p2p_variants.rtx6000_port_pm())
    set_faults(host, {"gpus": {"0000:37:01.0": {"aer": {"surprise_down": 3}}}})
    try:
        run = run_suite(host, tmp_path, "--check-only")
    finally:
        set_faults(host, {})
    assert run.record == []
    pm = rows(run, "port runtime PM", "found")
    assert {r["where"] for r in pm} == set(p2p_variants.IN_SCOPE_PORTS), pm
    assert all(r["fact read"].startswith("power/control=auto") for r in pm)
    (sd,) = rows(run, "AER Surprise Down", "found")
    assert sd["where"] == "0000:37:01.0" and sd["fact read"].startswith("3 Surprise Down"), sd
    (cmd,) = rows(run, "PCIe port PM / ASPM", "found")
    assert cmd["by"] == "operator (boot configuration, reboot)" and "then reboot" in cmd["fix"], cmd
    assert not rows(run, "BAR1 size", "found") and not rows(run, "HMM in nvidia_uvm", "found")


def test_cross_socket_pairs_get_their_lower_expectation(lab: Any, tmp_path: Path) -> None:
    """GPUs on both sockets: cross-socket pairs are expected lower (0.62 of the link, voipmonitor/rtx6kpro)
    than same-switch ones, so the repair passes on them at the link model's 30 GB/s, the VM's GPUs untouched."""
    host = lab.host(p2p_variants.rtx6000_cross_socket())
    host.reset()
    run = run_suite(host, tmp_path)
    places = {r["where"]: r["fact read"] for r in rows(run, "NUMA placement")}
    assert places["0000:17:00.0 <-> 0000:9a:00.0"].startswith("across NUMA nodes; expect >= 39.1 GB/s"), (
        places
    )
    assert places["0000:17:00.0 <-> 0000:18:00.0"].startswith("same switch; expect >= 52.9 GB/s"), places
    assert run.rc == 0, run.output[-4000:]
    after = run.evidence("test_p2p_bandwidth")["matrices"][0]
    assert after["threshold"] <= 19.6, after["threshold"]
    for w in run.writes():
        text = f"{w.get('path')} {w.get('value')}"
        assert "ba:00" not in text and "bb:00" not in text, w

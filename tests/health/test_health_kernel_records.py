"""Kernel records the driver prints besides plain Xid lines, on real captures (fixtures/outputs).

The probe's parser (exec/agent/probe_health_kernel.py) reads the captures as `dmesg` would give
them; the verdict (modules/health/host.py, xid.py) judges what it found. Each capture's source is
in fixtures/outputs/README.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_health_kernel as probe
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import facts as health_facts
from pytest_gpuhost.modules.health import xid as hm_xid

OUTPUTS = Path(__file__).resolve().parents[2] / "fixtures" / "outputs"


def capture(name: str) -> str:
    return (OUTPUTS / name).read_text()


def events(text: str) -> list[dict[str, Any]]:
    """The probe's Xid events of `text`, one message per line (journal/syslog captures)."""
    xid, _ = probe._events([(float(i), line) for i, line in enumerate(text.splitlines())])
    return xid


def dmesg_lines(text: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str]]:
    """The probe's (epoch, message) lines of `text` as `dmesg` (raw or iso) printed it."""

    def run(argv: list[str], timeout: float, record: list[Any]) -> dict[str, Any]:
        iso = argv[1:] == ["--time-format", "iso"]
        ok = iso == (mode == "iso")
        return {"rc": 0 if ok else 1, "stdout": text if ok else "", "stderr": "", "timed_out": False}

    monkeypatch.setattr(probe, "run_recorded", run)
    monkeypatch.setattr(probe, "_btime", lambda: 1000.0)
    lines, got, failed = probe._dmesg_lines(5.0, [])
    assert failed is None and got == mode
    return lines


def kernel_facts(xid: list[dict[str, Any]], **part: Any) -> dict[str, Any]:
    kl = {"ok": True, "first_run": False, "since": 0.5, "xid": xid, "sxid": [], "cursor": {"boot_id": "b1"}}
    kl.update(part)
    return {"kernel_log": kl}


def judge(facts: dict[str, Any]) -> hm.Verdict:
    return hm.evaluate("xid", facts, hm.Thresholds.from_vars({}))


def test_fallen_off_the_bus_without_an_xid_line_owes_a_reboot(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = dmesg_lines(capture("kernlog-fallen-off-bus-no-xid.txt"), "raw", monkeypatch)
    # The driver's three-line record is one kernel record: its continuation lines stay with it.
    assert len(lines) == 3 and "fallen off the bus" in lines[0][1]
    xid, _ = probe._events(lines)
    assert [(e["code"], e["bdf"], e.get("record")) for e in xid] == [(79, "0000:b3:00", "fallen_off_bus")]
    v = judge(kernel_facts(xid))
    assert not v.ok and v.state["action"] == "reboot" and "0000:b3:00" in v.summary + " ".join(v.reasons)
    owed = (health_facts.commit_state(kernel_facts(xid)) or {})["pending"]
    assert [(p["action"], p["bdf"]) for p in owed] == [("reboot", "0000:b3:00")]


def test_a_continuation_line_stays_with_its_record_in_iso_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (
        "2026-11-30T10:00:00,000000+00:00 NVRM: The NVIDIA GPU 0000:3b:00.0\n"
        "                                 NVRM: (PCI ID: 10de:2335) installed in this system has\n"
        "                                 NVRM: fallen off the bus and is not responding to commands.\n"
        "2026-11-30T10:00:01,000000+00:00 NVRM: The NVIDIA probe routine failed for 1 device(s).\n"
    )
    lines = dmesg_lines(text, "iso", monkeypatch)
    assert len(lines) == 2 and lines[0][1].endswith("not responding to commands.")
    # The cursor key is the record's first line, as before continuation lines were kept.
    assert probe._line_key(*lines[0]) == probe._line_key(lines[0][0], "NVRM: The NVIDIA GPU 0000:3b:00.0")
    assert [e["bdf"] for e in probe._events(lines)[0]] == ["0000:3b:00"]


def test_the_drivers_fallen_off_line_next_to_its_xid_79_counts_once() -> None:
    xid = events(capture("kernlog-fallen-off-bus-595.txt"))
    assert [(e["code"], e["bdf"]) for e in xid] == [(79, "0000:06:00")]
    alone = events("NVRM: GPU 0000:29:00.0: GPU has fallen off the bus.")
    assert [(e["code"], e["bdf"], e.get("record")) for e in alone] == [(79, "0000:29:00", "fallen_off_bus")]


def test_xid_caused_by_a_previous_xid_is_judged_by_the_cause() -> None:
    xid = events(capture("kernlog-xid45-caused-by-previous.txt"))
    assert len(xid) == 7 and {e["code"] for e in xid} == {45}
    assert [e.get("cause") for e in xid[:2]] == [149, 145]
    assert hm_xid.event_action(xid[0]) == ("check_fabric", "NVLINK: NETIR Error (caused by Xid 149)")
    v = judge(kernel_facts(xid))
    assert not v.ok and v.state["action"] == "check_fabric"
    assert "caused by previous Xid 149" in " ".join(v.reasons)
    # A cause milder than the Xid itself never lowers it.
    e = {"code": 48, "msg": "NVRM: Xid (PCI:0000:3a:00): 48, ... caused by previous Xid 13", "cause": 13}
    assert hm_xid.event_action(e)[0] == "reset_gpu"


@pytest.mark.parametrize(
    ("name", "action"),
    [
        ("kernlog-xid154-gpu-reset-required.txt", "reset_gpu"),
        ("kernlog-xid154-node-reboot-required.txt", "reboot"),
        ("kernlog-xid154-os-reboot.txt", "reboot"),
    ],
)
def test_xid_154_is_scored_by_the_recovery_action_it_names(name: str, action: str) -> None:
    xid = [e for e in events(capture(name)) if e["code"] == 154]
    assert len(xid) == 1
    assert hm_xid.event_action(xid[0])[0] == action
    v = judge(kernel_facts(xid))
    assert not v.ok and v.state["action"] == action
    owed = (health_facts.commit_state(kernel_facts(xid)) or {})["pending"]
    assert [p["action"] for p in owed] == [action]


def test_xid_154_actions_by_nvmls_values_and_words() -> None:
    def act(text: str) -> str:
        return hm_xid.event_action({"code": 154, "msg": f"NVRM: Xid (PCI:0000:01:00): 154, {text}"})[0]

    assert act("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)") == "none"
    assert act("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)") == "drain_p2p"
    assert act("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)") == "reset_gpu"
    assert act("GPU recovery action changed from 0x0 (None) to 0x1 (PF FLR)") == "reset_gpu"
    assert act("GPU recovery action changed from 0x0 (None) to 0x9 (Something New)") == "unknown"
    assert act("no action text at all") == "reset_gpu"  # a 154 we cannot read: as the catalogue says


def test_an_xid_154_asking_to_drain_p2p_is_owed() -> None:
    msg = "NVRM: Xid (PCI:0000:3a:00): 154, GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)"
    e = {"ts": 5.0, "bdf": "0000:3a:00", "code": 154, "msg": msg}
    facts = kernel_facts([e])
    v = judge(facts)
    assert not v.ok and v.state["action"] == "drain_p2p" and "P2P" in " ".join(v.reasons)
    owed = (health_facts.commit_state(facts) or {})["pending"]
    assert [p["action"] for p in owed] == ["drain_p2p"]


def test_xid_lines_without_the_pci_prefix_of_older_drivers() -> None:
    xid = events(capture("kernlog-xid-no-pci-prefix-304.txt"))
    assert [e["code"] for e in xid] == [16] * 8 + [8]
    assert {e["bdf"] for e in xid} == {"0000:01:00"}
    assert xid[-1]["msg"].endswith("8, Channel 00000000")

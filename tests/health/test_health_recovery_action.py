"""The GPU recovery action of drivers from 590, in place of reset_status.reset_required.

`nvidia-smi --help-query-gpu` of 590.48.01, 595.71.05 and 610.57.04 lists no
`reset_status.reset_required` but `gpu_recovery_action` (NVML's nvmlDeviceGpuRecoveryAction_t);
asking for a field a driver lacks fails the whole query. The probe asks for the new field in the
old one's place; the xid check fails a GPU whose driver asks for an action and settles an owed
reset by that field.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.exec.agent import probe_health, probe_health_smi
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import xid as hm_xid

FIELDS = ("index", "pci.bus_id", "name", "reset_status.reset_required")


def fake_smi(monkeypatch: pytest.MonkeyPatch, known: dict[str, str]) -> list[list[str]]:
    """nvidia-smi --query-gpu of one GPU that knows the fields `known` (name -> cell)."""
    calls: list[list[str]] = []

    def run(argv: list[str], timeout: float, record: list[Any]) -> dict[str, Any]:
        calls.append(argv)
        fields = argv[1].split("=", 1)[1].split(",")
        for f in fields:
            if f not in known:
                # as the real tool says it (exit 2, on stdout)
                out = f'Field "{f}" is not a valid field to query.\n\n'
                return {"rc": 2, "stdout": out, "stderr": "", "timed_out": False}
        return {
            "rc": 0,
            "stdout": ", ".join(known[f] for f in fields) + "\n",
            "stderr": "",
            "timed_out": False,
        }

    for module in (probe_health, probe_health_smi):  # the readers, and the fabric part's systemctl
        monkeypatch.setattr(module, "run_recorded", run)
    return calls


BASE = {"index": "0", "pci.bus_id": "00000000:17:00.0", "name": "NVIDIA B200"}


def test_a_590_driver_is_asked_for_gpu_recovery_action_in_the_same_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = fake_smi(monkeypatch, {**BASE, "gpu_recovery_action": "Reboot"})
    part = probe_health.part_gpus({"query_fields": list(FIELDS)}, [])
    assert part["ok"] and len(calls) == 2
    assert part["renamed"] == {"reset_status.reset_required": "gpu_recovery_action"}
    (g,) = part["gpus"]
    # reported under its own name: its values are not Yes/No
    assert g["gpu_recovery_action"] == "Reboot" and "reset_status.reset_required" not in g
    asked = hm_xid.recovery_owed({"gpus": part})
    assert asked == [{"bdf": "0000:17:00.0", "action": "reboot", "value": "Reboot"}]


def test_a_570_driver_keeps_reset_required_in_one_query(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_smi(monkeypatch, {**BASE, "reset_status.reset_required": "Yes"})
    part = probe_health.part_gpus({"query_fields": list(FIELDS)}, [])
    assert part["ok"] and len(calls) == 1 and part["renamed"] == {}
    assert part["gpus"][0]["reset_status.reset_required"] == 1
    assert hm_xid.reset_signals({"gpus": part})["0000:17:00"]["reset_required"] == 1


def test_a_driver_with_neither_field_drops_both(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_smi(monkeypatch, dict(BASE))
    part = probe_health.part_gpus({"query_fields": list(FIELDS)}, [])
    assert part["ok"] and part["renamed"] == {}
    assert sorted(part["dropped"]) == ["gpu_recovery_action", "reset_status.reset_required"]


def facts(action: str, xid: list[dict[str, Any]] | None = None, **kl: Any) -> dict[str, Any]:
    g = {"bdf": "0000:3a:00.0", "gpu_recovery_action": action, "raw": {"gpu_recovery_action": action}}
    part = {"ok": True, "first_run": False, "since": 1.0, "xid": xid or [], "sxid": []}
    part.update(kl)
    return {"gpus": {"ok": True, "gpus": [g]}, "kernel_log": part}


def judge(f: dict[str, Any]) -> hm.Verdict:
    return hm.evaluate("xid", f, hm.Thresholds.from_vars({}))


@pytest.mark.parametrize(
    ("value", "action"),
    [
        ("Reset", "reset_gpu"),
        ("Reboot", "reboot"),
        ("Drain P2P", "drain_p2p"),
        ("Drain and Reset", "reset_gpu"),
    ],
)
def test_a_gpu_whose_driver_asks_for_an_action_fails_without_an_xid_line(value: str, action: str) -> None:
    v = judge(facts(value))
    assert not v.ok and v.state["action"] == action
    assert v.reasons == [
        f"0000:3a:00.0: the driver's recovery action is {value!r}: the GPU needs "
        + {"reset_gpu": "a GPU reset", "reboot": "a reboot", "drain_p2p": "its P2P traffic drained"}[action]
    ]


@pytest.mark.parametrize("value", ["None", "[N/A]", "[Not Supported]", ""])
def test_no_action_or_no_value_asks_for_nothing(value: str) -> None:
    assert judge(facts(value)).ok


def test_an_owed_reset_is_settled_when_the_recovery_action_reads_none_again() -> None:
    xid = {"ts": 5.0, "bdf": "0000:3a:00", "code": 48, "msg": "NVRM: Xid (PCI:0000:3a:00): 48, DBE"}
    night1 = facts("Reset", [xid], cursor={"boot_id": "b1"})
    owed, _ = hm_xid.settle(night1["kernel_log"], (), hm_xid.reset_signals(night1))
    assert [(p["action"], p["marks"]) for p in owed] == [("reset_gpu", ["recovery_action"])]
    night2 = facts("Reset", [], pending=owed, cursor={"boot_id": "b1"})
    assert not judge(night2).ok  # still asks
    night3 = facts("None", [], pending=owed, cursor={"boot_id": "b1"})
    v = judge(night3)
    assert v.ok and [d["by"] for d in v.state["done"]] == ["gpu_reset"]

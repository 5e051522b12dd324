"""The Xid catalogue generated from NVIDIA's (fixtures/xid/), and how the xid check judges it."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import facts as health_facts
from pytest_gpuhost.modules.health import xid as hm_xid
from pytest_gpuhost.modules.health import xid_catalogue

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "fixtures/xid/nvidia-xid-catalog.csv"
GENERATOR = ROOT / "scripts/gen_xid_catalogue.py"
#: The codes of the hand-typed table the generated catalogue replaced (every other code was unknown).
HAND_TYPED = frozenset(range(144, 151)) | {13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 74, 79, 92, 94, 95}
HAND_TYPED |= {109, 119, 120, 140, 154}


def rows() -> list[dict[str, str]]:
    with CSV.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def kernel_facts(*codes: int) -> dict[str, Any]:
    xid = [
        {"ts": 5.0 + i, "bdf": "0000:3a:00", "code": c, "msg": f"NVRM: Xid (PCI:0000:3a:00): {c}, pid=1"}
        for i, c in enumerate(codes)
    ]
    return {
        "kernel_log": {"ok": True, "first_run": False, "since": 0.5, "xid": xid, "sxid": [], "cursor": {}}
    }


def judge(facts: dict[str, Any]) -> hm.Verdict:
    return hm.evaluate("xid", facts, hm.Thresholds.from_vars({"xid_ignore": []}))


def test_every_code_of_nvidias_catalogue_is_in_the_table_with_its_bucket() -> None:
    data = rows()
    assert len(data) == 172 and len(hm_xid.XID_CATALOGUE) == 172
    assert {int(r["code"]) for r in data} == set(hm_xid.XID_CATALOGUE)
    for r in data:
        action, _, bucket = hm_xid.XID_CATALOGUE[int(r["code"])]
        assert bucket == r["immediate_resolution"] and action in hm_xid.ACTIONS, r


def test_the_generated_module_is_up_to_date(tmp_path: Path) -> None:
    """Running the generator gives the committed file, byte for byte (else: run it and commit)."""
    out = tmp_path / "xid_catalogue.py"
    proc = subprocess.run([sys.executable, str(GENERATOR), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text(encoding="utf-8") == Path(xid_catalogue.__file__).read_text(encoding="utf-8")


def test_a_bucket_without_an_action_stops_the_generator(tmp_path: Path) -> None:
    src = tmp_path / "catalog.csv"
    src.write_text(
        "code,mnemonic,description,immediate_resolution,investigatory_resolution\n"
        "173,NEW_XID,Something new,DRAIN_THE_LAKE,\n",
        encoding="utf-8",
    )
    out = tmp_path / "out.py"
    proc = subprocess.run(
        [sys.executable, str(GENERATOR), "--csv", str(src), "--out", str(out)], capture_output=True, text=True
    )
    assert proc.returncode != 0 and not out.exists()
    assert "Xid 173: bucket 'DRAIN_THE_LAKE' has no action in BUCKET_ACTIONS" in proc.stderr


@pytest.mark.parametrize(
    ("code", "action", "name", "bucket"),
    [
        (13, "restart_app", "Graphics Engine Exception", "RESTART_APP"),
        (31, "restart_app", "GPU memory page fault", "RESTART_APP"),
        (45, "none", "Preemptive cleanup, due to previous errors", "WORKFLOW_XID_45"),
        (48, "reset_gpu", "Double Bit ECC Error", "WORKFLOW_XID_48"),
        (74, "check_fabric", "NVLINK Error", "WORKFLOW_NVLINK_ERR"),
        (79, "reboot", "GPU has fallen off the bus", "RESTART_BM"),
        (94, "restart_app", "Contained memory error", "RESTART_APP"),
        (109, "reset_gpu", "Context Switch Timeout Error", "RESET_GPU"),  # was restart_app by hand
        (149, "check_fabric", "NVLINK: NETIR Error", "WORKFLOW_NVLINK5_ERR"),
        (154, "reset_gpu", "GPU Recovery Action Changed", "XID_154"),
        (54, "unknown", "Auxiliary power is not connected to the GPU board", "CHECK_MECHANICALS"),
        (61, "reset_gpu", "Unused (PMU_BREAKPOINT)", "CONTACT_SUPPORT"),  # OVERRIDES
        (63, "reset_gpu", "GPU memory remapping event", "IGNORE"),  # OVERRIDES
    ],
)
def test_known_codes(code: int, action: str, name: str, bucket: str) -> None:
    assert hm_xid.XID_CATALOGUE[code] == (action, name, bucket)
    assert hm_xid.action_of(code) == (action, name)


def test_overrides_are_few_and_each_changes_its_bucket() -> None:
    """An override equal to the generated action would be dead weight; each says why."""
    assert set(hm_xid.OVERRIDES) == {61, 63}
    for code, (action, why) in hm_xid.OVERRIDES.items():
        assert action in hm_xid.ACTIONS and why
        assert xid_catalogue.CATALOGUE[code][0] != action


def test_xid_154_and_a_named_cause_are_judged_as_before() -> None:
    def act(code: int, msg: str, **e: Any) -> tuple[str, str]:
        return hm_xid.event_action({"code": code, "msg": f"NVRM: Xid (PCI:0000:01:00): {code}, {msg}", **e})

    to = "GPU recovery action changed from 0x0 (None) to"
    assert act(154, f"{to} 0x2 (Node Reboot Required)") == (
        "reboot",
        "GPU Recovery Action Changed: Node Reboot Required",
    )
    assert act(154, f"{to} 0x3 (Drain P2P)")[0] == "drain_p2p"
    assert act(154, "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)")[0] == "none"
    assert act(154, "no action text")[0] == "reset_gpu"
    assert act(45, "pid=7, Ch 00000008, caused by previous Xid 149", cause=149) == (
        "check_fabric",
        "NVLINK: NETIR Error (caused by Xid 149)",
    )


def test_an_xid_the_hand_typed_table_did_not_know_is_now_judged_by_nvidias_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Xid 8 (GPU stopped processing: restart the app) failed the node as unknown; now it passes."""
    assert 8 not in HAND_TYPED and 46 not in HAND_TYPED
    v = judge(kernel_facts(8))
    assert v.ok and v.summary == "no Xid errors since the last run; 1 not failing (8: restart_app)"
    # Xid 46 (GPU stopped processing, RESET_GPU): failing, and owed until the GPU is reset.
    v = judge(kernel_facts(46))
    assert not v.ok and v.state["action"] == "reset_gpu"
    owed = (health_facts.commit_state(kernel_facts(46)) or {})["pending"]
    assert [(p["code"], p["action"]) for p in owed] == [(46, "reset_gpu")]
    # The hand-typed table's codes only: Xid 8 was unknown and failed the node.
    old = {c: hm_xid.XID_CATALOGUE[c] for c in HAND_TYPED}
    monkeypatch.setattr(hm_xid, "XID_CATALOGUE", old)
    v = judge(kernel_facts(8))
    assert not v.ok and v.state["action"] == "unknown"


def test_a_code_in_no_catalogue_still_fails_as_unknown() -> None:
    assert 999 not in hm_xid.XID_CATALOGUE
    v = judge(kernel_facts(999))
    assert not v.ok and v.state["action"] == "unknown" and hm_xid.action_of(999) == ("unknown", "")

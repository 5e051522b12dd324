"""Verdict logic of the health checks (pytest_gpuhost.modules.health): facts in, verdicts out."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import facts as health_facts
from pytest_gpuhost.modules.health import xid as hm_xid

BDFS = ["0000:17:00.0", "0000:18:00.0", "0000:3a:00.0", "0000:3b:00.0"]


def gpu(i: int, **kw: Any) -> dict[str, Any]:
    row = {
        "index": i,
        "bdf": BDFS[i],
        "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        "uuid": f"GPU-{i}",
        "driver_version": "570.133.07",
        "persistence_mode": 1,
        "temperature.gpu": 40,
        "ecc.errors.uncorrected.volatile.total": 0,
        "ecc.errors.corrected.volatile.total": 0,
        "retired_pages.pending": None,
        "remapped_rows.failure": 0,
        "clocks_throttle_reasons.active": 0,
        "pcie.link.gen.current": 5,
        "pcie.link.gen.max": 5,
        "pcie.link.width.current": 16,
        "pcie.link.width.max": 16,
        "raw": {"persistence_mode": "Enabled"},
    }
    row.update(kw)
    return row


def healthy() -> dict[str, Any]:
    return {
        "gpus": {"ok": True, "gpus": [gpu(i) for i in range(4)]},
        "smi": {"ok": True, "cuda_version": "12.8", "driver_version": "570.133.07"},
        "nvlink": {"ok": True, "gpus": {}},
        "p2p": {
            "ok": True,
            "labels": ["GPU0", "GPU1", "GPU2", "GPU3"],
            "matrix": [
                ["X", "OK", "OK", "OK"],
                ["OK", "X", "OK", "OK"],
                ["OK", "OK", "X", "OK"],
                ["OK", "OK", "OK", "X"],
            ],
        },
        "kernel_log": {
            "ok": True,
            "first_run": False,
            "since": 1.0,
            "xid": [],
            "sxid": [],
            "cursor": {"last_ts": 2.0},
        },
        "pci": {
            "ok": True,
            "devices": {
                b: {
                    "driver": "nvidia",
                    "iommu_group": str(30 + i),
                    "iommu_type": "identity",
                    "link": {},
                    "bridges": [
                        {
                            "bdf": f"0000:1{i}:00.0",
                            "acs": {"source": "config", "present": True, "ctl": {"SrcValid": True}},
                        }
                    ],
                }
                for i, b in enumerate(BDFS)
            },
        },
        "disk": {"ok": True, "paths": {"/": {"total": 100 * 2**30, "free": 50 * 2**30, "avail": 50 * 2**30}}},
        "ib": {"ok": True, "ports": {}, "peermem": False},
        "mounts": {
            "ok": True,
            "paths": {"/": {"mount_point": "/", "fstype": "ext4", "source": "/dev/nvme0n1p2", "ro": False}},
        },
        "services": {
            "ok": True,
            "services": {
                "sglang-qwen.service": {
                    "unit": "sglang-qwen.service",
                    "show": {
                        "LoadState": "loaded",
                        "ActiveState": "active",
                        "SubState": "running",
                        "MainPID": "42",
                        "Result": "success",
                    },
                    "health": {
                        "url": "http://127.0.0.1:30000/health",
                        "status": 200,
                        "error": None,
                        "duration": 0.01,
                    },
                }
            },
        },
    }


SERVICE_VARS = {"service": "sglang-qwen", "service_port": 30000, "gpu_count": 4}


def judge(check: str, facts: dict[str, Any], samples: Any = None, **vars: Any) -> hm.Verdict:
    return hm.evaluate(check, facts, hm.Thresholds.from_vars({**SERVICE_VARS, **vars}), samples=samples)


def test_healthy_host_passes_every_check_or_skips_with_a_reason() -> None:
    facts = healthy()
    for check in hm.CHECKS:
        v = judge(check, facts)
        assert v.ok, (check, v.summary, v.reasons)
        assert v.summary
    assert judge("nvlink", facts).skip == "no NVLink on this host"
    assert judge("retired_pages", facts).skip  # N/A on every GPU: row remapping instead


def test_thresholds_from_vars_convert_and_reject() -> None:
    t = hm.Thresholds.from_vars(
        {"temperature_max": "80", "throttle_fail_mask": "0x8", "persistence_mode": "no", "unrelated": 1}
    )
    assert t["temperature_max"] == 80.0 and t["throttle_fail_mask"] == 8 and t["persistence_mode"] is False
    with pytest.raises(hm.ThresholdError, match="gpu_count='four'"):
        hm.Thresholds.from_vars({"gpu_count": "four"})
    with pytest.raises(hm.ThresholdError, match="data_paths"):
        hm.Thresholds.from_vars({"data_paths": "/data"})
    assert hm.Thresholds.from_vars({"service": "a"}).services == ["a.service"]
    assert (
        hm.probe_params(hm.Thresholds.from_vars(SERVICE_VARS))["services"][0]["url"]
        == "http://127.0.0.1:30000/health"
    )


def test_gpu_count_and_model() -> None:
    facts = healthy()
    del facts["gpus"]["gpus"][3]
    v = judge("gpu_count", facts)
    assert not v.ok and "sees 3 GPUs, the inventory expects 4" in v.summary
    assert any("0000:3b:00.0 is bound to nvidia but nvidia-smi does not list it" in r for r in v.reasons)
    assert not judge("gpu_count", healthy(), gpu_model="B200").ok
    assert judge("gpu_count", healthy(), gpu_model="rtx pro 6000").ok


def test_gpu_count_without_inventory_is_the_nvidia_gpus_on_the_pci_bus() -> None:
    """7 of 8 is caught without gpu_count: the bus has the GPU whose nvidia probe failed."""
    facts = healthy()
    on_bus: dict[str, dict[str, str | None]] = {b: {"class": "0x030200", "driver": "nvidia"} for b in BDFS}
    facts["pci"]["on_bus"] = on_bus
    t = hm.Thresholds.from_vars({})
    v = hm.evaluate("gpu_count", facts, t)
    assert v.ok and v.summary.endswith("as many as the PCI bus has (4)"), v.summary
    # The last GPU's probe failed: no driver, not in nvidia's directory, not in nvidia-smi.
    del facts["gpus"]["gpus"][3]
    del facts["pci"]["devices"][BDFS[3]]
    on_bus[BDFS[3]]["driver"] = None
    v = hm.evaluate("gpu_count", facts, t)
    assert not v.ok
    assert v.reasons == [
        "nvidia-smi sees 3 GPUs, the PCI bus has 4 NVIDIA display controllers not on vfio-pci",
        "0000:3b:00.0 is an NVIDIA GPU on the PCI bus, driver none, but nvidia-smi does not list it",
    ]
    assert v.state["expected_from"] == "PCI bus"
    # A GPU on vfio-pci belongs to a VM: not expected in the host's nvidia-smi.
    on_bus[BDFS[3]]["driver"] = "vfio-pci"
    assert hm.evaluate("gpu_count", facts, t).ok
    # The inventory's count wins, and the missing GPU is still named.
    on_bus[BDFS[3]]["driver"] = None
    v = judge("gpu_count", facts)
    assert v.reasons[0] == "nvidia-smi sees 3 GPUs, the inventory expects 4"
    assert "0000:3b:00.0 is an NVIDIA GPU on the PCI bus" in v.reasons[1]


def test_versions_against_inventory_and_between_gpus() -> None:
    assert "570.133.07" in judge("driver_version", healthy()).summary
    assert not judge("driver_version", healthy(), driver_version="575.51.03").ok
    facts = healthy()
    facts["gpus"]["gpus"][1]["driver_version"] = "550.54.15"
    assert "differs between GPUs" in judge("driver_version", facts).summary
    assert judge("cuda_version", healthy()).state["cuda_version"] == "12.8"
    assert not judge("cuda_version", healthy(), cuda_version="12.4").ok
    assert judge("cuda_version", healthy()).state["source"] == "nvidia-smi header"
    facts = healthy()
    facts["smi"]["cached"] = {"driver_version": "570.133.07", "cuda_version": "12.8", "at": 1796000000.0}
    v = judge("cuda_version", facts)
    assert v.ok and v.state["source"].startswith("cached for driver 570.133.07")
    assert v.reasons == ["CUDA version cached: driver 570.133.07 unchanged since 2026-11-30 00:53 UTC"]


def test_persistence_offers_its_fix() -> None:
    facts = healthy()
    facts["gpus"]["gpus"][2].update({"persistence_mode": 0, "raw": {"persistence_mode": "Disabled"}})
    v = judge("persistence_mode", facts)
    assert not v.ok and v.fix == "persistence" and "off on 1 of 4 GPUs" in v.summary
    assert "GPU 2 (0000:3a:00.0): persistence mode Disabled" in v.reasons
    assert judge("persistence_mode", facts, persistence_mode=False).skip


def test_memory_errors() -> None:
    facts = healthy()
    facts["gpus"]["gpus"][0]["ecc.errors.uncorrected.volatile.total"] = 2
    facts["gpus"]["gpus"][1]["remapped_rows.failure"] = 1
    facts["gpus"]["gpus"][3]["retired_pages.pending"] = 1
    assert "uncorrected ECC errors 2 > 0" in judge("ecc", facts).summary
    assert judge("ecc", facts, ecc_uncorrected_max=5).ok
    assert not judge("remapped_rows", facts).ok
    assert "GPU 3" in judge("retired_pages", facts).summary
    facts = healthy()
    facts["gpus"]["gpus"][0]["ecc.errors.corrected.volatile.total"] = 500
    assert judge("ecc", facts).ok and not judge("ecc", facts, ecc_corrected_max=100).ok


def test_xid_counts_only_new_lines_and_ignores_application_faults() -> None:
    facts = healthy()
    facts["kernel_log"]["xid"] = [
        {
            "ts": 5.0,
            "bdf": "0000:3a:00",
            "code": 79,
            "msg": "NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus.",
        },
        {
            "ts": 6.0,
            "bdf": "0000:17:00",
            "code": 13,
            "msg": "NVRM: Xid (PCI:0000:17:00): 13, Graphics Exception",
        },
    ]
    v = judge("xid", facts)
    assert (
        not v.ok
        and v.summary
        == "1 Xid error(s) since the last run: code 79 (action: reboot); 1 not failing (13: restart_app)"
    )
    assert v.state["action"] == "reboot"
    assert v.reasons == ["Xid 79 on 0000:3a:00: NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus."]
    assert judge("xid", facts, xid_ignore=[13, 79]).ok
    facts["kernel_log"].update(first_run=True, xid=[])
    assert "since boot (first run; baseline recorded)" in judge("xid", facts).summary
    facts["kernel_log"]["sxid"] = [{"ts": 1, "bdf": "0000:05:00.0", "code": 12028, "msg": "SXid ..."}]
    assert not judge("sxid", facts).ok
    facts["kernel_log"] = {"ok": False, "error": "dmesg exited 1: Operation not permitted"}
    assert "dmesg exited 1" in judge("xid", facts).summary


def xid_line(code: int, bdf: str = "0000:3a:00", ts: float = 5.0) -> dict[str, Any]:
    return {"ts": ts, "bdf": bdf, "code": code, "msg": f"NVRM: Xid (PCI:{bdf}): {code}, pid=1, name=python3"}


def test_xid_action_from_nvidias_catalogue() -> None:
    """94 asks to restart the application (passes, reported); 48 a GPU reset, 74 the NVLinks."""
    t = hm.Thresholds.from_vars({"xid_ignore": []})
    for code, ok, action in (
        (94, True, "none"),
        (45, True, "none"),
        (48, False, "reset_gpu"),
        (74, False, "check_fabric"),
        (79, False, "reboot"),
        (999, False, "unknown"),
    ):
        facts = healthy()
        facts["kernel_log"]["xid"] = [xid_line(code)]
        v = hm.evaluate("xid", facts, t)
        assert (v.ok, v.state["action"]) == (ok, action), (code, v.summary)
        assert v.state["events"][0]["action"] == hm_xid.action_of(code)[0]
    facts = healthy()
    facts["kernel_log"]["xid"] = [xid_line(94)]
    assert (
        hm.evaluate("xid", facts, t).summary
        == "no Xid errors since the last run; 1 not failing (94: restart_app)"
    )


def test_xid_needing_a_reboot_is_owed_across_nights_until_the_boot_id_changes() -> None:
    facts = healthy()
    facts["kernel_log"]["cursor"]["boot_id"] = "boot-1"
    facts["kernel_log"]["xid"] = [xid_line(79)]
    night1 = health_facts.commit_state(facts, [13, 31, 43, 45])
    assert night1 is not None and [(p["code"], p["action"], p["boot_id"]) for p in night1["pending"]] == [
        (79, "reboot", "boot-1")
    ]
    # Night 2: no new line, same boot: still owed, still failing.
    facts = healthy()
    facts["kernel_log"].update(pending=night1["pending"], cursor={"last_ts": 9.0, "boot_id": "boot-1"})
    v = judge("xid", facts)
    assert not v.ok and v.summary == "1 earlier Xid(s) still owed (action: reboot)"
    assert v.reasons[0].startswith(
        "Xid 79 on 0000:3a:00 still needs a reboot: the host has not rebooted since"
    )
    night2 = health_facts.commit_state(facts)
    assert night2 is not None and night2["pending"] == night1["pending"]
    # Night 3: rebooted (a new boot id): passes, says so, and owes nothing any more.
    facts["kernel_log"].update(pending=night2["pending"], cursor={"last_ts": 19.0, "boot_id": "boot-2"})
    v = judge("xid", facts)
    assert v.ok and v.summary == "no Xid errors since the last run; reboot seen since Xid 79 on 0000:3a:00"
    night3 = health_facts.commit_state(facts)
    assert night3 is not None and night3["pending"] == []
    # An application-level Xid is never owed.
    facts["kernel_log"].update(xid=[xid_line(94)], pending=[])
    assert (health_facts.commit_state(facts) or {})["pending"] == []


def test_xid_needing_a_gpu_reset_is_settled_by_that_gpus_reset_not_by_another_or_by_silence() -> None:
    """Xid 48 on GPU 2: owed while GPU 2 says reset required; settled when it says No (a reset)."""

    def night(pending: list[dict[str, Any]], required: dict[int, int], xid: list[dict[str, Any]]) -> Any:
        facts = healthy()
        facts["kernel_log"].update(xid=xid, pending=pending, cursor={"last_ts": 9.0, "boot_id": "boot-1"})
        for i, g in enumerate(facts["gpus"]["gpus"]):
            g["reset_status.reset_required"] = required.get(i, 0)
        return facts, judge("xid", facts), (health_facts.commit_state(facts) or {}).get("pending")

    _, v, owed = night([], {2: 1}, [xid_line(48)])
    assert not v.ok and v.state["action"] == "reset_gpu", v
    assert [(p["code"], p["marks"]) for p in owed] == [(48, ["reset_required"])]
    # The next night, GPU 2 still says so, and GPU 0 was reset: still owed.
    _, v, owed = night(owed, {2: 1}, [])
    assert not v.ok and v.summary == "1 earlier Xid(s) still owed (action: reset_gpu)", v
    assert v.reasons[0].startswith(
        "Xid 48 on 0000:3a:00 still needs a GPU reset: no reset of that GPU and no reboot seen since"
    ), v.reasons
    # GPU 2 reset: it says No now: passes, recovered by the reset, owes nothing.
    facts, v, after = night(owed, {}, [])
    assert v.ok and v.summary == "no Xid errors since the last run; GPU reset seen since Xid 48 on 0000:3a:00"
    assert [p["by"] for p in v.state["done"]] == ["gpu_reset"] and after == []
    # A GPU that never said it needed a reset gives no proof of one: owed until the boot id changes.
    _, v, owed = night([], {}, [xid_line(48)])
    _, v, owed = night(owed, {}, [])
    assert not v.ok and len(owed) == 1, v
    # GPU 2 unreadable (no row) after saying so: not settled either.
    facts, _, _ = night([], {2: 1}, [])
    facts["gpus"]["gpus"] = facts["gpus"]["gpus"][:2]
    facts["kernel_log"].update(
        pending=[{**xid_line(48), "action": "reset_gpu", "boot_id": "boot-1", "marks": ["reset_required"]}]
    )
    assert not judge("xid", facts).ok
    # A reboot-class Xid is not settled by a GPU reset.
    _, v, owed = night([], {2: 1}, [xid_line(79)])
    _, v, owed = night(owed, {}, [])
    assert not v.ok and v.state["action"] == "reboot" and len(owed) == 1, v


def test_reset_signals_read_the_cells_and_the_remap_query() -> None:
    facts = healthy()
    facts["gpus"]["gpus"][1]["cell_errors"] = {"temperature.gpu": "GPU requires reset"}
    facts["remap"] = {"ok": True, "gpus": {BDFS[3]: {"remapped_rows.pending": 1}}}
    sig = hm_xid.reset_signals(facts)
    assert sig["0000:18:00"] == {
        "reset_required": None,
        "nvml_reset_required": 1,
        "remap_pending": None,
        "recovery_action": None,
    }
    assert sig["0000:3b:00"]["remap_pending"] == 1 and sig["0000:17:00"]["nvml_reset_required"] == 0


def test_degraded_pcie_link() -> None:
    facts = healthy()
    facts["gpus"]["gpus"][1]["pcie.link.width.current"] = 8
    facts["gpus"]["gpus"][2]["pcie.link.gen.current"] = 4
    facts["gpus"]["gpus"][2]["pstate"] = "P0"  # at work: the generation counts
    v = judge("pcie_link", facts)
    assert not v.ok
    assert v.reasons == [
        "GPU 1 (0000:18:00.0): PCIe x8, below x16 (max x16)",
        "GPU 2 (0000:3a:00.0): PCIe Gen4, below Gen5 (max Gen5) at work (P0)",
    ]
    assert judge("pcie_link", facts, pcie_gen_min=4, pcie_width_min=8).ok
    # nvidia-smi without the link fields: sysfs decides
    facts = healthy()
    for g in facts["gpus"]["gpus"]:
        for k in (
            "pcie.link.gen.current",
            "pcie.link.gen.max",
            "pcie.link.width.current",
            "pcie.link.width.max",
        ):
            g[k] = None
    facts["gpus"]["gpus"][0]["pstate"] = "P2"
    facts["gpus"]["gpus"][0]["sysfs_link"] = {
        "speed": "16.0 GT/s PCIe",
        "max_speed": "32.0 GT/s PCIe",
        "width": "16",
        "max_width": "16",
    }
    assert "Gen4, below Gen5" in judge("pcie_link", facts).summary
    # facts of an older probe kept sysfs's link with the PCI part
    del facts["gpus"]["gpus"][0]["sysfs_link"]
    facts["pci"]["devices"][BDFS[0]]["link"] = {
        "speed": "16.0 GT/s PCIe",
        "max_speed": "32.0 GT/s PCIe",
        "width": "8",
        "max_width": "16",
    }
    assert f"GPU 0 ({BDFS[0]}): PCIe x8, below x16 (max x16)" in judge("pcie_link", facts).reasons


def test_nvlink_down() -> None:
    facts = healthy()
    facts["nvlink"]["gpus"] = {
        "0": {"links": {"0": {"up": True, "text": "26.562 GB/s"}, "1": {"up": False, "text": "<inactive>"}}},
        "1": {"links": {"0": {"up": True, "text": "26.562 GB/s"}, "1": {"up": True, "text": "26.562 GB/s"}}},
    }
    v = judge("nvlink", facts)
    assert not v.ok and v.reasons == ["GPU 0 link 1: <inactive>"] and "1 of 4 NVLinks down" in v.summary
    assert not judge("nvlink", healthy(), nvlink_required=True).ok


def test_nvlink_count_per_model_catches_a_gpu_with_no_link_lines() -> None:
    """B200: 18 active NVLinks per GPU; a GPU whose links are all down prints no link lines."""
    facts = healthy()
    for g in facts["gpus"]["gpus"]:
        g["name"] = "NVIDIA B200"
    up = {str(i): {"up": True, "gbps": 53.125, "text": "53.125 GB/s"} for i in range(18)}
    facts["nvlink"]["gpus"] = {str(i): {"links": dict(up)} for i in range(4)}
    v = judge("nvlink", facts)
    assert v.ok and v.summary == "all 72 NVLinks up", v.summary
    facts["nvlink"]["gpus"]["2"] = {"links": {}}
    del facts["nvlink"]["gpus"]["3"]  # not listed at all
    v = judge("nvlink", facts)
    assert not v.ok and v.reasons == [
        "GPU 2 (0000:3a:00.0): 0 of 18 NVLinks active (no link lines)",
        "GPU 3 (0000:3b:00.0): 0 of 18 NVLinks active (no link lines)",
    ]
    # Before the model table this passed: every link line printed was up.
    assert judge("nvlink", facts, nvlink_active_min=0).ok
    # A PCIe model expects none: no NVLink is still a skip.
    assert judge("nvlink", healthy()).skip == "no NVLink on this host"


def test_iommu_acs_and_p2p() -> None:
    facts = healthy()
    facts["pci"]["devices"][BDFS[0]]["iommu_type"] = "DMA-FQ"
    facts["pci"]["devices"][BDFS[1]]["driver"] = "vfio-pci"  # a VM's GPU: not judged
    facts["pci"]["devices"][BDFS[1]]["iommu_type"] = "DMA-FQ"
    v = judge("iommu_group_type", facts)
    assert not v.ok and v.reasons == ["0000:17:00.0: IOMMU group 30 is DMA-FQ, expected identity"]
    assert judge("iommu_group_type", facts, iommu_group_types=["identity", "DMA-FQ"]).ok
    facts["pci"]["devices"][BDFS[2]]["bridges"][0]["acs"]["ctl"].update(ReqRedir=True, CmpltRedir=True)
    v = judge("acs", facts)
    assert not v.ok and "bridge 0000:12:00.0: ACS ReqRedir+ CmpltRedir+" in v.reasons[0]
    unknown = healthy()
    for d in unknown["pci"]["devices"].values():
        d["bridges"][0]["acs"] = {"source": "unknown", "present": None, "ctl": {}}
    assert (judge("acs", unknown).skip or "").startswith("ACS state unknown")
    facts["p2p"]["matrix"][0][2] = facts["p2p"]["matrix"][2][0] = "NS"
    v = judge("p2p", facts)
    assert not v.ok and v.reasons == ["GPU0 <-> GPU2: NS (not supported)"] and "1 of 6 GPU pairs" in v.summary


def test_throttle_reasons() -> None:
    facts = healthy()
    facts["gpus"]["gpus"][0]["clocks_throttle_reasons.active"] = 0x1  # idle: fine
    facts["gpus"]["gpus"][1]["clocks_throttle_reasons.active"] = 0x44  # sw power cap + hw thermal
    v = judge("throttle", facts)
    assert not v.ok and v.reasons == ["GPU 1 (0000:18:00.0): throttled by hw_thermal_slowdown (0x44)"]
    assert hm.throttle_reason_names(0x88) == ["hw_slowdown", "hw_power_brake_slowdown"]


def with_temps(temps: list[float]) -> dict[str, Any]:
    facts = healthy()
    for g, t in zip(facts["gpus"]["gpus"], temps, strict=False):
        g["temperature.gpu"] = t
    return facts


def test_temperature_far_from_the_limit_needs_no_reread() -> None:
    v = judge("temperature", with_temps([40, 41, 90, 42]))
    assert not v.ok and v.reread is None and "90 C > 85 C (one reading)" in v.reasons[0]
    assert judge("temperature", with_temps([40, 41, 60, 42])).reread is None


def test_temperature_flapping_at_the_limit_is_decided_by_the_median() -> None:
    first = with_temps([40, 41, 86, 42])  # 1 C over, inside the 2 C band: one reading is not trusted
    v = judge("temperature", first)
    assert v.reread == "gpus"
    cool = judge("temperature", first, samples=[with_temps([40, 41, t, 42]) for t in (84, 85, 84)])
    assert cool.ok and cool.reread is None  # readings 86, 84, 85, 84: median 84.5
    assert "near the limit, readings [86.0, 84.0, 85.0, 84.0], median 84.5 C" in cool.reasons[0]
    hot = judge("temperature", first, samples=[with_temps([40, 41, t, 42]) for t in (86, 87, 85)])
    assert not hot.ok and "86 C > 85 C (median of 4 readings" in hot.reasons[0]


def test_disk_free_with_noise_band() -> None:
    facts = healthy()
    facts["disk"]["paths"]["/data"] = {"total": 1000, "free": 50, "avail": 50}
    v = judge("disk_free", facts, data_paths=["/", "/data"])
    assert not v.ok and v.reasons == ["/data: 5.0% free < 10%"] and v.reread is None
    facts["disk"]["paths"]["/data"] = {"total": 1000, "free": 98, "avail": 98}
    v = judge("disk_free", facts, data_paths=["/", "/data"])
    assert not v.ok and v.reread == "disk"
    again = copy.deepcopy(facts)
    again["disk"]["paths"]["/data"]["avail"] = 103
    v = judge("disk_free", facts, samples=[again, again, again], data_paths=["/", "/data"])
    assert v.ok and v.state["paths"]["/data"]["readings_pct"] == [9.8, 10.3, 10.3, 10.3]
    facts["disk"]["paths"]["/gone"] = {"error": "/gone: No such file or directory", "errno": 2}
    assert "/gone: No such file or directory" in judge("disk_free", facts).reasons


def test_service_and_health_endpoint() -> None:
    facts = healthy()
    svc = facts["services"]["services"]["sglang-qwen.service"]
    svc["show"].update(ActiveState="failed", SubState="failed", Result="exit-code", MainPID="0")
    svc["health"] = {
        "url": "http://127.0.0.1:30000/health",
        "status": None,
        "error": "URLError: [Errno 111] Connection refused",
    }
    v = judge("service", facts)
    assert (
        not v.ok
        and v.fix == "service"
        and v.summary == "sglang-qwen.service: failed (failed, result exit-code)"
    )
    h = judge("service_health", facts)
    assert not h.ok and "Connection refused" in h.summary
    assert judge("service", facts, service=None).skip
    assert judge("service_health", healthy(), service_port=None).skip


def test_unknown_check_is_an_error() -> None:
    with pytest.raises(KeyError, match="unknown health check 'nope'"):
        hm.evaluate("nope", healthy(), hm.Thresholds.from_vars({}))


def test_a_gpu_that_requires_reset_fails_by_index_and_na_is_no_value() -> None:
    """nvidia-smi's bracketed NVML errors are read as what they are, not as N/A."""
    facts = healthy()
    g = facts["gpus"]["gpus"][2]
    for f in ("temperature.gpu", "ecc.errors.uncorrected.volatile.total", "clocks_throttle_reasons.active"):
        g[f] = None
    g["cell_errors"] = {
        "temperature.gpu": "GPU requires reset",
        "ecc.errors.uncorrected.volatile.total": "GPU requires reset",
        "clocks_throttle_reasons.active": "GPU requires reset",
    }
    v = judge("gpu_count", facts)
    assert not v.ok and v.reasons == [
        "GPU 2 (0000:3a:00.0): nvidia-smi prints [GPU requires reset] for clocks_throttle_reasons.active, "
        "ecc.errors.uncorrected.volatile.total, temperature.gpu"
    ]
    assert v.state["down"] == {"0000:3a:00.0": "GPU requires reset"}
    assert judge("ecc", facts).reasons == [
        "GPU 2 (0000:3a:00.0): ecc.errors.uncorrected.volatile.total [GPU requires reset]"
    ]
    assert judge("temperature", facts).reasons == ["GPU 2 (0000:3a:00.0): temperature [GPU requires reset]"]
    assert judge("throttle", facts).reasons == ["GPU 2 (0000:3a:00.0): throttle reasons [GPU requires reset]"]
    # Every GPU unreadable still fails (it used to skip as "not supported").
    for h in facts["gpus"]["gpus"]:
        h["ecc.errors.uncorrected.volatile.total"] = None
        h["cell_errors"] = {"ecc.errors.uncorrected.volatile.total": "Unknown Error"}
    assert not judge("ecc", facts).ok
    # [N/A] is no value: the probe records no error for it, and the check skips with its reason.
    assert judge("retired_pages", healthy()).skip


def test_a_field_the_driver_does_not_know_is_said_not_passed() -> None:
    facts = healthy()
    facts["gpus"]["dropped"] = ["clocks_throttle_reasons.active"]
    for g in facts["gpus"]["gpus"]:
        del g["clocks_throttle_reasons.active"]
    v = judge("throttle", facts)
    assert v.skip and "does not know the field clocks_throttle_reasons.active" in v.skip
    facts = healthy()
    facts["gpus"]["renamed"] = {"clocks_throttle_reasons.active": "clocks_event_reasons.active"}
    facts["gpus"]["gpus"][1]["clocks_throttle_reasons.active"] = 0x40
    v = judge("throttle", facts)
    assert not v.ok and v.state["field"] == "clocks_event_reasons.active"
    facts["gpus"]["dropped"] = ["ecc.errors.uncorrected.volatile.total"]
    assert "does not know the field ecc.errors.uncorrected" in (judge("ecc", facts).skip or "")


def test_row_remap_pending_or_failed_fails_the_gpu() -> None:
    """`--query-remapped-rows` (its own query): a pending remap needs a GPU reset; a failure fails."""
    facts = healthy()
    rows = {
        b: {
            "remapped_rows.correctable": 0,
            "remapped_rows.uncorrectable": 0,
            "remapped_rows.pending": 0,
            "remapped_rows.failure": 0,
        }
        for b in BDFS
    }
    facts["remap"] = {"ok": True, "gpus": rows}
    v = judge("remapped_rows", facts)
    assert v.ok and v.state["source"] == "--query-remapped-rows", v.summary
    rows[BDFS[1]]["remapped_rows.pending"] = 1
    rows[BDFS[2]]["remapped_rows.failure"] = 1
    v = judge("remapped_rows", facts)
    assert not v.ok and v.reasons == [
        "GPU 1 (0000:18:00.0): row remap pending (a GPU reset applies it)",
        "GPU 2 (0000:3a:00.0): row remapping failure",
    ]
    # The query failed (a driver or GPU without it): the --query-gpu field, and the error kept.
    facts["remap"] = {"ok": False, "error": "nvidia-smi --query-remapped-rows exited 2"}
    v = judge("remapped_rows", facts)
    assert v.ok and v.state["remap_query"] == "nvidia-smi --query-remapped-rows exited 2"


def test_fabric_on_nvswitch_models() -> None:
    """B200: every GPU's fabric Completed/Success and nvidia-fabricmanager active, else fail."""
    facts = healthy()
    assert judge("fabric", facts).skip  # RTX PRO 6000: no fabric part gathered
    for g in facts["gpus"]["gpus"]:
        g["name"] = "NVIDIA B200"
    fab = {b: {"state": "Completed", "status": "Success"} for b in BDFS}
    facts["fabric"] = {
        "ok": True,
        "gpus": fab,
        "unit": "nvidia-fabricmanager.service",
        "service": {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"},
    }
    assert judge("fabric", facts).ok
    fab[BDFS[1]] = {"state": "In Progress", "status": "N/A"}
    fab[BDFS[2]] = {"state": "Completed", "status": "Insufficient Resources"}
    facts["fabric"]["service"] = {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed"}
    v = judge("fabric", facts)
    assert not v.ok and v.reasons == [
        "GPU 1 (0000:18:00.0): fabric state In Progress (not trained: CUDA fails until it is)",
        "GPU 2 (0000:3a:00.0): fabric training finished with status Insufficient Resources",
        "nvidia-fabricmanager.service: failed (failed)",
    ]
    params = hm.probe_params(hm.Thresholds.from_vars({}))
    assert ["B200", True] in params["fabric_models"] and ["RTX PRO 6000", False] in params["fabric_models"]


def test_clock_event_time_is_judged_since_the_last_run_and_a_restarted_counter_is_a_new_baseline() -> None:
    """clocks_event_reasons_counters.* (microseconds since the driver loaded) against the last run's."""
    hw = "clocks_event_reasons_counters.hw_thermal_slowdown"
    sw = "clocks_event_reasons_counters.sw_thermal_slowdown"

    def night(prev: dict[str, Any] | None, **per_gpu: dict[str, int]) -> tuple[hm.Verdict, dict[str, Any]]:
        facts = healthy()
        for g in facts["gpus"]["gpus"]:
            g.update({hw: 0, sw: 0, "clocks_event_reasons_counters.sw_power_cap": 7_000_000})
            g.update(per_gpu.get(f"g{g['index']}", {}))
        facts["kernel_log"]["previous_counters"] = prev
        state = health_facts.commit_state(facts) or {}
        return judge("clock_events", facts), state["counters"]

    v, n1 = night(None)  # first run: judged since the driver loaded, nothing held down by HW
    assert v.ok and "since the driver loaded" in v.summary, v
    v, n2 = night(n1, g1={hw: 12_500_000})
    assert not v.ok and v.reasons == [
        "GPU 1 (0000:18:00.0): clocks held down 12.5 s since the last run (hw_thermal_slowdown 12.5 s; limit 0 s)"
    ], v.reasons
    v, n3 = night(n2, g1={hw: 12_500_000})  # no more since: passes
    assert v.ok and v.state["gpus"]["0000:18:00.0"]["seconds"]["hw_thermal_slowdown"] == 0, v
    v, _ = night(n3, g1={hw: 0})  # the driver reloaded: the counter restarted, a new baseline
    assert v.ok and v.summary.endswith("counters restarted (new baseline) on 0000:18:00.0"), v
    v, _ = night(n3, g1={hw: 2_000_000})  # restarted and 2 s since: all of it happened since
    assert not v.ok and "2 s" in v.reasons[0], v
    v, _ = night(n3, g2={sw: 301_000_000})  # SW thermal slowdown past its own limit
    assert not v.ok and v.reasons[0].startswith("GPU 2 (0000:3a:00.0): clocks held down 301 s"), v
    assert judge("clock_events", healthy()).skip == "GPUs do not report clock-event counters"


def test_ecc_off_on_a_model_that_supports_it_fails_instead_of_skipping() -> None:
    """RTX PRO 6000 with ECC disabled: its counters read [N/A]; that used to skip as 'not supported'."""
    facts = healthy()
    g0 = facts["gpus"]["gpus"][0]
    g0.update({"ecc.mode.current": 0, "ecc.errors.uncorrected.volatile.total": None})
    g0["ecc.errors.corrected.volatile.total"] = None
    for g in facts["gpus"]["gpus"][1:]:
        g["ecc.mode.current"] = 1
    v = judge("ecc", facts)
    assert not v.ok and v.reasons == [
        "GPU 0 (0000:17:00.0): ECC disabled on NVIDIA RTX PRO 6000 Blackwell Server Edition, which supports it "
        "(nvidia-smi -e 1, then a GPU reset or reboot)"
    ], v
    assert judge("ecc", facts, ecc_required=False).ok  # the inventory says ECC off is intended
    g0["name"] = "NVIDIA GeForce RTX 4090"  # a model not in MODELS: ECC off is not judged
    assert judge("ecc", facts).ok


def test_memory_temperature_against_the_gpus_own_limit_else_the_models() -> None:
    facts = healthy()
    for i, g in enumerate(facts["gpus"]["gpus"]):
        g.update({"name": "NVIDIA H100 80GB HBM3", "temperature.memory": 60 + i})
    assert judge("memory_temperature", facts).ok
    facts["gpus"]["gpus"][3]["temperature.memory"] = 97
    v = judge("memory_temperature", facts)
    assert not v.ok and v.reasons == [
        "GPU 3 (0000:3b:00.0): memory 97 C > 95 C (the model's (NVIDIA H100 80GB HBM3))"
    ]
    # The GPU's own limit (nvidia-smi -q, read on NVSwitch models) comes first.
    facts["fabric"] = {"ok": True, "gpus": {}, "memory_temp_max": {BDFS[3]: 98.0}}
    assert judge("memory_temperature", facts).ok
    assert not judge("memory_temperature", facts, memory_temperature_max=90).ok
    # A B200 with no limit read and none set: skipped, saying which variable to set.
    for g in facts["gpus"]["gpus"]:
        g["name"] = "NVIDIA B200"
    facts["fabric"] = {"ok": True, "gpus": {}}
    v = judge("memory_temperature", facts)
    assert v.skip and v.skip.endswith("set memory_temperature_max"), v
    # GDDR boards print N/A: skipped with the reason.
    assert (
        judge("memory_temperature", healthy()).skip
        == "GPUs do not report a memory temperature (GDDR, or N/A)"
    )
    facts = healthy()
    facts["gpus"]["gpus"][1]["cell_errors"] = {"temperature.memory": "Unknown Error"}
    assert judge("memory_temperature", facts).reasons == [
        "GPU 1 (0000:18:00.0): memory temperature [Unknown Error]"
    ]


def test_a_missing_or_read_only_mount_fails_instead_of_measuring_the_parent() -> None:
    facts = healthy()
    facts["disk"]["paths"]["/models"] = {"total": 100 * 2**30, "free": 50 * 2**30, "avail": 50 * 2**30}
    facts["mounts"]["paths"]["/models"] = {
        "mount_point": "/",
        "fstype": "ext4",
        "source": "/dev/nvme0n1p2",
        "ro": False,
    }
    v = judge("mounts", facts, mounts=["/models"])
    assert not v.ok and v.reasons == [
        "/models: not mounted (the path is on /'s file system; its free space would be /'s)"
    ], v
    d = judge("disk_free", facts, mounts=["/models"], data_paths=["/", "/models"])
    assert not d.ok and d.reasons == ["/models: not mounted; free space not measured (it would be /'s)"], d
    facts["mounts"]["paths"]["/models"] = {
        "mount_point": "/models",
        "fstype": "nfs4",
        "source": "nas:/models",
        "ro": True,
    }
    v = judge("mounts", facts, mounts=["/models"])
    assert not v.ok and v.reasons == ["/models: mounted read-only (nfs4 nas:/models)"], v
    assert judge("mounts", facts, mounts=[{"path": "/models", "ro": True}]).ok  # a read-only share, allowed
    # The root file system remounted read-only after errors: a data path on it fails.
    facts["mounts"]["paths"]["/"]["ro"] = True
    v = judge("mounts", facts)
    assert not v.ok and v.reasons == ["/: on a read-only mount (/, ext4)"], v
    with pytest.raises(hm.ThresholdError, match="mounts: 'models' is not an absolute path"):
        hm.probe_params(hm.Thresholds.from_vars({"mounts": ["models"]}))
    with pytest.raises(hm.ThresholdError, match="entry 3 is neither"):
        hm.probe_params(hm.Thresholds.from_vars({"mounts": [3]}))
    assert hm.probe_params(hm.Thresholds.from_vars({"mounts": ["/models/", {"path": "/data"}]}))[
        "mounts"
    ] == [
        "/models",
        "/data",
    ]


def test_pcie_aer_errors_since_the_last_run() -> None:
    """aer_dev_* TOTAL_ERR_* per GPU against the last run's: fatal/non-fatal fail, correctable over the limit."""

    def night(prev: dict[str, Any] | None, **aer: dict[str, int]) -> tuple[hm.Verdict, dict[str, Any]]:
        facts = healthy()
        for i, b in enumerate(BDFS):
            facts["pci"]["devices"][b]["aer"] = {
                "correctable": 5,
                "fatal": 0,
                "nonfatal": 0,
                **aer.get(f"g{i}", {}),
            }
        facts["kernel_log"]["previous_counters"] = prev
        return judge("pcie_aer", facts), (health_facts.commit_state(facts) or {})["counters"]

    v, n1 = night(None)
    assert (
        v.ok
        and v.summary
        == "no fatal or non-fatal AER error on 4 GPUs since boot (no earlier run) (20 correctable)"
    )
    v, n2 = night(n1, g2={"nonfatal": 1, "correctable": 400})
    assert not v.ok and v.reasons == [
        "0000:3a:00.0: PCIe AER 1 nonfatal, 395 correctable error(s) since the last run "
        "(limits: fatal 0, non-fatal 0, correctable 100)"
    ], v.reasons
    v, _ = night(n2, g2={"nonfatal": 1, "correctable": 400})  # nothing new since
    assert v.ok, v
    v, _ = night(n2, g2={"fatal": 1, "correctable": 0})  # rebooted (lower counts) and a fatal one since
    assert not v.ok and v.reasons[0].startswith("0000:3a:00.0: PCIe AER 1 fatal error(s)"), v
    assert judge("pcie_aer", healthy()).skip.startswith("no AER counters in sysfs")


def _nvb(h2d: list[str], d2h: list[str]) -> str:
    def case(name: str, row: list[str]) -> dict[str, Any]:
        return {
            "name": name,
            "status": "Passed",
            "bandwidth_description": "memcpy CE GB/s",
            "bandwidth_matrix": [row],
        }

    doc = {
        "nvbandwidth": {
            "testcases": [case("host_to_device_memcpy_ce", h2d), case("device_to_host_memcpy_ce", d2h)]
        }
    }
    return json.dumps(doc)


DCGM3 = {
    "DCGM GPU Diagnostic": {
        "test_categories": [
            {
                "category": "Deployment",
                "tests": [{"name": "Denylist", "results": [{"gpu_ids": "0,1,2,3", "status": "PASS"}]}],
            },
            {
                "category": "Hardware",
                "tests": [
                    {
                        "name": "GPU Memory",
                        "results": [
                            {"gpu_ids": "0", "status": "PASS"},
                            {"gpu_ids": "2", "status": "FAIL", "warnings": ["Memory error: DBE detected"]},
                        ],
                    }
                ],
            },
        ]
    }
}


def test_diag_is_opt_in_and_judges_nvbandwidth_per_model_and_dcgm_per_test() -> None:
    facts = healthy()
    assert (
        judge("diag", facts).skip
        == "active diagnostics are opt-in (inventory variable diag: [nvbandwidth, dcgm])"
    )
    for g in facts["gpus"]["gpus"]:
        g["name"] = "NVIDIA H100 80GB HBM3"
    nvb = {
        "rc": 0,
        "timed_out": False,
        "stdout": _nvb(["55.10", "54.90", "26.20", "55.00"], ["55.3", "55.1", "26.4", "55.2"]),
    }
    facts["diag"] = {
        "ok": True,
        "enabled": ["nvbandwidth", "dcgm"],
        "results": {"nvbandwidth": nvb, "dcgm": {"missing": "dcgmi is not installed on this host"}},
    }
    v = judge("diag", facts, diag=["nvbandwidth", "dcgm"])
    assert not v.ok and v.reasons == [
        "GPU 2 (0000:3a:00.0): host_to_device_memcpy_ce 26.2 GB/s < 48 GB/s",
        "GPU 2 (0000:3a:00.0): device_to_host_memcpy_ce 26.4 GB/s < 48 GB/s",
    ], v.reasons
    facts["diag"]["results"]["dcgm"] = {"rc": 0, "timed_out": False, "stdout": json.dumps(DCGM3)}
    v = judge("diag", facts, diag=["dcgm"])
    assert not v.ok and v.reasons == [
        "dcgmi diag Hardware: GPU Memory on GPU 2: FAIL (Memory error: DBE detected)"
    ], v.reasons
    dcgm4 = {
        "version": "4.2.3",
        "tests": [{"name": "memory", "results": [{"entity_id": 0, "status": "Pass"}]}],
    }
    facts["diag"]["results"]["dcgm"]["stdout"] = "WARNING: x\n" + json.dumps(dcgm4)
    assert judge("diag", facts, diag=["dcgm"]).ok
    facts["diag"]["results"]["dcgm"]["stdout"] = json.dumps({"DCGM GPU Diagnostic": {"version": "4.2.3"}})
    assert judge("diag", facts, diag=["dcgm"]).reasons[0].startswith("dcgmi diag: no test results")
    # Only dcgmi asked for, not installed: skipped with the reason.
    facts["diag"]["results"]["dcgm"] = {"missing": "dcgmi is not installed on this host"}
    assert judge("diag", facts, diag=["dcgm"]).skip == "dcgmi is not installed on this host"
    # An RTX PRO 6000 has no figure: measured, reported, not judged (unless the inventory sets one).
    facts = healthy()
    facts["diag"] = {"ok": True, "results": {"nvbandwidth": nvb}}
    v = judge("diag", facts, diag=["nvbandwidth"])
    assert v.ok and "no limit for NVIDIA RTX PRO 6000" in v.summary, v
    assert not judge("diag", facts, diag=["nvbandwidth"], h2d_bandwidth_min_gbps=40).ok
    with pytest.raises(hm.ThresholdError, match="diag: 'gpu-burn' is not one of nvbandwidth, dcgm"):
        hm.probe_params(hm.Thresholds.from_vars({"diag": ["gpu-burn"]}))
    assert (
        hm.probe_params(hm.Thresholds.from_vars({"diag": ["dcgm"], "diag_timeout": 600}))["diag_timeout"]
        == 90
    )


def _port(
    state: str = "4: ACTIVE",
    phys: str = "5: LinkUp",
    rate: float = 400.0,
    layer: str = "InfiniBand",
    downed: int = 0,
) -> dict[str, Any]:
    return {
        "state": state.split(": ")[1],
        "state_num": int(state.split(":")[0]),
        "phys_state": phys.split(": ")[1],
        "phys_num": int(phys.split(":")[0]),
        "rate": f"{rate:g} Gb/sec (4X NDR)",
        "rate_gbps": rate,
        "link_layer": layer,
        "counters": {"link_downed": downed},
    }


def test_infiniband_ports_against_the_last_run_and_peermem() -> None:
    def night(
        prev: dict[str, Any] | None, ports: dict[str, Any], peermem: bool = True, **kw: Any
    ) -> tuple[hm.Verdict, dict[str, Any]]:
        facts = healthy()
        facts["ib"] = {"ok": True, "ports": ports, "peermem": peermem}
        facts["kernel_log"]["previous_counters"] = prev
        return judge("infiniband", facts, **kw), (health_facts.commit_state(facts) or {})["counters"]

    assert judge("infiniband", healthy()).skip.startswith("no InfiniBand/RoCE device")
    up = {
        "mlx5_0/1": _port(),
        "mlx5_1/1": _port(),
        "mlx5_2/1": _port("1: DOWN", "3: Disabled", layer="Ethernet"),
    }
    v, n1 = night(None, up)
    assert v.ok and v.state["required"] == ["mlx5_0/1", "mlx5_1/1"], (
        v
    )  # the uncabled Ethernet port is not required
    v, _ = night(n1, {**up, "mlx5_1/1": _port("1: DOWN", "2: Polling")})
    assert not v.ok and v.reasons == ["mlx5_1/1: DOWN / Polling (ACTIVE at the last run)"], v
    v, _ = night(n1, {**up, "mlx5_0/1": _port(rate=200.0, downed=2)})
    assert not v.ok and v.reasons == [
        "mlx5_0/1: rate 200 Gb/sec (4X NDR) < 400 Gb/sec (its rate at the last run)",
        "mlx5_0/1: link went down 2 time(s) since the last run (counters/link_downed)",
    ], v
    v, _ = night(n1, up, peermem=False)
    assert not v.ok and v.reasons == [
        "nvidia_peermem is not loaded: no GPUDirect RDMA over these ports (modprobe nvidia_peermem)"
    ], v
    assert night(n1, up, peermem=False, ib_peermem_required=False)[0].ok
    v, _ = night(n1, up, ib_ports=["mlx5_2/1"])  # the inventory names the RoCE port: it must be up
    assert not v.ok and v.reasons == ["mlx5_2/1: DOWN / Disabled"], v

"""Health verdicts on node shapes the lab's default hosts are not: containers, idle GPUs, no driver.

Facts in, verdicts out (pytest_gpuhost.modules.health): a rented container (kernel log denied,
no systemd, a subset of the host's GPUs), GPUs idling with their PCIe links trained down (public
`nvidia-smi -q` captures in fixtures/outputs), and a host without the NVIDIA driver.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pytest_gpuhost.modules.health import checks as hm
from tests.health.test_health_verdicts import BDFS, gpu, healthy, judge

OUTPUTS = Path(__file__).resolve().parents[2] / "fixtures" / "outputs"


# ---- a rented container node --------------------------------------------------------------


def container_facts() -> dict[str, Any]:
    """A container's facts: dmesg denied (no CAP_SYSLOG), no systemd, 2 of the host's 4 GPUs."""
    facts = healthy()
    facts["kernel_log"] = {
        "ok": False,
        "error": "dmesg exited 1: dmesg: read kernel buffer failed: Operation not permitted",
        "denied": "EPERM",
        "needs": "CAP_SYSLOG",
    }
    facts["gpus"]["gpus"] = [gpu(0), gpu(1)]
    facts["node"] = {
        "container": "docker",
        "pid1": "sleep",
        "systemd": False,
        "gpu_devices": [0, 1],
        "visible_devices": "0,1",
    }
    facts["services"] = {
        "ok": True,
        "services": {
            "sglang.service": {
                "unit": "sglang.service",
                "show": {},
                "error": "systemctl show: command not found",
                "missing": "systemctl",
                "health": {"url": "http://127.0.0.1:30000/health", "status": 200, "duration": 0.01},
            }
        },
    }
    return facts


def test_a_denied_kernel_log_cannot_see_and_says_what_would_let_it() -> None:
    facts = container_facts()
    for check in ("xid", "sxid"):
        v = judge(check, facts)
        assert v.cannot_see and v.ok and not v.skip, (check, v)
        assert "cannot read the kernel log: denied (EPERM, this node lacks CAP_SYSLOG)" in v.cannot_see
        assert "CAP_SYSLOG" in v.cannot_see and "run the check on the host" in v.cannot_see
    # a kernel log that fails for another reason is still the node's problem
    facts["kernel_log"] = {"ok": False, "error": "dmesg timed out"}
    v = judge("xid", facts)
    assert not v.ok and v.cannot_see is None and "kernel log unreadable" in v.summary


def test_a_container_run_has_no_failure_that_is_the_checkers_own_blindness() -> None:
    facts = container_facts()
    verdicts = {c: judge(c, facts, service="sglang.service", gpu_count=None) for c in hm.CHECKS}
    failures = {c: v.summary for c, v in verdicts.items() if not v.ok}
    assert failures == {}
    blind = {c for c, v in verdicts.items() if v.cannot_see}
    assert blind == {"xid", "sxid", "service"}
    assert "no systemctl on this node" in str(verdicts["service"].cannot_see)
    assert verdicts["service_health"].ok and not verdicts["service_health"].cannot_see


def test_a_containers_gpus_are_the_gpus_it_was_given() -> None:
    facts = container_facts()
    # sysfs shows the host's four NVIDIA functions bound to nvidia; nvidia-smi lists the two given
    v = judge("gpu_count", facts, gpu_count=None)
    assert v.ok, v.reasons
    assert v.state["not_this_nodes"] == BDFS[2:]
    assert "as many as this container was given (2)" in v.summary
    assert "2 more on the host's bus: not this node's" in v.summary
    assert "fallen off the bus" not in " ".join(v.reasons + [v.summary])
    # a given GPU that is gone is still a failure: its /dev/nvidia1 stays, nvidia-smi lists one
    facts["gpus"]["gpus"] = [gpu(0)]
    v = judge("gpu_count", facts, gpu_count=None)
    assert not v.ok and "this container was given 2" in v.summary
    # on a host, the same difference is a GPU off the bus
    facts = container_facts()
    del facts["node"]
    v = judge("gpu_count", facts, gpu_count=None)
    assert not v.ok and "fallen off the bus" in " ".join(v.reasons)


def test_persistence_fix_is_not_offered_inside_a_container() -> None:
    facts = container_facts()
    facts["gpus"]["gpus"][0]["persistence_mode"] = 0
    v = judge("persistence_mode", facts)
    assert not v.ok and v.fix is None
    assert any("set persistence mode on its host" in r for r in v.reasons)
    del facts["node"]
    assert judge("persistence_mode", facts).fix == "persistence"


def test_fabric_manager_unseen_from_a_container_cannot_see() -> None:
    facts = healthy()
    for g in facts["gpus"]["gpus"]:
        g["name"] = "NVIDIA B200"
    facts["fabric"] = {
        "ok": True,
        "gpus": {b: {"state": "Completed", "status": "Success"} for b in BDFS},
        "unit": "nvidia-fabricmanager.service",
        "service": {
            "error": "systemctl show nvidia-fabricmanager.service: command not found",
            "missing": "systemctl",
        },
    }
    v = judge("fabric", facts)
    assert v.cannot_see and "Fabric Manager runs on the host" in v.cannot_see
    assert "fabric trained on 4 GPUs" in v.cannot_see
    # a GPU's fabric not trained is seen, and fails, whatever systemd says
    facts["fabric"]["gpus"][BDFS[1]] = {"state": "In Progress", "status": "N/A"}
    v = judge("fabric", facts)
    assert not v.ok and not v.cannot_see


# ---- idle GPUs ----------------------------------------------------------------------------


def test_idle_gpus_pass_pcie_link_and_a_lower_width_or_loaded_gen_fails() -> None:
    facts = healthy()
    for g in facts["gpus"]["gpus"]:
        g.update({"pstate": "P8", "pcie.link.gen.current": 1})
    v = judge("pcie_link", facts)
    assert v.ok, v.reasons
    assert "generation not judged on 4 idle GPU(s)" in v.summary
    # the same link under load at Gen1 is degraded
    facts["gpus"]["gpus"][2]["pstate"] = "P0"
    v = judge("pcie_link", facts)
    assert not v.ok and v.reasons == ["GPU 2 (0000:3a:00.0): PCIe Gen1, below Gen5 (max Gen5) at work (P0)"]
    # busy by utilisation while the state is P8 still counts as at work
    facts["gpus"]["gpus"][2].update({"pstate": "P8", "utilization.gpu": 87})
    assert not judge("pcie_link", facts).ok
    # a lower width fails, idle or not
    facts = healthy()
    facts["gpus"]["gpus"][1].update({"pstate": "P8", "pcie.link.width.current": 8})
    v = judge("pcie_link", facts)
    assert v.reasons == ["GPU 1 (0000:18:00.0): PCIe x8, below x16 (max x16)"]
    # the maximum generation does not move with power state: the inventory's floor holds at idle
    facts = healthy()
    facts["gpus"]["gpus"][3].update({"pstate": "P8", "pcie.link.gen.max": 3, "pcie.link.gen.current": 1})
    v = judge("pcie_link", facts, pcie_gen_min=4)
    assert v.reasons == ["GPU 3 (0000:3b:00.0): PCIe max Gen3, below Gen4 (this GPU and slot)"]


def _facts_of_capture(name: str) -> dict[str, Any]:
    """Read the GPUs of an `nvidia-smi -q` capture as the probe's rows (the fields pcie_link reads)."""
    text = (OUTPUTS / name).read_text()
    # a section heading is a line without " : "; the last one seen names Max/Current
    rows: list[dict[str, Any]] = []
    section = ""
    for line in text.splitlines():
        if re.match(r"^GPU [0-9A-F]{8}:", line):
            rows.append({"index": len(rows), "bdf": line.split()[1][4:].lower(), "raw": {}})
        elif " : " not in line:
            section = line.strip()
        elif rows:
            key, _, value = (p.strip() for p in line.partition(" : "))
            row = rows[-1]
            if key == "Product Name":
                row["name"] = value
            elif key == "Performance State":
                row["pstate"] = value
            elif key in ("Max", "Current") and section in ("PCIe Generation", "Link Width"):
                kind = "gen" if section == "PCIe Generation" else "width"
                row[f"pcie.link.{kind}.{key.lower()}"] = int(value.rstrip("x"))
            elif key == "Gpu" and section == "Utilization":
                row["utilization.gpu"] = int(value.rstrip(" %"))
    assert rows and all("pstate" in r and "pcie.link.gen.current" in r for r in rows), rows
    return {"gpus": {"ok": True, "gpus": rows}, "pci": {"ok": True, "devices": {}}}


def test_public_captures_of_idle_gpus_pass_and_an_idle_x4_link_fails() -> None:
    # one A10 at P8: Gen1 of Gen4, x16 of x16 - a healthy idle datacentre GPU
    v = judge("pcie_link", _facts_of_capture("nvidia-smi-q-550.90.12-a10-idle-p8.txt"))
    assert v.ok, v.reasons
    assert v.state["links"]["0000:08:00.0"]["gen"] == 1 and not v.state["links"]["0000:08:00.0"]["gen_judged"]
    # two RTX 2070 at P8, both Gen1 of Gen3; the second at x4 of x16: only the width fails
    v = judge("pcie_link", _facts_of_capture("nvidia-smi-q-rtx2070x2-idle-p8-x4.txt"))
    assert v.reasons == ["GPU 1 (0000:05:00.0): PCIe x4, below x16 (max x16)"]


# ---- no NVIDIA driver ---------------------------------------------------------------------


def no_driver_facts() -> dict[str, Any]:
    facts = healthy()
    facts["gpus"] = {
        "ok": False,
        "error": "nvidia-smi --query-gpu: command not found",
        "missing": "nvidia-smi",
        "driver_signs": [],
        "gpus": [],
    }
    facts["smi"] = {"ok": False, "error": "nvidia-smi: command not found"}
    facts["pci"] = {"ok": True, "devices": {}}
    return facts


def test_a_host_without_the_driver_is_one_line() -> None:
    facts = no_driver_facts()
    verdicts = {c: judge(c, facts) for c in hm.CHECKS}
    failures = {c: v.summary for c, v in verdicts.items() if not v.ok}
    assert list(failures) == ["gpu_count"]
    assert failures["gpu_count"].startswith("no NVIDIA driver on this host")
    assert all("nvidia-smi" not in str(v.skip) for v in verdicts.values())
    assert verdicts["pcie_link"].skip == "no NVIDIA driver on this host"
    # an inventory that expects no GPU passes it
    assert judge("gpu_count", facts, gpu_count=0).ok
    # the driver loaded but nvidia-smi missing: the tool's absence, not "no driver"
    facts["gpus"]["driver_signs"] = ["/sys/module/nvidia"]
    assert "nvidia-smi failed" in judge("pcie_link", facts).summary

"""suites/health against lab hosts whose driver prints what drivers from 590 and the kernel print.

The lab's nvidia-smi answers per the profile's driver_version (590+: `gpu_recovery_action`, no
`reset_status.reset_required`; 570: the reverse), and the lab's dmesg prints a record of several
lines as util-linux does (the further lines indented, without a timestamp).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from gpulab.profiles.load import load_profile
from tests.health.test_health_lab_gpus import inject, run_suite


def test_a_590_driver_is_read_by_its_recovery_action(lab: Any, tmp_path: Path) -> None:
    """A 590 driver has no reset_status.reset_required: the GPU's recovery action fails the node."""
    profile = load_profile("health-ok", {"name": "health-ok-590", "driver_version": "590.48.01"})
    h = lab.host(profile, name=f"hd{os.getpid() % 100000}-590")
    r = h.ssh(["nvidia-smi", "--query-gpu=reset_status.reset_required", "--format=csv"])
    assert r.returncode == 2 and 'Field "reset_status.reset_required" is not a valid field' in r.stdout
    try:
        x = run_suite(h, tmp_path, name="n1")["hosts"][h.name]["checks"]["xid"]
        assert x["outcome"] == "passed" and x["state"]["recovery_actions"] == [], x
        inject(h, {"gpus": {"0000:23:00.0": {"recovery_action": "Reboot"}}})
        x = run_suite(h, tmp_path, name="n2")["hosts"][h.name]["checks"]["xid"]
        assert x["outcome"] == "failed" and x["state"]["action"] == "reboot", x
        assert x["reasons"] == [
            "0000:23:00.0: the driver's recovery action is 'Reboot': the GPU needs a reboot"
        ]
        q = h.ssh(["nvidia-smi", "-q"]).stdout
        assert re.search(r"^    GPU Recovery Action\s+: Reboot$", q, re.M), q
    finally:
        inject(h, {})


def test_the_drivers_fallen_off_the_bus_record_fails_without_an_xid_line(lab: Any, tmp_path: Path) -> None:
    """The three-line record of fixtures/outputs/kernlog-fallen-off-bus-no-xid.txt, on GPU 0."""
    h = lab.host("health-ok", name=f"hd{os.getpid() % 100000}-fob")
    run_suite(h, tmp_path, name="n1")  # baseline
    msg = (
        "NVRM: The NVIDIA GPU 0000:13:00.0\n"
        "NVRM: (PCI ID: 10de:2bb5) installed in this system has\n"
        "NVRM: fallen off the bus and is not responding to commands."
    )
    after_boot = max(k.t for k in h.profile.kernel_log) + 1.0
    r = h.ssh(
        ["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=json.dumps({"t": after_boot, "msg": msg}) + "\n"
    )
    assert r.returncode == 0, r.stderr
    assert "\n               NVRM: fallen off the bus" in h.ssh(["dmesg"]).stdout
    x = run_suite(h, tmp_path, f"--previous={tmp_path / 'n1.json'}", name="n2")["hosts"][h.name]["checks"][
        "xid"
    ]
    assert x["outcome"] == "failed" and x["state"]["action"] == "reboot", x
    (e,) = x["state"]["events"]
    assert (e["code"], e["bdf"], e["record"]) == (79, "0000:13:00", "fallen_off_bus")

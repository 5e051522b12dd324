"""suites/health against lab hosts over real SSH, with -n 2: verdicts, reasons, fleet outputs.

Seven lab hosts: two healthy, one with degraded PCIe links, one with ACS redirect above two
GPUs, one that gets a new Xid between the two runs, one with persistence mode off (fixed with
--fix=persistence) whose service is killed between the runs (restarted with --fix=service), and
one whose link is cut (unreachable). Run 1 is a --check-only baseline; run 2 compares with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ROLES = {
    "ok1": "health-ok",
    "ok2": "health-ok",
    "pcie": "health-pcie-degraded",
    "acs": "health-acs-redirect",
    "xid": "health-ok",
    "pers": "health-no-persistence",
    "down": "health-ok",
}


@pytest.fixture(scope="module")
def fleet(lab: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("health-fleet")
    tag = f"hl{os.getpid() % 100000}"
    hosts = {role: lab.host(profile, name=f"{tag}-{role}") for role, profile in ROLES.items()}
    known = tmp / "known_hosts"
    known.write_text("".join(Path(h.known_hosts).read_text() for h in hosts.values()))
    lines = [
        "all:",
        "  vars: {ansible_user: root, service: sglang-qwen, service_port: 30000, gpu_count: 4}",
        "  children:",
        "    rack1:",
        "      hosts:",
    ]
    lines += [f"        {h.name}: {{ansible_host: {h.address}}}" for h in hosts.values()]
    (tmp / "fleet.yaml").write_text("\n".join(lines) + "\n")
    try:
        hosts["down"].cut_link()
    except RuntimeError:
        # cut_link needs the kernel's netem; without it a frozen host is just as unreachable
        # (TCP may connect, SSH never answers: the connect timeout is what is tested).
        hosts["down"].freeze()
    return {"hosts": hosts, "tmp": tmp, "known": known}


def run_suite(
    fleet: dict[str, Any], name: str, *extra: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], float]:
    tmp = fleet["tmp"]
    key = "/run/gpulab/id_ed25519"
    argv = [
        sys.executable, "-m", "pytest", "suites/health", "-n", "2", "-p", "no:cacheprovider",
        f"--inventory={tmp / 'fleet.yaml'}", f"--ssh-identity={key}", f"--known-hosts={fleet['known']}",
        "--connect-timeout=3", f"--report-dir={tmp}", f"--report-name={name}", f"--fleet-json={tmp / name}.json",
        "-o", "addopts=", *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150, check=False)
    took = time.monotonic() - t0
    summary = json.loads((tmp / f"{name}.json").read_text())
    return proc, summary, took


def cells(summary: dict[str, Any], host: Any) -> dict[str, dict[str, Any]]:
    return summary["hosts"][host.name]["checks"]


def test_fleet_verdicts_across_two_runs(fleet: dict[str, Any]) -> None:
    h = fleet["hosts"]
    proc, night1, took1 = run_suite(fleet, "night1", "--check-only", "--fix=persistence")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out

    # Healthy hosts: every check passes or skips with a reason.
    for role in ("ok1", "ok2", "xid"):
        c = cells(night1, h[role])
        assert night1["hosts"][h[role].name]["status"] == "ok", (role, c)
        assert c["xid"]["summary"] == "no Xid errors since boot (first run; baseline recorded)"
        assert c["service_health"]["outcome"] == "passed"
    # Degraded link: failed, and why.
    pc = cells(night1, h["pcie"])["pcie_link"]
    assert pc["outcome"] == "failed"
    assert pc["reasons"] == [
        "GPU 2 (0000:23:00.0): PCIe x8, below x16 (max x16)",
        "GPU 3 (0000:24:00.0): PCIe Gen4, below Gen5 (max Gen5) at work (P0)",
    ]
    # ACS redirect on two bridges: the acs check names them, and P2P across them is gone.
    acs = cells(night1, h["acs"])
    assert acs["acs"]["outcome"] == "failed" and acs["acs"]["reasons"] == [
        f"bridge 0000:22:0{i}.0: ACS ReqRedir+ CmpltRedir+ redirects peer traffic through the root complex"
        for i in (0, 1)
    ]
    assert acs["p2p"]["outcome"] == "failed" and "GPU2 <-> GPU3: NS (not supported)" in acs["p2p"]["reasons"]
    assert acs["pcie_link"]["outcome"] == "passed"
    # Persistence off under --check-only --fix=persistence: would fix, with the exact command.
    assert cells(night1, h["pers"])["persistence_mode"]["outcome"] == "would fix"
    assert "nvidia-smi -pm 1" in out
    # Unreachable: every check errors with one line, quickly; the other hosts are unaffected.
    down = cells(night1, h["down"])
    assert night1["hosts"][h["down"].name]["status"] == "error"
    assert {c["outcome"] for c in down.values()} == {"error"}
    assert all("\n" not in c["summary"] and h["down"].address in c["summary"] for c in down.values()), down
    assert took1 < 60, f"the unreachable host held the run up: {took1:.1f} s"
    # The facts of each reachable host took at most 2 requests (gather, cursor commit).
    for role in ("ok1", "ok2", "pcie", "acs", "xid", "pers"):
        assert night1["hosts"][h[role].name]["round_trips"] <= 2, night1["hosts"][h[role].name]

    # Between the runs: a new Xid on one host.
    # Stamped one second after the profile's last boot line: the lab's dmesg dates boot lines
    # from when the host came up, so right after boot they can lie a few seconds in the future.
    after_boot = max(k.t for k in h["xid"].profile.kernel_log) + 1.0
    msg = "NVRM: Xid (PCI:0000:13:00): 79, pid=2231, name=python3, GPU has fallen off the bus."
    line = json.dumps({"t": after_boot, "msg": msg})
    r = h["xid"].ssh(["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=line + "\n")
    assert r.returncode == 0, r.stderr

    # ... and the inference service dies on another.
    r = h["pers"].ssh("systemctl kill -s KILL sglang-qwen.service")
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 20
    while h["pers"].ssh("systemctl is-failed sglang-qwen.service").stdout.strip() != "failed":
        assert time.monotonic() < deadline, "the killed service did not turn failed"
        time.sleep(0.2)

    proc, night2, _ = run_suite(
        fleet, "night2", "--fix=persistence", "--fix=service", f"--previous={fleet['tmp'] / 'night1.json'}"
    )
    out = proc.stdout + proc.stderr
    xid = cells(night2, h["xid"])["xid"]
    assert (
        xid["outcome"] == "failed"
        and xid["summary"] == "1 Xid error(s) since the last run: code 79 (action: reboot)"
    ), xid
    assert xid["reasons"] == [
        "Xid 79 on 0000:13:00: NVRM: Xid (PCI:0000:13:00): 79, pid=2231, name=python3, GPU has fallen off the bus."
    ]
    for role in ("ok1", "ok2", "pcie", "acs"):
        assert cells(night2, h[role])["xid"]["summary"] == "no Xid errors since the last run"
    pers = cells(night2, h["pers"])
    assert pers["persistence_mode"]["outcome"] == "fixed"
    assert pers["service"]["outcome"] == "fixed", pers["service"]
    assert pers["service_health"]["outcome"] == "passed", pers["service_health"]  # judged after the fix
    comp = night2["comparison"]
    assert {(c["host"], c["check"]) for c in comp["newly_failed"]} == {(h["xid"].name, "xid")}
    assert {(c["host"], c["check"]) for c in comp["recovered"]} == {(h["pers"].name, "persistence_mode")}
    assert (
        f"  newly failed: {h['xid'].name} xid (was passed): 1 Xid error(s) since the last run: code 79 (action: reboot)"
        in out
    )
    # The HTML report (pytest-html, with the engine's evidence) shows the reasons too.
    html = (fleet["tmp"] / "night2.html").read_text()
    assert "PCIe x8, below x16" in html and "GPU has fallen off the bus" in html
    assert 'id="gpuhost-fleet"' in html and f"newly failed: {h['xid'].name} xid (was passed)" in html

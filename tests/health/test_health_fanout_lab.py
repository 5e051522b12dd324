"""suites/health --check-only in one process (the threads' fan-out) and with xdist workers: the same verdicts.

`fit_workers` runs a --check-only run of a few targets in the controller, without the workers
that `-n 2` asked for; `--gpuhost-scheduling=workers` keeps them. Three lab hosts (healthy, degraded
PCIe links, ACS redirect), each way, over real SSH: every check of every host gets the same outcome,
summary (measured numbers masked) and reasons (the Xid checks' summaries aside: the first run
records the baseline).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ROLES = {"ok": "health-ok", "pcie": "health-pcie-degraded", "acs": "health-acs-redirect"}


@pytest.fixture(scope="module")
def three(lab: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("health-fanout")
    tag = f"hf{os.getpid() % 100000}"
    hosts = {role: lab.host(profile, name=f"{tag}-{role}") for role, profile in ROLES.items()}
    (tmp / "known_hosts").write_text("".join(Path(h.known_hosts).read_text() for h in hosts.values()))
    lines = ["all:", "  vars: {ansible_user: root, service: sglang-qwen, service_port: 30000, gpu_count: 4}"]
    lines += ["  hosts:"] + [f"    {h.name}: {{ansible_host: {h.address}}}" for h in hosts.values()]
    (tmp / "fleet.yaml").write_text("\n".join(lines) + "\n")
    return {"hosts": hosts, "tmp": tmp}


def run(three: dict[str, Any], name: str, *extra: str) -> tuple[str, dict[str, Any]]:
    tmp = three["tmp"]
    argv = [
        sys.executable, "-m", "pytest", "suites/health", "-n", "2", "-p", "no:cacheprovider", "-o", "addopts=",
        f"--inventory={tmp / 'fleet.yaml'}", "--ssh-identity=/run/gpulab/id_ed25519",
        f"--known-hosts={tmp / 'known_hosts'}", "--check-only", "--report-dir=none",
        f"--fleet-json={tmp / name}.json", *extra,
    ]  # fmt: skip
    env = dict(os.environ, GPUHOST_CONTROLLER_STATE_DIR=str(tmp / f"state-{name}"))
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, env=env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]  # the degraded hosts fail their checks
    return out, json.loads((tmp / f"{name}.json").read_text())


def same(summary: str) -> str:
    """A summary with its measured numbers (a response time, a temperature) masked."""
    return re.sub(r"[0-9]+(\.[0-9]+)?", "N", summary)


def test_in_process_and_workers_give_the_same_verdicts(three: dict[str, Any]) -> None:
    out_in, fan = run(three, "in-process")
    out_xd, xd = run(three, "workers", "--gpuhost-scheduling=workers")
    assert "checking in this process, no workers" in out_in, out_in[-2000:]
    assert "created: 2/2 workers" in out_xd, out_xd[-2000:]
    assert "created:" not in out_in
    for role, h in three["hosts"].items():
        a, b = fan["hosts"][h.name]["checks"], xd["hosts"][h.name]["checks"]
        assert a.keys() == b.keys() and len(a) > 20, (role, sorted(a))
        for check in a:
            assert (a[check]["outcome"], a[check].get("reasons")) == (
                b[check]["outcome"],
                b[check].get("reasons"),
            )
            if check not in ("xid", "sxid"):  # the first run records the baseline: its own words
                assert same(a[check]["summary"]) == same(b[check]["summary"]), (role, check)
        # Every host was read once, in one request (+ the cursor commit), whichever way.
        assert fan["hosts"][h.name]["round_trips"] <= 2
    assert fan["hosts"][three["hosts"]["pcie"].name]["checks"]["pcie_link"]["outcome"] == "failed"
    assert fan["hosts"][three["hosts"]["ok"].name]["status"] == "ok"

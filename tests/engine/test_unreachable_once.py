"""A host that cannot be reached is said once per host, not once per check.

The health suite runs in a subprocess, as an operator runs it, against two addresses nothing
answers on (a refused loopback port and a second one), with xdist, so the reports travel from
the workers. The terminal has no error per check; every output still has every check.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from pytest_gpuhost.report.summary import summary_lines
from tests.helpers.sshd import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_unreachable_hosts_are_one_line_each(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    inventory = tmp_path / "fleet.yaml"
    inventory.write_text(
        "all:\n  hosts:\n"
        + "".join(
            f"    gpu-0{i}: {{ansible_host: 127.0.0.1, ansible_port: {p}, ansible_user: root}}\n"
            for i, p in enumerate(ports, 7)
        )
    )
    argv = [
        sys.executable, "-m", "pytest", "suites/health", "-n", "2", "-p", "no:cacheprovider", "-o", "addopts=",
        f"--inventory={inventory}", "--connect-timeout=3", f"--report-dir={tmp_path}",
        "--report-name=down", "-rfE",
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # the checks still fail the run
    summary = json.loads((tmp_path / "fleet-summary.json").read_text())
    n = len(summary["checks"])
    assert n >= 20, summary["checks"]

    # the terminal: each host's first check is its one error (message and hints, as any), the
    # others count as unreachable; the fleet summary and the answer say each host once more
    assert len(re.findall(r"^ERROR ", out, re.M)) == 2, out[-4000:]
    assert re.search(rf"^=+ 2 errors, {2 * n - 2} unreachable in ", out, re.M), out[-2000:]
    for i, port in enumerate(ports, 7):
        said = [line for line in out.splitlines() if f"gpu-0{i}" in line and "_ ERROR at" not in line]
        cause = f"cannot reach root@127.0.0.1:{port}: Connection refused"
        assert f"  gpu-0{i}: unreachable: {cause}; {n} checks not run" in said, said
        assert f"gpu-0{i}: UNREACHABLE: {cause}; {n} of {n} checks not run" in said, said
        assert len(said) == 4, said  # + its error's message and its short-summary line

        # the fleet summary and the JSON evidence keep every check, each marked unreachable
        host = summary["hosts"][f"gpu-0{i}"]
        assert host["status"] == "error"
        assert {c["outcome"] for c in host["checks"].values()} == {"error"}
        assert {c["unreachable"] for c in host["checks"].values()} == {cause}, host["checks"]
    evidence = json.loads((tmp_path / "down.json").read_text())
    tests = [t for t in evidence["tests"] if t["target"]]
    assert len(tests) == 2 * n and all(t.get("unreachable") for t in tests), tests[:2]


def test_a_host_with_a_failure_besides_is_listed_as_before() -> None:
    """Only a host whose every bad check is the host not answering gets the one line."""
    down = {"outcome": "error", "summary": "ConnectError: ...", "unreachable": "timed out"}
    failed = {"outcome": "failed", "summary": "Xid 79 on GPU 3"}
    fleet = {
        "checks": ["gpu_count", "xid"],
        "hosts": {
            "gpu-07": {"status": "error", "checks": {"gpu_count": down, "xid": down}},
            "gpu-08": {"status": "error", "checks": {"gpu_count": down, "xid": failed}},
        },
    }
    lines = summary_lines(fleet)
    assert "  gpu-07: unreachable: timed out; 2 checks not run" in lines
    assert [line for line in lines if "gpu-08" in line] == [
        "  gpu-08 gpu_count: error: ConnectError: ...",
        "  gpu-08 xid: failed: Xid 79 on GPU 3",
    ]

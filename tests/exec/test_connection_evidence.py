"""Each run's evidence says how every target was reached: the SSH client (OpenSSH or paramiko) and its version.

Runs against the real sshd on loopback (tests/helpers/sshd.py), with the OpenSSH client and with
`ssh` hidden from PATH (the paramiko fallback), in one process and under xdist (a worker's
connections reach the controller's JSON and HTML).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import paramiko
import pytest

TESTS = """
def test_one(target):
    assert target.conn.run(["true"]).ok

def test_two(target):
    assert target.conn.run(["true"]).ok
"""


def _ssh_version() -> str:
    r = subprocess.run(["ssh", "-V"], capture_output=True, text=True, check=False)
    return (r.stderr or r.stdout).strip().splitlines()[0]


@pytest.mark.parametrize("xdist", [False, True], ids=["one-process", "xdist"])
def test_run_evidence_names_the_ssh_client_and_version(
    pytester: pytest.Pytester, sshd: Any, ssh_client_kind: str, xdist: bool
) -> None:
    want = _ssh_version() if ssh_client_kind == "openssh" else f"paramiko {paramiko.__version__}"
    pytester.makepyfile(test_conn=TESTS)
    reports = pytester.path / "reports"
    r = pytester.runpytest_subprocess(
        f"--host={sshd.url}", f"--ssh-identity={sshd.identity}", f"--known-hosts={sshd.known_hosts}",
        f"--report-dir={reports}", "--report-name=conn", "-p", "no:cacheprovider",
        *(["-n", "2"] if xdist else []),
    )  # fmt: skip
    r.assert_outcomes(passed=2)
    doc = json.loads((reports / "conn.json").read_text())
    (conn,) = doc["session"]["connections"]
    assert conn["target"] == "127.0.0.1" and conn["to"] == "host", conn
    assert conn["client"] == ssh_client_kind and conn["version"] == want and conn["mode"] == "agent", conn
    # the test that opened it carries it in its own evidence too
    carried = [t for t in doc["tests"] if any("connections" in ev for ev in t.get("evidence", {}).values())]
    assert len(carried) == 1, [t["nodeid"] for t in doc["tests"]]
    page = (reports / "conn.html").read_text()
    assert 'id="gpuhost-connections"' in page and want.split(",")[0] in page


def test_local_target_says_local(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_conn=TESTS)
    reports = pytester.path / "reports"
    r = pytester.runpytest_subprocess(
        "--host=local://", f"--report-dir={reports}", "--report-name=conn", "-p", "no:cacheprovider"
    )
    r.assert_outcomes(passed=2)
    (conn,) = json.loads((reports / "conn.json").read_text())["session"]["connections"]
    assert conn["client"] == "local" and conn["version"] == "" and conn["mode"] == "agent", conn


def test_client_version_is_read_once_per_process(tmp_path: Path) -> None:
    """`client_version` is read once per process (a cache), so many targets cost one `ssh -V`."""
    code = (
        "from pytest_gpuhost.run.targets_stash import client_version as v; "
        "a = v('openssh'); b = v('openssh'); print(v.cache_info().hits, a == b)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert r.stdout.split() == ["1", "True"]

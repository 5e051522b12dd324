"""The node's Python over SSH, in lab hosts built from real interpreters (gpulab/host/pythons.py).

Each shape answered as an operator needs it: CPython 3.6 (the agent's floor) and RHEL 8's
platform-python run the agent, and the health suite passes on the 3.6 node; a node whose only
good Python is the inference server's own runs the agent on that one; Python 2.7 as `python3`,
Debian's python3-minimal (no json) and no Python at all give the channel-per-command fallback
and one line naming what was found and what the agent needs, which the run's evidence keeps
with the connection's mode. The service's health probe runs under the interpreter the
agent found, or curl where there is none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpulab.host import pythons as labpy
from gpulab.profiles.python_variants import LAB_PYTHON, node_python_profile
from pytest_gpuhost.errors import AgentError
from pytest_gpuhost.exec.agent import agent_needs
from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url
from pytest_gpuhost.modules.service import check_health

REPO = Path(__file__).resolve().parents[2]
NEEDS = f"the agent needs Python >= 3.6 with {', '.join(agent_needs())}"
#: (shape, its services run) -> (mode, the interpreter the agent runs on | the line after "NAME: ").
#: Without services no Python runs on the node; with them, the SGLang server's own interpreter
#: (LAB_PYTHON, as a virtualenv's) is the agent's last candidate.
EXPECT = {
    ("cpython-3.6", True): ("agent", "/usr/local/bin/python3"),
    ("platform-python", True): ("agent", "/usr/libexec/platform-python"),
    ("python2", True): ("agent", f"/{LAB_PYTHON}"),
    ("python2", False): (
        "fallback",
        "no usable Python: python3 (/usr/local/bin/python3) is Python 2.7.18 (needs 3.6+), "
        f"/usr/libexec/platform-python absent, no python3.6 to python3.14, no Python running; {NEEDS}",
    ),
    ("minimal", False): (
        "fallback",
        "no usable Python: python3 (/usr/local/bin/python3) is Python 3.11.2 without json, "
        "python3.11 (/usr/local/bin/python3.11) is Python 3.11.2 without json, "
        f"/usr/libexec/platform-python absent, no python3.6 to python3.14, no Python running; {NEEDS}",
    ),
    ("none", False): (
        "fallback",
        "no usable Python: python3 absent, /usr/libexec/platform-python absent, no python3.6 to python3.14, "
        f"no Python running; {NEEDS}",
    ),
}
NONE = EXPECT[("none", False)][1]


def boot(lab: Any, shape: str, services: bool = True) -> Any:
    why = labpy.missing(shape)
    if why:
        pytest.skip(why)
    short = shape.replace(".", "").replace("-", "")[:8] + ("" if services else "i")
    return lab.host(node_python_profile(shape, services=services), name=f"py{short}{os.getpid() % 10000}")


def conn_to(h: Any) -> Any:
    opts = TargetOptions(identity="/run/gpulab/id_ed25519", known_hosts=str(h.known_hosts))
    return open_connection(parse_host_url(f"ssh://root@{h.address}", name=h.name), opts)


@pytest.mark.parametrize(
    ("shape", "services"), list(EXPECT), ids=[f"{s}-{'served' if v else 'idle'}" for s, v in EXPECT]
)
def test_each_node_python_is_answered(lab: Any, shape: str, services: bool) -> None:
    h = boot(lab, shape, services)
    mode, want = EXPECT[(shape, services)]
    conn = conn_to(h)
    try:
        assert conn.mode == mode
        if mode == "agent":
            assert conn.python == want, conn.hello
            assert conn.hello["python"] == ("3.11.2" if want == f"/{LAB_PYTHON}" else "3.6.15"), conn.hello
            assert conn.no_python == "" and conn.hello["unavailable"] == {}
            assert conn.round_trips == 1
        else:
            assert conn.no_python == f"{h.name}: {want}"
            assert conn.python == ""
            assert conn.run(["uname", "-n"]).ok  # the fallback still runs commands
            with pytest.raises(AgentError) as info:
                conn.facts("kernel")
            assert str(info.value) == f"facts on {h.name}: needs the agent; {want}"
        if not services:
            return
        # the inference service's health, probed from the node with what the node has
        seen: list[str] = []
        conn.on_command.append(lambda _t, r: seen.append(r.command))
        healthy, answer, _ = check_health(conn, "http://127.0.0.1:30000/health", bound=30)
        assert healthy and answer == "200"
        first = seen[0].split()[0]
        assert first == (want if mode == "agent" else "curl"), seen
    finally:
        conn.close()


def _health_run(h: Any, tmp: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    known = tmp / "known_hosts"
    known.write_text(Path(h.known_hosts).read_text())
    argv = [
        sys.executable, "-m", "pytest", "suites/health", "-p", "no:cacheprovider", f"--host=ssh://root@{h.address}",
        "--ssh-identity=/run/gpulab/id_ed25519", f"--known-hosts={known}", "--connect-timeout=5",
        f"--report-dir={tmp}", "--report-name=py", "--check-only", "-o", "addopts=",
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    return proc, json.loads((tmp / "py.json").read_text())


def test_the_health_suite_runs_on_python_36(lab: Any, tmp_path: Path) -> None:
    """The floor: every check of suites/health judged by an agent on a real CPython 3.6.15."""
    h = boot(lab, "cpython-3.6")
    proc, doc = _health_run(h, tmp_path)
    (conn,) = doc["session"]["connections"]
    assert conn["mode"] == "agent" and "no_python" not in conn, conn
    assert (conn["node_python"], conn["node_executable"]) == ("3.6.15", "/usr/local/bin/python3"), conn
    outcomes = {t["nodeid"].split("::")[-1]: t["outcome"] for t in doc["tests"]}
    assert outcomes and all(o in ("passed", "skipped") for o in outcomes.values()), (
        outcomes,
        proc.stdout[-3000:],
    )


def test_a_node_without_python_is_one_line_in_the_evidence(lab: Any, tmp_path: Path) -> None:
    h = boot(lab, "none", services=False)
    proc, doc = _health_run(h, tmp_path)
    (conn,) = doc["session"]["connections"]
    assert conn["mode"] == "fallback" and conn["no_python"] == f"{h.address}: {NONE}", conn
    assert "node_python" not in conn, conn
    assert "Traceback" not in proc.stdout and "During handling" not in proc.stdout
    # what the operator reads: the line, whole, once per host in each part of the output (the
    # errors, pytest's short summary, which CI=true leaves untruncated, the fleet summary, the
    # answer), never once per check: the other checks refer to it
    assert 1 <= proc.stdout.count(NONE) <= 4, proc.stdout
    assert proc.stdout.count(f"{h.address}: facts not read (AgentError, said at its first check)") >= 26
    page = (tmp_path / "py.html").read_text()
    assert "no usable Python: python3 absent" in page


def test_a_decommission_runs_on_python_36(lab: Any, s3_endpoint: Any, tmp_path: Path) -> None:
    """The floor under the destructive suite: processes, the backup walk and the bulk sender on 3.6.

    The b200-nvl8 node whose `python3` is a real CPython 3.6.15 (its SGLang servers run under
    their own interpreter): every server stopped, every byte in scope copied and in S3.
    """
    from tests.decommission.test_decommission_lab import (
        check_local,
        check_s3,
        node_hashes,
        processes,
        run_suite,
        suite_argv,
    )

    why = labpy.missing("cpython-3.6")
    if why:
        pytest.skip(why)
    h = lab.host(
        node_python_profile("cpython-3.6", base="b200-nvl8"),
        name=f"pyb200{os.getpid() % 10000}",
        data_scale="small",
    )
    assert h.ssh(["python3", "-V"]).stdout.strip() == "Python 3.6.15"
    bucket = s3_endpoint.make_bucket("py36")
    dest = tmp_path / "backup"
    reports = tmp_path / "reports"
    env = {**os.environ, **s3_endpoint.env}
    rc, out, counts = run_suite(suite_argv(h, dest, bucket, "b200", s3_endpoint.url, reports), env)
    assert rc == 0 and counts.get("failed", 0) == 0, out
    assert not any("sglang.launch_server" in p for p in processes(h) if "tail -f" not in p), processes(h)
    hashes = node_hashes(h)
    check_local(dest, hashes, complete=True)
    check_s3(s3_endpoint.client(), bucket, "b200", dest, hashes)
    doc = next(
        json.loads(p.read_text()) for p in sorted(reports.glob("*.json")) if "connections" in p.read_text()
    )
    (conn,) = doc["session"]["connections"]
    assert conn["mode"] == "agent" and "no_python" not in conn, conn
    assert (conn["node_python"], conn["node_executable"]) == ("3.6.15", "/usr/local/bin/python3"), conn

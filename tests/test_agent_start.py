"""How the agent is started: `python3 -S -u -c BOOTSTRAP` (no site initialisation, unbuffered)."""

from __future__ import annotations

import os

from pytest_gpuhost.exec.agent import PYTHON_FLAGS
from pytest_gpuhost.exec.targets import open_connection, parse_host_url


def test_agent_runs_without_site_initialisation() -> None:
    """-S: the target's .pth files are not run (the agent needs the standard library only)."""
    assert PYTHON_FLAGS == ("-S", "-u")
    conn = open_connection(parse_host_url("local://"))
    try:
        pid = conn.call("hello")["pid"]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[1:3] == [b"-S", b"-u"] and argv[3] == b"-c", argv[:4]
        # ...and it still does its work: a command, a read, a fact
        assert conn.run(["true"]).ok
        assert conn.call("facts", names=["kernel"])["kernel"]["release"] == os.uname().release
    finally:
        conn.close()

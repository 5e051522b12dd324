"""Reachability by type: a lost agent, a closed channel or a missing reply raise `Unreachable`.

Callers decide "this target is gone" with `isinstance(exc, Unreachable)`; an operation that fails
on a target that still answers raises another `GpuhostError`.  Local targets and the loopback
sshd stand in for hosts; the SSH link is cut by closing the client's transport under a request.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pytest_gpuhost.errors import AgentError, AgentLost, ConnectError, GpuhostError, Unreachable
from pytest_gpuhost.exec.agent_session import AgentConnection
from pytest_gpuhost.exec.connect import connect
from pytest_gpuhost.exec.connection import Connection, ConnectionOptions
from pytest_gpuhost.exec.fallback import FallbackConnection
from pytest_gpuhost.exec.launch import LocalLauncher
from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url
from tests.helpers.sshd import free_port, start_sshd


def _tools(bindir: Path, *names: str) -> None:
    bindir.mkdir(exist_ok=True)
    for tool in names:
        found = shutil.which(tool)
        assert found, tool
        os.symlink(found, bindir / tool)


def _ssh_opts(sshd, **kw) -> TargetOptions:
    base = {"identity": sshd.identity, "known_hosts": sshd.known_hosts, "connect_timeout": 5.0}
    return TargetOptions(**{**base, **kw})


def _cut_link_after(conn: Connection, seconds: float) -> threading.Timer:
    """Close the client's SSH transport under whatever request is in flight."""
    timer = threading.Timer(seconds, conn.launcher.transport.transport.close)  # type: ignore[attr-defined]
    timer.start()
    return timer


# ------------------------------------------------------------ local targets


def test_kinds_are_picked_in_one_place(tmp_path):
    with open_connection(parse_host_url("local://")) as c:
        assert isinstance(c, AgentConnection) and isinstance(c, Connection) and c.mode == "agent"
    _tools(tmp_path / "bin", "sh", "cat", "timeout")
    with open_connection(parse_host_url(f"local://?path={tmp_path / 'bin'}")) as c:
        assert isinstance(c, FallbackConnection) and isinstance(c, Connection) and c.mode == "fallback"


def test_fallback_can_be_refused(tmp_path):
    _tools(tmp_path / "bin", "sh", "cat", "timeout")
    launcher = LocalLauncher({"PATH": str(tmp_path / "bin")})
    with pytest.raises(
        AgentError, match="t: no usable Python: python3 absent.*; the fallback is disabled"
    ) as info:
        connect("t", launcher, ConnectionOptions(allow_fallback=False))
    assert not isinstance(info.value, Unreachable)


def test_agent_killed_during_a_request_is_unreachable():
    with open_connection(parse_host_url("local://")) as c:
        with pytest.raises(Unreachable) as info:
            c.run("kill -9 $PPID")
        assert isinstance(info.value, AgentLost) and "died during run" in str(info.value)
        assert c.run(["echo", "back"]).stdout == "back\n"  # the next request starts a new agent


def test_no_reply_within_the_reply_timeout_is_unreachable():
    with open_connection(parse_host_url("local://")) as c:
        pid = c.hello["pid"]
        t0 = time.monotonic()
        with pytest.raises(AgentLost, match="gave no reply to run within 0.5s"):
            c.call("run", shell="sleep 30", timeout=60, reply_timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert c.run(["true"]).ok and c.hello["pid"] != pid


def test_agent_lost_during_a_stream_is_unreachable():
    with open_connection(parse_host_url("local://")) as c:
        gen = c.stream("run", shell="echo one; sleep 0.2; kill -9 $PPID; sleep 5", timeout=10, stream=True)
        assert next(gen)["data"] == "one\n"
        with pytest.raises(AgentLost):
            list(gen)
        assert c.run(["echo", "again"]).stdout == "again\n"


def test_agent_that_cannot_be_restarted_is_unreachable(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    marker = tmp_path / "used"
    wrapper = bindir / "python3"  # works once, as if the target then lost its interpreter
    wrapper.write_text(f'#!/bin/sh\n[ -e {marker} ] && exit 1\ntouch {marker}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    with open_connection(parse_host_url(f"local://?path={bindir}:/usr/bin:/bin")) as c:
        with pytest.raises(AgentLost):
            c.run("kill -9 $PPID")
        with pytest.raises(Unreachable, match="cannot start the agent"):
            c.run(["true"])


def test_missing_launcher_program_is_a_connect_error(tmp_path):
    with pytest.raises(ConnectError) as info:
        open_connection(parse_host_url(f"local://?path={tmp_path}&sudo=1"))
    assert isinstance(info.value, Unreachable)


def test_fallback_without_an_exit_status_in_time_is_unreachable(tmp_path):
    bindir = tmp_path / "bin"
    _tools(bindir, "sh", "cat", "sleep")
    (bindir / "timeout").write_text("#!/bin/sh\nexec sleep 60\n")  # a target that stopped answering
    (bindir / "timeout").chmod(0o755)
    with open_connection(parse_host_url(f"local://?path={bindir}")) as c:
        assert c.mode == "fallback"
        t0 = time.monotonic()
        with pytest.raises(AgentLost, match="gave no exit status"):
            c.run(["true"], timeout=1)
        assert time.monotonic() - t0 < 10


def test_failures_on_a_reachable_target_are_not_unreachable(tmp_path):
    with open_connection(parse_host_url("local://")) as c:
        for op in (
            lambda: c.call("no_such_op"),
            lambda: c.run(["false"], check=True),
            lambda: c.run(["sleep", "5"], timeout=0.2, check=True),
        ):
            with pytest.raises(GpuhostError) as info:
                op()
            assert not isinstance(info.value, Unreachable), info.value
    with pytest.raises(AgentError) as closed:
        c.run(["true"])
    assert not isinstance(closed.value, Unreachable)
    _tools(tmp_path / "bin", "sh", "cat", "timeout")
    with open_connection(parse_host_url(f"local://?path={tmp_path / 'bin'}")) as fb:
        with pytest.raises(AgentError, match="needs the agent; no usable Python") as info:
            fb.facts("kernel")
        assert not isinstance(info.value, Unreachable)


# ------------------------------------------------------------ over SSH


def test_refused_port_is_unreachable(sshd):
    with pytest.raises(Unreachable) as info:
        open_connection(parse_host_url(f"ssh://root@127.0.0.1:{free_port()}"), _ssh_opts(sshd))
    assert isinstance(info.value, ConnectError)


def test_link_cut_under_the_agent_is_unreachable_then_reconnects(sshd):
    with open_connection(parse_host_url(sshd.url), _ssh_opts(sshd)) as c:
        timer = _cut_link_after(c, 0.5)
        with pytest.raises(AgentLost):
            c.run(["sleep", "10"])
        timer.join()
        assert c.run(["echo", "back"]).stdout == "back\n"  # a new SSH transport, a new agent


def test_link_cut_and_host_gone_is_unreachable(sshd, tmp_path):
    pub = Path(sshd.identity + ".pub").read_text().strip()
    other = start_sshd(tmp_path / "other", identity=Path(sshd.identity), client_pubkey=pub)
    opts = _ssh_opts(sshd, host_key_policy="accept-new", known_hosts=str(tmp_path / "kh"))
    try:
        c = open_connection(parse_host_url(other.url), opts)
    except BaseException:
        other.stop()
        raise
    try:
        assert c.run(["true"]).ok
        other.stop()  # no new logins; the running session lives on until the link is cut
        timer = _cut_link_after(c, 0.3)
        with pytest.raises(AgentLost):
            c.run(["sleep", "10"])
        timer.join()
        with pytest.raises(Unreachable, match="reconnecting failed"):
            c.run(["true"])
    finally:
        c.close()
        other.stop()


def test_link_cut_under_the_fallback_is_unreachable(sshd):
    with open_connection(parse_host_url(sshd.nopython_url), _ssh_opts(sshd)) as c:
        assert c.mode == "fallback"
        timer = _cut_link_after(c, 0.5)
        t0 = time.monotonic()
        with pytest.raises(AgentLost, match="closed"):
            c.run(["sleep", "10"])
        assert time.monotonic() - t0 < 5
        timer.join()
        assert c.run(["echo", "back"]).stdout == "back\n"


# ------------------------------------------------------------ layering


def test_exec_imports_neither_pytest_nor_the_run_layer():
    code = (
        "import sys\n"
        "import pytest_gpuhost.exec.targets, pytest_gpuhost.exec.inventory, pytest_gpuhost.exec.ssh.paramiko\n"
        "bad = sorted(m for m in sys.modules if m in ('pytest', '_pytest') or m.startswith('pytest_gpuhost.run'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"

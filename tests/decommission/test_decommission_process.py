"""Process selection and stopping over a real local:// agent, with real processes and decoys."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.process import Matcher, ProcessTable, Selection, parse_selection, stop_processes

SERVER = "import time\nwhile True: time.sleep(1)"
STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)"


@pytest.fixture
def conn():
    c = open_connection(parse_host_url("local://"))
    yield c
    c.close()


def _wait_started(p: subprocess.Popen[bytes], ignores_term: bool, timeout: float = 20) -> None:
    """Wait until `p` runs its own program (and, for STUBBORN, ignores SIGTERM): a sleep only hopes so."""
    own = Path("/proc/self/cmdline").read_bytes()
    deadline = time.monotonic() + timeout
    while True:
        try:
            cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes()
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            cmdline, status = own, ""
        sig_ign = int(
            next((ln.split()[1] for ln in status.splitlines() if ln.startswith("SigIgn:")), "0"), 16
        )
        if cmdline != own and (not ignores_term or sig_ign & (1 << (signal.SIGTERM - 1))):
            return
        assert p.poll() is None and time.monotonic() < deadline, f"{p.args} did not start"
        time.sleep(0.02)


@pytest.fixture
def procs():
    started: list[subprocess.Popen[bytes]] = []

    def start(*argv: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(list(argv), start_new_session=True)
        started.append(p)
        _wait_started(p, ignores_term=STUBBORN in argv)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def test_matchers_select_servers_not_decoys_and_stop_them(conn, procs):
    mod = f"fake_sglang_{uuid.uuid4().hex[:8]}.launch_server"
    py = os.path.basename(sys.executable)
    server = procs(sys.executable, "-c", SERVER, "-m", mod)
    stubborn = procs(sys.executable, "-c", STUBBORN, "-m", mod)
    decoy_arg = procs(sys.executable, "-c", SERVER, f"notes-about-{mod}.md")
    decoy_sh = procs("sh", "-c", "sleep 60", "-m", mod)
    sel = parse_selection(
        {
            "match": [{"argv0": r"python3?(\.[0-9]+)?|" + py, "module": mod}],
            "term_timeout": 2,
            "kill_timeout": 5,
        }
    )
    chosen = ProcessTable.read(conn).select(sel)
    assert sorted(p.pid for p, _ in chosen) == sorted([server.pid, stubborn.pid])
    recorded = []
    res = stop_processes(
        conn,
        [p for p, _ in chosen],
        term_timeout=2,
        kill_timeout=5,
        record=lambda label, value: recorded.append((label, value)),
    )
    # the selection was recorded before any signal, with PIDs and command lines
    assert recorded[0][0] == "selected for stop"
    assert {r["pid"] for r in recorded[0][1]} == {server.pid, stubborn.pid}
    assert all(mod in r["cmdline"] for r in recorded[0][1])
    assert (
        res.ok and sorted(res.termed) == sorted([server.pid, stubborn.pid]) and res.killed == [stubborn.pid]
    )
    assert server.wait(timeout=5) == -signal.SIGTERM and stubborn.wait(timeout=5) == -signal.SIGKILL
    assert decoy_arg.poll() is None and decoy_sh.poll() is None


def test_never_the_run_itself_and_never_a_reused_pid(conn, procs):
    table = ProcessTable.read(conn)
    everything = table.select(Selection(matchers=(Matcher(argv0=".*"),)))
    pids = {p.pid for p, _ in everything}
    assert os.getpid() not in pids and table.own_pid not in pids and 1 not in pids
    assert os.getpid() in table.own_ancestors
    victim = procs(sys.executable, "-c", SERVER)
    me = next(p for p in ProcessTable.read(conn).procs if p.pid == victim.pid)
    # a PID whose start time differs is another process: never signalled
    res = conn.call("proc_signal", targets=[{"pid": me.pid, "starttime": me.starttime + 1}], signal=9)
    assert res[0]["status"] == "reused" and victim.poll() is None
    res = conn.call("proc_signal", targets=[{"pid": table.own_pid, "starttime": 0}], signal=9)
    assert res[0]["status"] == "refused"
    res = conn.call("proc_signal", targets=[{"pid": me.pid, "starttime": me.starttime}], signal=15)
    assert res[0]["status"] == "sent" and victim.wait(timeout=5) == -signal.SIGTERM


def test_matcher_is_not_a_substring_match():
    from pytest_gpuhost.modules.process import Proc

    def proc(*argv: str) -> Proc:
        return Proc(10, 1, 10, 5, "S", tuple(argv), None, "/user.slice", argv[0])

    m = Matcher(argv0=r"python3?(\.[0-9]+)?", module="sglang.launch_server")
    assert m.matches(proc("python3", "-m", "sglang.launch_server", "--port", "30000"))
    assert m.matches(proc("/usr/bin/python3.11", "-m", "sglang.launch_server"))
    assert not m.matches(proc("vim", "/data/sglang_notes.md"))
    assert not m.matches(proc("tail", "-f", "/data/logs/sglang.launch_server.log"))
    assert not m.matches(proc("python3", "/opt/tools/sglang.launch_server_monitor.py"))
    assert not m.matches(proc("bash", "-c", "python3 -m sglang.launch_server"))
    unit = Selection(units=("sglang-*.service",))
    p = Proc(11, 1, 11, 5, "S", ("x",), None, "/system.slice/sglang-qwen.service", "x")
    assert p.unit == "sglang-qwen.service" and unit.units
    with pytest.raises(ValueError, match="argv0"):
        parse_selection({"match": [{"argv0": "("}]})
    with pytest.raises(ValueError, match="unknown"):
        parse_selection({"kill": "all"})

"""Process selection by tree and by GPU use: synthetic tables, then real renamed children over local://."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.process import Matcher, ProcessTable, Selection, parse_selection, stop_processes

SGLANG = Matcher(argv0=r"python3?(\.[0-9]+)?", module="sglang.launch_server", name="sglang server")
SERVER = ("python3", "-m", "sglang.launch_server", "--port", "30000")
PAD = ("",) * 40  # what /proc/PID/cmdline holds after setproctitle: the title, then NUL padding


def row(pid: int, ppid: int, argv: tuple[str, ...], start: int = 100, **kw: Any) -> dict[str, Any]:
    return {
        "pid": pid,
        "ppid": ppid,
        "sid": kw.get("sid", pid),
        "starttime": start,
        "state": kw.get("state", "S"),
        "argv": list(argv),
        "exe": "/usr/bin/python3.11",
        "cgroup": "/user.slice/session-1.scope",
        "comm": argv[0][:15] if argv else kw.get("comm", "kworker/0:1"),
        "gpus": kw.get("gpus", []),
    }


def table(*rows: dict[str, Any], own: int = 9000) -> ProcessTable:
    me = row(own, 8999, ("python3", "-c", "agent"), sid=8000)
    return ProcessTable.from_result(
        {"processes": [*rows, me], "self": {"pid": own, "ancestors": [8999, 1], "sid": 8000}}
    )


def sglang_dp_node() -> list[dict[str, Any]]:
    """An SGLang server with data parallelism, as ps shows it on a B200 node (titles, not argv)."""
    return [
        row(1, 0, ("/sbin/init",), start=1),
        row(2, 0, (), start=1, comm="kthreadd"),
        row(3, 2, (), start=1, comm="kworker/0:1"),
        row(100, 1, SERVER, start=100),
        row(101, 100, ("sglang::data_parallel_controller", *PAD), start=110),
        row(102, 101, ("sglang::scheduler_DP0_TP0", *PAD), start=120, gpus=["/dev/nvidia0"]),
        row(103, 101, ("sglang::scheduler_DP1_TP0", *PAD), start=120, gpus=["/dev/nvidia1"]),
        row(104, 100, ("sglang::detokenizer", *PAD), start=111),
        row(200, 1, ("vim", "/data/sglang_notes.md"), start=50),
        row(201, 1, ("tail", "-f", "/data/logs/sglang-dp0.log"), start=50),
    ]


def test_renamed_children_and_grandchildren_are_selected_with_the_server() -> None:
    chosen = table(*sglang_dp_node()).select(Selection(matchers=(SGLANG,)))
    assert [p.pid for p, _ in chosen] == [100, 101, 102, 103, 104]
    why = {p.pid: w for p, w in chosen}
    assert why[100] == "matcher sglang server"
    assert why[102] == "descendant of PID 100 (matcher sglang server)"
    # the evidence carries PID, start time and the title as ps shows it (no NUL padding)
    rec = {p.pid: p.record() for p, _ in chosen}
    assert rec[102]["cmdline"] == "sglang::scheduler_DP0_TP0" and rec[102]["starttime"] == 120
    assert rec[102]["gpus"] == ["/dev/nvidia0"] and rec[102]["ppid"] == 101


def test_orphans_holding_gpus_are_found_only_by_gpu_use() -> None:
    # the server died; its schedulers were reparented to PID 1 and keep the GPUs (sglang#23627)
    rows = [r for r in sglang_dp_node() if r["pid"] not in (100, 101)]
    for r in rows:
        if r["pid"] in (102, 103, 104):
            r["ppid"] = 1
    rows.append(row(105, 102, ("python3", "-c", "helper"), start=130))
    t = table(*rows)
    assert t.select(Selection(matchers=(SGLANG,))) == []
    chosen = t.select(Selection(matchers=(SGLANG,), gpu_holders=True))
    assert [p.pid for p, _ in chosen] == [102, 103, 105]  # the helper goes with its GPU-holding parent
    why = {p.pid: w for p, w in chosen}
    assert why[102] == "holds /dev/nvidia0" and why[105] == "descendant of PID 102 (holds /dev/nvidia0)"
    # a title matcher finds the GPU-less detokenizer too
    by_title = Selection(matchers=(Matcher(argv0=r"sglang::.*"),))
    assert [p.pid for p, _ in t.select(by_title)] == [102, 103, 104, 105]


def test_gpu_holders_are_workloads_not_the_drivers_daemons() -> None:
    rows = [
        row(10, 1, ("/usr/bin/nvidia-persistenced", "--verbose"), gpus=["/dev/nvidia0", "/dev/nvidiactl"]),
        row(11, 1, ("/usr/bin/python3", "/usr/bin/nvidia-persistenced"), gpus=["/dev/nvidia0"]),  # a script
        row(12, 1, ("/usr/bin/nv-fabricmanager", "-c", "fm.cfg"), gpus=["/dev/nvidia-nvswitchctl"]),
        row(13, 1, ("python3", "train.py"), gpus=["/dev/nvidia1"]),
    ]
    t = table(*rows)
    assert [p.pid for p, _ in t.select(Selection(gpu_holders=True))] == [13]
    named = Selection(matchers=(Matcher(argv0="nvidia-persistenced"),), gpu_holders=True)
    assert [p.pid for p, _ in t.select(named)] == [10, 13]  # a matcher still names it


def test_a_reused_parent_pid_never_adopts_an_older_process() -> None:
    # PID 100 exited and was reused by a new server between two reads of /proc; 300 is older
    # than the process now called 100, so it cannot be its child
    rows = [row(100, 1, SERVER, start=500), row(300, 100, ("postgres",), start=400)]
    assert [p.pid for p, _ in table(*rows).select(Selection(matchers=(SGLANG,)))] == [100]


def test_never_the_run_itself_pid_1_or_kernel_threads() -> None:
    rows = [
        row(1, 0, ("/sbin/init",), start=1),
        row(2, 0, (), start=1, comm="kthreadd"),
        row(3, 2, ("kworker",), start=1, gpus=["/dev/nvidia0"]),
        row(8999, 1, SERVER, start=10, sid=8000),  # the agent's parent matches: refused, with its tree
        row(9001, 9000, SERVER, start=20, sid=8000),  # in the agent's session
        row(9100, 1, SERVER, start=30),
        row(9101, 9100, ("python3", "-c", "x"), start=31, sid=8000),  # a child in our session
    ]
    chosen = table(*rows).select(Selection(matchers=(SGLANG, Matcher(argv0=".*")), gpu_holders=True))
    assert [p.pid for p, _ in chosen] == [9100]


def test_zombies_cycles_and_deep_chains() -> None:
    rows = [row(100, 1, SERVER, start=100), row(101, 100, (), start=101, state="Z")]
    chain = [row(1000 + i, 999 + i if i else 100, ("w",), start=200 + i) for i in range(3000)]
    loop = [row(50, 51, SERVER, start=5), row(51, 50, ("x",), start=5)]  # an inconsistent read
    chosen = table(*rows, *chain, *loop).select(Selection(matchers=(SGLANG,)))
    pids = [p.pid for p, _ in chosen]
    assert 101 not in pids and pids[:3] == [50, 51, 100] and len(pids) == 3 + 3000


def test_gpu_holders_key_is_parsed_and_strict() -> None:
    assert parse_selection({"gpu_holders": True}).gpu_holders
    assert not parse_selection({"match": [{"module": "m"}]}).gpu_holders
    bad: list[dict[str, Any]] = [
        {"gpu_holder": True},
        {"gpu_holders": "false"},
        {"match": [{"module": "m", "args": "--port"}]},
        {"match": [{"argv0": 3}]},
        {"match": {"module": "m"}},
        {"units": [1]},
        {"term_timeout": float("nan")},
        {"term_timeout": -1},
        {"kill_timeout": 10**9},
        {"kill_timeout": True},
    ]
    for doc in bad:
        with pytest.raises(ValueError) as exc:
            parse_selection(doc)
        assert "\n" not in str(exc.value), doc
    sel = parse_selection({"units": "sglang-*.service", "match": [{"module": "m", "args": ["--port", "1"]}]})
    assert sel.units == ("sglang-*.service",) and sel.matchers[0].args == ("--port", "1")


# ---------------------------------------------------------------- real processes over local://

# A server that starts two renamed workers (argv[0] is the title, as ps shows SGLang's), one of
# them with a child of its own, and after LATE seconds one more worker: the one forked while the
# operator reads the plan.
PARENT = """
import os, subprocess, sys, time
title = sys.argv[1]
kid = "import subprocess, sys, time\\nif sys.argv[1:2] == ['nest']:\\n    subprocess.Popen(['sglang::nested', '-c', 'import time; time.sleep(600)'], executable=sys.argv[2])\\ntime.sleep(600)"
subprocess.Popen([title + "scheduler_TP0", "-c", kid, "nest", sys.executable], executable=sys.executable)
subprocess.Popen([title + "detokenizer", "-c", kid], executable=sys.executable)
time.sleep(float(sys.argv[2]))
subprocess.Popen([title + "late", "-c", kid], executable=sys.executable)
time.sleep(600)
"""


@pytest.fixture
def conn():
    c = open_connection(parse_host_url("local://"))
    yield c
    c.close()


def _tree(pid: int) -> set[int]:
    out = {pid}
    for _ in range(4):
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid in out:
                    out.add(int(p.name))
    return out


def test_stop_takes_the_whole_tree_and_late_children_not_lookalikes(conn) -> None:
    mod = f"fake_sglang_{uuid.uuid4().hex[:8]}.launch_server"
    title = f"t{uuid.uuid4().hex[:6]}::"
    server = subprocess.Popen([sys.executable, "-c", PARENT, title, "1.5", "-m", mod], start_new_session=True)
    lookalike = subprocess.Popen(
        [title + "scheduler_TP0", "-c", "import time; time.sleep(600)"],
        executable=sys.executable,
        start_new_session=True,
    )
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 10
        while len(_tree(server.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        sel = Selection(matchers=(Matcher(module=mod),))
        chosen = ProcessTable.read(conn).select(sel)
        titles = sorted(p.cmdline.split()[0] for p, _ in chosen[1:])
        assert [p.pid for p, _ in chosen][0] == server.pid and lookalike.pid not in {p.pid for p, _ in chosen}
        assert titles == sorted([title + "scheduler_TP0", title + "detokenizer", "sglang::nested"])
        while len(_tree(server.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # the late worker appears after the selection
        tree = _tree(server.pid)
        recorded: list[Any] = []
        res = stop_processes(
            conn,
            [p for p, _ in chosen],
            term_timeout=5,
            kill_timeout=5,
            record=lambda k, v: recorded.append((k, v)),
        )
        assert res.ok and set(res.termed) == tree and len(tree) == 5
        assert recorded[0][0] == "selected for stop"
        assert any(r["cmdline"].startswith(title + "late") for r in recorded[0][1])
        assert all({"pid", "starttime", "cmdline"} <= r.keys() for r in recorded[0][1])
        assert server.wait(5) == -signal.SIGTERM and lookalike.poll() is None
    finally:
        for pid in [*tree, lookalike.pid, server.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.wait(5)
        lookalike.wait(5)


# Ignores SIGTERM and answers it by forking a new worker: the one SIGKILL must take it too.
RESPAWNER = """
import signal, subprocess, sys, time
def respawn(*_):
    subprocess.Popen([sys.argv[1] + "respawned", "-c", "import time; time.sleep(600)"], executable=sys.executable)
signal.signal(signal.SIGTERM, respawn)
while True:
    time.sleep(0.1)
"""


def test_children_forked_while_sigterm_is_ignored_are_killed_with_their_parent(conn) -> None:
    mod = f"fake_sglang_{uuid.uuid4().hex[:8]}.launch_server"
    title = f"t{uuid.uuid4().hex[:6]}::"
    server = subprocess.Popen([sys.executable, "-c", RESPAWNER, title, "-m", mod], start_new_session=True)
    tree: set[int] = set()
    try:
        time.sleep(0.3)
        chosen = ProcessTable.read(conn).select(Selection(matchers=(Matcher(module=mod),)))
        assert [p.pid for p, _ in chosen] == [server.pid]
        recorded: list[Any] = []
        res = stop_processes(
            conn,
            [p for p, _ in chosen],
            term_timeout=1,
            kill_timeout=5,
            record=lambda k, v: recorded.append((k, v)),
        )
        added = dict(recorded).get("added before SIGKILL")
        assert added and added[0]["cmdline"].startswith(title + "respawned"), recorded
        tree = {server.pid, *(r["pid"] for r in added)}
        assert res.ok and set(res.killed) == tree and server.wait(5) == -signal.SIGKILL
        assert [r["pid"] for r in res.selected] == [server.pid, *(r["pid"] for r in added)]
        for pid in tree - {server.pid}:  # gone, or a zombie until its new parent reaps it
            try:
                state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            assert state == b"Z", pid
    finally:
        for pid in [*tree, server.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.wait(5)

"""The agent and the Connection over local:// (real processes on this machine)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from pytest_gpuhost.errors import AgentError, CommandTimeout, GpuhostError
from pytest_gpuhost.exec.agent import (
    BOOTSTRAP,
    CORE_FILES,
    PYTHON_FLAGS,
    _core,
    agent_source,
    core,
    probe_files,
    probe_program,
)
from pytest_gpuhost.exec.connection import CommandResult, Connection
from pytest_gpuhost.exec.targets import open_connection, parse_host_url


@pytest.fixture(scope="module")
def conn():
    c = open_connection(parse_host_url("local://"))
    yield c
    c.close()


def test_program_is_core_probes_then_main():
    src = agent_source()
    assert src.rstrip().endswith("main()")
    assert src.count("\nload_probe(") == len(probe_files()) > 0
    assert "\nfrom __future__ import" not in src
    compile(src, "<agent>", "exec")
    ast.parse(src, feature_version=(3, 6))  # old targets: no walrus, no 3.8+ grammar
    assert len(BOOTSTRAP) < 400


def _serve(program: str, *requests: dict) -> list[dict]:
    """Start `program` the way a connection does (bootstrap, payload); return one reply per request."""
    body = zlib.compress(program.encode("utf-8"), 9)
    lines = b"".join(json.dumps(r).encode() + b"\n" for r in requests)
    proc = subprocess.run(
        [sys.executable, "-u", "-c", BOOTSTRAP],
        input=b"%d\n" % len(body) + body + lines,
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _probe(name: str, source: str) -> str:
    return f"load_probe({name!r}, {source!r})\n"


def test_each_probe_runs_in_a_module_of_its_own():
    """Two probes may use the same private name; a probe written for the shared namespace still runs."""
    importing = (
        "from pytest_gpuhost.exec.agent.core import op, read_str\n"
        "_ME = 'a'\n"
        "@op('who_a')\n"
        "def who(params):\n"
        "    return [_ME, read_str('/proc/sys/kernel/osrelease'), __name__]\n"
    )
    bare = "_ME = 'b'\n@op('who_b')\ndef who(params):\n    return [_ME, run_process(argv=['true'], timeout=5)['rc']]\n"
    program = _core() + _probe("probe_a", importing) + _probe("probe_b", bare) + "main()\n"
    a, b = _serve(program, {"id": 1, "op": "who_a"}, {"id": 2, "op": "who_b"})
    assert a["result"] == ["a", os.uname().release, "__gpuhost_agent__.probe_a"]
    assert b["result"] == ["b", 0]


def test_a_probe_that_fails_to_load_stops_the_agent():
    program = (
        _core() + _probe("probe_bad", "from pytest_gpuhost.exec.agent.core import nothing\n") + "main()\n"
    )
    with pytest.raises(AssertionError, match="ImportError"):
        _serve(program, {"id": 1, "op": "hello"})


def test_a_probe_whose_module_is_missing_is_unavailable_and_the_agent_serves_the_rest():
    """A module the node's Python lacks makes its probe (and the probes importing it) unavailable."""
    missing = (
        "from pytest_gpuhost.exec.agent.core import fact, op\n"
        "@op('early')\n"
        "def early(params):\n"
        "    return 1\n"
        "import gpuhost_no_such_module\n"
        "@op('opt_stream', stream=True)\n"
        "def opt_stream(params, emit):\n"
        "    return 2\n"
        "@fact('opt_fact')\n"
        "def opt_fact(params):\n"
        "    return 3\n"
    )
    dependent = (
        "from pytest_gpuhost.exec.agent.probe_opt import early\n@op('dep')\ndef dep(params):\n    return 4\n"
    )
    fine = "from pytest_gpuhost.exec.agent.core import op\n@op('fine')\ndef fine(params):\n    return 5\n"
    program = (
        _core()
        + _probe("probe_opt", missing)
        + _probe("probe_dep", dependent)
        + _probe("probe_fine", fine)
        + "main()\n"
    )
    hello, early, stream, facts, dep, ok = _serve(
        program,
        {"id": 1, "op": "hello"},
        {"id": 2, "op": "early"},
        {"id": 3, "op": "opt_stream"},
        {"id": 4, "op": "facts", "names": ["opt_fact", "kernel"]},
        {"id": 5, "op": "dep"},
        {"id": 6, "op": "fine"},
    )
    why = "this Python has no module 'gpuhost_no_such_module'"
    assert hello["result"]["unavailable"] == {
        "probe_opt": why,
        "probe_dep": f"it needs probe_opt, which is unavailable: {why}",
    }
    # what the probe registered before the import failed is taken back, not left half-loaded
    assert early["error"] == f"early is unavailable on this node: probe_opt: {why}"
    assert stream["error"] == f"opt_stream is unavailable on this node: probe_opt: {why}"
    assert facts["result"]["opt_fact"] == {"error": f"opt_fact is unavailable on this node: probe_opt: {why}"}
    assert facts["result"]["kernel"]["release"] == os.uname().release
    assert dep["error"].startswith("dep is unavailable on this node: probe_dep: it needs probe_opt")
    assert ok["result"] == 5


def test_probes_import_only_the_core_api_and_other_probes():
    """On the target only `pytest_gpuhost.exec.agent.core` exists, holding exactly its `__all__`,
    and the probes, each loaded before any probe that imports from it."""
    order = [p.stem for p in probe_files()]
    for path in probe_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pytest_gpuhost"):
                if node.module == core.API_MODULE:
                    assert {a.name for a in node.names} <= set(core.__all__), path.name
                    continue
                other = (node.module or "").removeprefix(core.PROBE_PACKAGE)
                assert other in order, f"{path.name} imports {node.module}"
                assert order.index(other) < order.index(path.stem), f"{path.name} loads before {other}"
                assert {a.name for a in node.names} <= _top_level_names(path.parent / f"{other}.py"), (
                    path.name
                )
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("pytest_gpuhost") for a in node.names), path.name
    assert core.API_MODULE == core.__name__


def test_a_probe_imports_another_probe_on_the_target():
    first = "from pytest_gpuhost.exec.agent.core import fact\nBASE = 40\n"
    second = (
        "from pytest_gpuhost.exec.agent.core import fact\n"
        "from pytest_gpuhost.exec.agent.probe_zz_a import BASE\n"
        "@fact('answer')\ndef answer(params):\n    return BASE + 2\n"
    )
    program = _core() + _probe("probe_zz_a", first) + _probe("probe_zz_b", second) + "main()\n"
    (got,) = _serve(program, {"id": 1, "op": "facts", "names": ["answer"], "params": {}})
    assert got["result"]["answer"] == 42, got


def test_probes_load_after_what_they_import_and_a_cycle_is_refused(tmp_path):
    from pytest_gpuhost.exec.agent import load_order

    def probe(name, *needs):
        path = tmp_path / f"{name}.py"
        path.write_text("".join(f"from pytest_gpuhost.exec.agent.{n} import X\n" for n in needs) + "X = 1\n")
        return path

    paths = [probe("probe_a", "probe_c"), probe("probe_b"), probe("probe_c", "probe_b")]
    assert [p.stem for p in load_order(paths)] == ["probe_b", "probe_c", "probe_a"]
    with pytest.raises(ValueError, match="cycle: probe_a -> probe_c -> probe_a"):
        load_order([probe("probe_a", "probe_c"), probe("probe_c", "probe_a")])
    with pytest.raises(ValueError, match="probe_a.py imports probe_gone"):
        load_order([probe("probe_a", "probe_gone")])


def test_core_files_are_joined_without_their_imports_of_each_other():
    tree = ast.parse(_core(), feature_version=(3, 6))
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert imported and not [m for m in imported if (m or "").startswith("pytest_gpuhost")]


def _top_level_names(path: Path) -> set[str]:
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return out


def test_core_files_do_not_redefine_each_others_names():
    """The core files share one namespace on the target: a clash would silently replace a function."""
    here = Path(core.__file__).parent
    owner: dict[str, str] = {}
    for name in CORE_FILES:
        for defined in _top_level_names(here / name):
            assert defined not in owner, f"{name} redefines {defined} from {owner.get(defined)}"
            owner[defined] = name
    assert owner["__all__"] == "core.py" and owner["main"] == "agent.py"


def test_read_str_and_link_name(tmp_path):
    (tmp_path / "v").write_bytes(b" 0x10de\n")
    (tmp_path / "bad").write_bytes(b"\xff1")
    os.symlink("../../drivers/nvidia", tmp_path / "driver")
    assert core.read_str(str(tmp_path / "v")) == "0x10de"
    assert core.read_str(str(tmp_path / "bad")) == "\ufffd1"
    assert core.read_str(str(tmp_path / "none"), "") == ""
    assert core.link_name(str(tmp_path / "driver")) == "nvidia"
    assert core.link_name(str(tmp_path / "v")) is None


def test_run_recorded_keeps_a_trimmed_copy_for_the_evidence():
    record: list[dict] = []
    res = core.run_recorded(["sh", "-c", "printf 0123456789; echo err >&2; exit 3"], 5, record, keep=4)
    assert (res["rc"], res["stdout"]) == (3, "0123456789")
    assert record == [
        {
            "argv": ["sh", "-c", "printf 0123456789; echo err >&2; exit 3"],
            "rc": 3,
            "stdout": "0123",
            "stderr": "err\n",
            "duration": record[0]["duration"],
            "timed_out": False,
        }
    ]
    core.run_recorded(["sleep", "5"], 0.2, record)
    assert record[1]["timed_out"] and record[1]["rc"] == -9


def test_a_core_import_under_another_name_is_refused(tmp_path):
    """Joined into one namespace, `op as register` would leave `register` undefined."""
    from pytest_gpuhost.exec.agent import _core_source

    path = tmp_path / "part.py"
    path.write_text("from pytest_gpuhost.exec.agent.registry import (\n    op as register,\n)\n")
    with pytest.raises(ValueError, match="without `as`"):
        _core_source(path)
    path.write_text("from pytest_gpuhost.exec.agent.registry import op as op  # re-export\nX = 1\n")
    assert _core_source(path) == "X = 1\n"


def test_probe_program_runs_one_probe_alone():
    """What the backup's bulk sender uses: the core and one probe, no protocol loop."""
    program = probe_program(
        "probe_process", "import json; print(json.dumps(proc_wait(dict(timeout=0, targets=[]))))"
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["alive"] == []
    with pytest.raises(ValueError, match="no agent probe named"):
        probe_program("probe_nothing", "main()")


def test_hello_lists_ops_and_facts(conn):
    hello = conn.call("hello")
    assert hello["pid"] != os.getpid()
    assert {
        "hello",
        "run",
        "read_files",
        "write_file",
        "stat",
        "listdir",
        "readlink",
        "glob",
        "facts",
        "batch",
    } <= set(hello["ops"])
    assert "kernel" in hello["facts"]
    assert hello["uid"] == os.getuid()


def test_run_argv_and_shell(conn):
    r = conn.run(["echo", "a b"])
    assert (r.rc, r.stdout, r.ok) == (0, "a b\n", True)
    r = conn.run("echo out; echo err >&2; exit 3")
    assert (r.rc, r.stdout, r.stderr, r.ok) == (3, "out\n", "err\n", False)
    assert r.target == "local" and r.duration >= 0 and r.start > 1e9
    r = conn.run(["cat"], stdin="piped\n", env={"X_GPUHOST": "1"})
    assert r.stdout == "piped\n"
    assert conn.run(["sh", "-c", 'echo "$X_GPUHOST"'], env={"X_GPUHOST": "yes"}).stdout == "yes\n"
    assert conn.run(["pwd"], cwd="/proc").stdout == "/proc\n"
    assert conn.run(["/no/such/binary"]).rc == 127


def test_a_command_that_does_not_read_its_stdin_leaves_the_agent_serving(conn):
    # 1 MiB fills the pipe, so the agent is still writing when `true` exits: an EPIPE, which must
    # not become a SIGPIPE that kills the agent.
    for _ in range(3):
        assert conn.run(["true"], stdin="x" * (1 << 20), timeout=10).rc == 0
    assert conn.run(["echo", "alive"]).stdout == "alive\n"


def test_hostile_arguments_are_data(conn, tmp_path):
    canary = tmp_path / "x"
    hostile = [
        "$(touch " + str(canary) + ")",
        "`touch " + str(canary) + "`",
        "a'b\"c",
        "line1\nline2",
        "; rm -rf /",
        "*",
    ]
    r = conn.run(["printf", "%s|"] + hostile)
    assert r.stdout == "|".join(hostile) + "|"
    assert not canary.exists()


def test_binary_output_kept_exactly(conn):
    r = conn.run(["printf", "\\377\\000ok"])
    assert r.stdout_bytes == b"\xff\x00ok"


def test_timeout_kills_process_group_and_keeps_output(conn, tmp_path):
    pidfile = tmp_path / "child.pid"
    t0 = time.monotonic()
    r = conn.run(f"echo started; sleep 100 & echo $! > {pidfile}; wait", timeout=1)
    elapsed = time.monotonic() - t0
    assert r.timed_out and r.rc == -9 and not r.ok
    assert r.stdout == "started\n"
    assert elapsed < 1 + 2
    child = int(pidfile.read_text())
    # the background sleep was in the same process group: it is gone too
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)
    with pytest.raises(CommandTimeout, match="timed out"):
        conn.run(["sleep", "100"], timeout=0.3, check=True)


def test_sigterm_ignoring_command_is_killed(conn):
    t0 = time.monotonic()
    r = conn.run("trap '' TERM; echo x; sleep 100", timeout=0.5)
    assert r.timed_out and r.stdout == "x\n"
    assert time.monotonic() - t0 < 2.5


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_check_raises_one_line(conn):
    with pytest.raises(GpuhostError) as exc:
        conn.run("echo boom >&2; exit 4", check=True)
    assert "\n" not in str(exc.value) and "exited 4: boom" in str(exc.value)


def test_files_ops(conn, tmp_path):
    (tmp_path / "a").write_text("alpha")
    (tmp_path / "b").write_bytes(b"\xfe\xff")
    os.symlink("a", tmp_path / "link")
    got = conn.read_files([str(tmp_path / "a"), str(tmp_path / "missing"), "/proc/self/status"])
    assert got[str(tmp_path / "a")] == "alpha"
    missing = got[str(tmp_path / "missing")]
    assert isinstance(missing, OSError) and missing.errno == 2
    assert "Pid:" in str(got["/proc/self/status"])
    st = conn.call("stat", paths=[str(tmp_path / "a"), str(tmp_path / "nope")])
    assert st[str(tmp_path / "a")]["size"] == 5 and st[str(tmp_path / "a")]["type"] == "file"
    assert st[str(tmp_path / "nope")]["errno"] == 2
    assert conn.call("listdir", paths=[str(tmp_path)])[str(tmp_path)] == ["a", "b", "link"]
    assert conn.call("readlink", paths=[str(tmp_path / "link")])[str(tmp_path / "link")] == {"target": "a"}
    assert conn.call("glob", pattern=str(tmp_path / "[ab]")) == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert (
        conn.call("stat", paths=[str(tmp_path / "link")], follow=False)[str(tmp_path / "link")]["type"]
        == "link"
    )


def test_write_file_and_errors(conn, tmp_path):
    path = tmp_path / "w"
    wr = conn.write_file(str(path), "one\n", timeout=5)
    assert wr.ok and not wr.timed_out
    conn.write_file(str(path), "two\n", timeout=5, mode="a")
    assert path.read_text() == "one\ntwo\n"
    conn.write_file(str(path), b"\x00\x01", timeout=5)
    assert path.read_bytes() == b"\x00\x01"
    bad = conn.write_file(str(tmp_path / "no" / "dir"), "x", timeout=5)
    assert not bad.ok and bad.errno == 2 and not bad.timed_out


def test_blocked_write_times_out_and_agent_keeps_serving(conn, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no reader: open() blocks in the kernel
    t0 = time.monotonic()
    wr = conn.write_file(str(fifo), "x", timeout=0.5)
    assert wr.timed_out and not wr.ok
    assert time.monotonic() - t0 < 2
    assert conn.run(["echo", "alive"]).stdout == "alive\n"


def test_batch_and_facts_in_one_round_trip(conn, tmp_path):
    (tmp_path / "f").write_text("1")
    before = conn.round_trips
    out = conn.batch(
        [
            {"op": "read_files", "paths": [str(tmp_path / "f")]},
            {"op": "run", "argv": ["echo", "hi"], "timeout": 5},
            {"op": "no_such_op"},
        ]
    )
    assert conn.round_trips == before + 1
    assert out[0][str(tmp_path / "f")] == {"data": "1"}
    assert out[1]["stdout"] == "hi\n"
    assert isinstance(out[2], AgentError) and "unknown op" in str(out[2])
    facts = conn.facts("kernel", "hostname", "no_such_fact")
    assert facts["kernel"]["release"] == os.uname().release
    assert "error" in facts["no_such_fact"]


def test_stream_chunks(conn):
    seen: list[tuple[str, str]] = []
    r = conn.run(["sh", "-c", "echo a; echo b >&2"], on_output=lambda s, d: seen.append((s, d)))
    assert r.stdout == "a\n" and ("stdout", "a\n") in seen and ("stderr", "b\n") in seen
    items = list(conn.stream("run", argv=["echo", "z"], timeout=5, stream=True))
    assert items[-1]["done"] and items[-1]["result"]["stdout"] == "z\n"
    assert {"stream": "stdout", "data": "z\n"} in items[:-1]


def test_open_channel_carries_bytes(conn):
    with conn.open_channel(["sh", "-c", "cat; echo done >&2"]) as ch:
        ch.send(b"\x00payload")
        ch.close_stdin()
        assert ch.read_exact(8, 5) == b"\x00payload"
        assert ch.recv(5) == b""
        assert ch.exit_status(5) == 0
        assert "done" in ch.stderr_text()


def test_on_command_sees_runs_and_writes(tmp_path):
    seen: list[CommandResult] = []
    with open_connection(parse_host_url("local://")) as c:
        c.on_command.append(lambda target, res: seen.append(res))
        c.run(["echo", "x"])
        c.write_file(str(tmp_path / "v"), "identity", timeout=5)
    assert [r.command for r in seen] == ["echo x", f"echo identity > {tmp_path / 'v'}"]
    assert seen[0].target == "local"


def test_agent_death_reconnects_once(tmp_path):
    c = open_connection(parse_host_url("local://"))
    try:
        pid1 = c.hello["pid"]
        with pytest.raises(AgentError, match="died during run"):
            c.run("kill -9 $PPID")
        assert c.run(["echo", "back"]).stdout == "back\n"
        assert c.hello["pid"] != pid1
    finally:
        c.close()


def test_agent_death_then_failed_restart_raises(tmp_path):
    # python3 on this PATH works exactly once, as if the target lost its interpreter.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    marker = tmp_path / "used"
    wrapper = bindir / "python3"
    wrapper.write_text(f'#!/bin/sh\n[ -e {marker} ] && exit 1\ntouch {marker}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    path = f"{bindir}:/usr/bin:/bin"
    c = open_connection(parse_host_url(f"local://?path={path}"))
    try:
        with pytest.raises(AgentError):
            c.run("kill -9 $PPID")
        with pytest.raises(AgentError, match="cannot start the agent"):
            c.run(["true"])
    finally:
        c.close()


def test_fallback_without_python(tmp_path):
    # A PATH with the usual tools but no python: one process per command under `timeout`.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("sh", "cat", "echo", "printf", "sleep", "timeout", "env", "true", "touch"):
        found = shutil.which(tool)
        assert found, tool
        os.symlink(found, bindir / tool)
    c = open_connection(parse_host_url(f"local://?path={bindir}"))
    try:
        assert c.mode == "fallback"
        canary = tmp_path / "canary"
        r = c.run(["printf", "%s", f"$(touch {canary})"])
        assert r.stdout == f"$(touch {canary})" and not canary.exists()
        r = c.run("echo hi; echo err >&2; exit 2")
        assert (r.rc, r.stdout, r.stderr) == (2, "hi\n", "err\n")
        t0 = time.monotonic()
        r = c.run("echo part; sleep 100", timeout=1)
        assert r.timed_out and r.stdout == "part\n" and time.monotonic() - t0 < 3
        (tmp_path / "f").write_text("data")
        got = c.read_files([str(tmp_path / "f"), str(tmp_path / "nope")])
        assert got[str(tmp_path / "f")] == "data"
        nope = got[str(tmp_path / "nope")]
        assert isinstance(nope, OSError) and nope.errno == 2
        assert c.write_file(str(tmp_path / "w"), "v\n", timeout=5).ok
        assert (tmp_path / "w").read_text() == "v\n"
        with pytest.raises(AgentError, match="needs the agent; no usable Python: python3 absent"):
            c.facts("kernel")
        with pytest.raises(AgentError, match="needs the agent, which local cannot run .*said once above"):
            c.facts("kernel")
    finally:
        c.close()


def test_closed_connection_refuses(tmp_path):
    c = open_connection(parse_host_url("local://"))
    pid = c.hello["pid"]
    c.close()
    assert not _alive(pid)
    with pytest.raises(AgentError, match="closed"):
        c.run(["true"])


def test_connection_repr_and_mode(conn):
    assert isinstance(conn, Connection) and conn.mode == "agent" and "local" in repr(conn)
    assert stat.S_ISDIR(os.stat(Path("/proc")).st_mode)


def test_fallback_file_ops_without_python(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("sh", "cat", "printf", "timeout", "env", "ls", "stat", "readlink"):
        os.symlink(shutil.which(tool) or tool, bindir / tool)
    (tmp_path / "a b").write_text("x")
    os.symlink("bin", tmp_path / "lnk")
    c = open_connection(parse_host_url(f"local://?path={bindir}"))
    try:
        assert c.mode == "fallback"
        d = str(tmp_path)
        assert c.call("listdir", paths=[d])[d] == ["a b", "bin", "lnk"]
        assert c.call("listdir", paths=[d + "/nope"])[d + "/nope"]["errno"] == 2
        links = c.call("readlink", paths=[d + "/lnk", d + "/a b", d + "/nope"])
        assert links == {
            d + "/lnk": {"target": "bin"},
            d + "/a b": {"errno": 22, "error": "Invalid argument"},
            d + "/nope": {"errno": 2, "error": "No such file or directory"},
        }
        st = c.call("stat", paths=[d + "/a b"])[d + "/a b"]
        assert (st["type"], st["size"]) == ("file", 1)
        assert c.call("glob", pattern=d + "/a *") == [d + "/a b"]
        out = c.batch([{"op": "read_files", "paths": [d + "/a b"]}, {"op": "facts"}])
        assert out[0] == {d + "/a b": {"data": "x"}} and isinstance(out[1], AgentError)
    finally:
        c.close()


def test_threads_share_one_connection(conn):
    import threading

    results: dict[int, str] = {}

    def worker(i: int) -> None:
        for _ in range(10):
            results[i] = conn.run(["echo", str(i)]).stdout

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {i: f"{i}\n" for i in range(4)}


def test_missing_launcher_tool_is_one_line_error(tmp_path):
    from pytest_gpuhost.errors import ConnectError

    with pytest.raises(ConnectError, match=r"cannot start the agent on local: sudo: command not found"):
        open_connection(parse_host_url(f"local://?path={tmp_path}&sudo=1"))


def _cpu_seconds(pid: int) -> float:
    """Return the user + system CPU time of process `pid` (from /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_large_output_is_linear(conn):
    # CPU time, not wall time: the machine may be loaded, and a quadratic reader (here or in the
    # agent) burns tens of CPU-seconds on 20 MB where a linear one takes well under one.
    agent_pid = conn.call("hello")["pid"]
    ours0, agent0 = time.process_time(), _cpu_seconds(agent_pid)
    r = conn.run("head -c 20000000 /dev/zero | tr '\\0' a")
    assert len(r.stdout) == 20_000_000 and r.stdout[:3] == "aaa"
    ours, agent = time.process_time() - ours0, _cpu_seconds(agent_pid) - agent0
    assert ours + agent < 5, f"controller {ours:.2f} CPU-s, agent {agent:.2f} CPU-s for 20 MB"


def test_stream_yields_as_output_arrives(conn):
    t0 = time.monotonic()
    gen = conn.stream("run", shell="echo first; sleep 1; echo second", timeout=10, stream=True)
    first = next(gen)
    assert first == {"stream": "stdout", "data": "first\n"}
    assert time.monotonic() - t0 < 0.9  # before the command finished
    with pytest.raises(AgentError, match="busy with a stream"):
        conn.run(["true"])
    rest = list(gen)
    assert rest[-1]["done"] and rest[-1]["result"]["stdout"] == "first\nsecond\n"
    assert conn.run(["echo", "free"]).stdout == "free\n"


def test_stream_left_early_keeps_connection_usable(conn):
    gen = conn.stream("run", shell="for i in 1 2 3; do echo $i; sleep 0.1; done", timeout=10, stream=True)
    assert next(gen)["data"] == "1\n"
    gen.close()
    assert conn.run(["echo", "ok"]).stdout == "ok\n"
    with pytest.raises(AgentError, match="unknown op"):
        list(conn.stream("no_such_stream"))
    assert conn.run(["true"]).ok


def test_state_dir_comes_from_the_agents_environment(tmp_path, monkeypatch) -> None:
    """hello reports $GPUHOST_STATE_DIR (inherited by a local:// agent), else /var/lib/gpuhost."""
    from pytest_gpuhost.exec.targets import open_connection, parse_host_url

    monkeypatch.setenv("GPUHOST_STATE_DIR", str(tmp_path / "state"))
    conn = open_connection(parse_host_url("local://"))
    try:
        assert conn.call("hello")["state_dir"] == str(tmp_path / "state")
    finally:
        conn.close()
    monkeypatch.delenv("GPUHOST_STATE_DIR")
    conn = open_connection(parse_host_url("local://"))
    try:
        assert conn.call("hello")["state_dir"] == "/var/lib/gpuhost"
    finally:
        conn.close()


# ----------------------------------------------------------------------
# How the agent is started: `sh -c PROBE_SH` execs the node's Python as `-S -u -B -c PRELUDE+BOOTSTRAP`


def test_agent_runs_without_site_initialisation() -> None:
    """-S: the target's .pth files are not run (the agent needs the standard library only); -B: no .pyc written."""
    assert PYTHON_FLAGS == ("-S", "-u", "-B")
    conn = open_connection(parse_host_url("local://"))
    try:
        pid = conn.call("hello")["pid"]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[1:4] == [b"-S", b"-u", b"-B"] and argv[4] == b"-c", argv[:5]
        # ...and it still does its work: a command, a read, a fact
        assert conn.run(["true"]).ok
        assert conn.call("facts", names=["kernel"])["kernel"]["release"] == os.uname().release
    finally:
        conn.close()


def test_timings_record_the_start_and_each_request():
    """The hidden timing record bench_health.py's phases read: the agent's start, then each request."""
    before = time.time()
    with open_connection(parse_host_url("local://")) as c:
        c.run(["true"])
        c.run(["true"])
        record = list(c.timings)
    assert [what for what, _, _ in record][:1] == ["start"]
    assert len(record) == 3 and all(before <= s <= e <= time.time() for _, s, e in record), record
    assert record[0][2] <= record[1][1]  # the start ended before the first request was sent

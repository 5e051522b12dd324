"""The node's Python, found in the agent's own start (exec/pythons.py), with real interpreters.

CPython 3.6.15 and 2.7.18 are this machine's pyenv builds (/root/.pyenv/versions); Debian's
python3-minimal is laid out from `dpkg -L libpython3.11-minimal` (gpulab/host/pythons.py). A test
whose interpreter this machine lacks skips and names it. The same shapes over SSH in lab hosts:
tests/exec/test_node_python_lab.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpulab.host import pythons as labpy
from pytest_gpuhost.errors import AgentError
from pytest_gpuhost.exec import pythons
from pytest_gpuhost.exec.agent import BOOTSTRAP, agent_needs, agent_payload
from pytest_gpuhost.exec.connect import connect
from pytest_gpuhost.exec.connection import ConnectionOptions
from pytest_gpuhost.exec.launch import LocalLauncher
from pytest_gpuhost.exec.targets import open_connection, parse_host_url

PY36 = labpy.PYENV / "3.6.15/bin/python3.6"
PY27 = labpy.PYENV / "2.7.18/bin/python2.7"


def need(path: Path) -> None:
    if not os.access(path, os.X_OK):
        pytest.skip(f"needs the real interpreter {path}, which this machine lacks")


def tools(d: Path, *names: str, **links: Path) -> Path:
    """A PATH directory with `names` from this machine's PATH and `links` (name -> file)."""
    d.mkdir(parents=True, exist_ok=True)
    for name in names:
        found = shutil.which(name)
        assert found, name
        os.symlink(found, d / name)
    for name, target in links.items():
        os.symlink(target, d / name)
    return d


def running_pythons() -> set[str]:
    """The interpreters of this machine's running Pythons, as /proc/PID/exe names them."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if os.path.basename(exe).startswith("python"):
            out.add(exe)
    return out


def start(path: Path, python: str | None = None) -> subprocess.CompletedProcess[bytes]:
    """Start the agent as a target would, answer one hello, and return what it printed."""
    return subprocess.run(
        pythons.start_argv(python),
        input=agent_payload() + b'{"id":1,"op":"hello"}\n',
        capture_output=True,
        env={"PATH": str(path)},
        timeout=60,
    )


# ------------------------------------------------------------ what is tried, and the one line


def test_candidates_are_python3_then_platform_python_then_versioned_newest_first() -> None:
    assert pythons.CANDIDATES[:2] == ("python3", "/usr/libexec/platform-python")
    versioned = pythons.CANDIDATES[2:]
    versioned = versioned[:-1]  # RUNNING is last
    assert versioned[-1] == "python3.6" and versioned == tuple(
        sorted(versioned, key=lambda n: -int(n.split(".")[1]))
    )
    assert pythons.candidates("/opt/venv/bin/python") == ("/opt/venv/bin/python",)
    assert pythons.candidates("") == pythons.CANDIDATES and pythons.CANDIDATES[-1] == pythons.RUNNING


def test_the_needed_modules_are_the_cores_imports() -> None:
    needs = agent_needs()
    assert {"json", "zlib", "select", "subprocess", "signal"} <= set(needs)
    # a probe's own imports make only that probe unavailable: never needed to start
    assert not {"ctypes", "statistics", "hashlib", "threading", "pytest_gpuhost", "sys"} & set(needs)


def test_the_one_line_names_what_was_found_and_what_is_needed() -> None:
    err = (
        f"{pythons.NO_PYTHON_MARK}\n"
        "python3\t/usr/bin/python3\tis Python 2.7.18 (needs 3.6+)\n"
        "python3.11\t/usr/bin/python3.11\tis Python 3.11.2 without json\n"
    )
    line = pythons.no_python_line("node07", err, None)
    assert line == (
        "node07: no usable Python: python3 (/usr/bin/python3) is Python 2.7.18 (needs 3.6+), "
        "python3.11 (/usr/bin/python3.11) is Python 3.11.2 without json, "
        "/usr/libexec/platform-python absent, no python3.6 to python3.14, no Python running; "
        f"the agent needs Python >= 3.6 with {', '.join(agent_needs())}"
    )
    running = err + "@running-found\t/opt/conda/bin/python3.11\tis Python 3.11.9 without zlib\n"
    running = running.replace("@running-found", "/opt/conda/bin/python3.11")
    line = pythons.no_python_line("node07", running, None) or ""
    assert "the running /opt/conda/bin/python3.11 is Python 3.11.9 without zlib" in line
    assert "no Python running" not in line
    assert "\n" not in line
    assert pythons.no_python_line("node07", "sh: 1: exec: python3: Permission denied\n", None) is None
    hostile = f"{pythons.NO_PYTHON_MARK}\npython3\t/tmp/\x1b[31mevil\tis Python 2.7.18 (needs 3.6+)\n"
    assert "\x1b" not in (pythons.no_python_line("n", hostile, None) or "")


def test_the_prelude_is_python_2_and_3() -> None:
    """A Python 2.7 named python3 must run the check, not die on the bootstrap's syntax."""
    need(PY27)
    r = subprocess.run(
        [str(PY27), "-S", "-u", "-c", pythons.PRELUDE + BOOTSTRAP], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 127, r.stderr
    assert r.stderr.splitlines() == [pythons.NO_PYTHON_MARK, f"{PY27}\t{PY27}\tis Python 2.7.18 (needs 3.6+)"]


# ------------------------------------------------------------ real interpreters on PATH


def test_python2_as_python3_hands_on_to_the_next_candidate_in_one_start(tmp_path: Path) -> None:
    need(PY27)
    need(PY36)
    path = tools(tmp_path / "bin", "sh", python3=PY27, **{"python3.6": PY36})
    r = start(path)
    assert r.returncode == 0 and b'"python":"3.6.15"' in r.stdout, r.stderr
    launcher = LocalLauncher({"PATH": str(path)})
    conn = connect("node07", launcher, ConnectionOptions())
    try:
        assert conn.mode == "agent" and conn.hello["python"] == "3.6.15"
        assert conn.python == str(path / "python3.6")
        assert conn.round_trips == 1  # the discovery cost no round trip of its own
    finally:
        conn.close()


def test_python2_alone_is_one_line_and_the_fallback(tmp_path: Path) -> None:
    need(PY27)
    path = tools(tmp_path / "bin", "sh", "cat", "timeout", python3=PY27)
    r = start(path)
    assert r.returncode == 127 and not r.stdout
    conn = open_connection(parse_host_url(f"local://?path={path}", name="node07"))
    try:
        assert conn.mode == "fallback"
        assert conn.no_python.startswith(
            f"node07: no usable Python: python3 ({path}/python3) is Python 2.7.18 (needs 3.6+), "
            "/usr/libexec/platform-python absent, no python3.6 to python3.14, no Python running; "
            "the agent needs Python >= 3.6 with "
        )
        assert conn.run(["cat", "/proc/version"]).ok  # commands and reads still work
        with pytest.raises(AgentError) as first:
            conn.facts("kernel")
        assert (
            str(first.value) == f"facts on node07: needs the agent; {conn.no_python.removeprefix('node07: ')}"
        )
        with pytest.raises(AgentError, match="said once above") as again:
            conn.facts("kernel")
        assert "Python 2.7.18" not in str(again.value)
    finally:
        conn.close()


def test_without_a_fallback_the_line_is_the_error(tmp_path: Path) -> None:
    need(PY27)
    path = tools(tmp_path / "bin", "sh", python3=PY27)
    with pytest.raises(AgentError) as info:
        connect("node07", LocalLauncher({"PATH": str(path)}), ConnectionOptions(allow_fallback=False))
    msg = str(info.value)
    assert msg.startswith("node07: no usable Python: python3 (") and msg.endswith(
        "; the fallback is disabled"
    )
    assert info.value.__cause__ is None and "\n" not in msg


def test_platform_python_is_found_without_python3(tmp_path: Path) -> None:
    """RHEL 8: no python3 on PATH, /usr/libexec/platform-python; here the candidate is a path."""
    need(PY36)
    fake = tmp_path / "libexec/platform-python"
    fake.parent.mkdir()
    os.symlink(PY36, fake)
    path = tools(tmp_path / "bin", "sh")
    argv = pythons.start_argv(None)
    argv[argv.index("/usr/libexec/platform-python")] = str(fake)
    r = subprocess.run(
        argv,
        input=agent_payload() + b'{"id":1,"op":"hello"}\n',
        capture_output=True,
        env={"PATH": str(path)},
        timeout=60,
    )
    assert r.returncode == 0 and b'"python":"3.6.15"' in r.stdout and str(fake).encode() in r.stdout, r.stderr


def test_a_named_interpreter_is_the_only_one_tried(tmp_path: Path) -> None:
    need(PY36)
    path = tools(tmp_path / "bin", "sh", "cat", "timeout", python3=PY36)
    conn = open_connection(parse_host_url(f"local://?path={path}&python=/nonexistent/python3", name="n"))
    try:
        assert conn.mode == "fallback"
        assert conn.no_python.startswith("n: no usable Python: /nonexistent/python3 absent; the agent needs")
    finally:
        conn.close()
    conn = open_connection(parse_host_url(f"local://?path={path}&python={PY36}", name="n"))
    try:
        assert conn.mode == "agent" and conn.python == str(PY36)
    finally:
        conn.close()


def test_the_agent_serves_on_python_36(tmp_path: Path) -> None:
    """The floor, on a real CPython 3.6.15: every op's core and every fact runs without a Python error."""
    need(PY36)
    conn = open_connection(parse_host_url(f"local://?python={PY36}", name="n"))
    try:
        assert conn.hello["python"] == "3.6.15" and conn.hello["unavailable"] == {}
        assert conn.run(["echo", "hi"]).stdout == "hi\n"
        (tmp_path / "f").write_text("x")
        assert conn.read_files([str(tmp_path / "f")])[str(tmp_path / "f")] == "x"
        facts = conn.call("facts", names=conn.hello["facts"], params={"timeout": 5})
        for name, value in facts.items():
            err = str(value.get("error", "")) if isinstance(value, dict) else ""
            for kind in ("SyntaxError", "NameError", "AttributeError", "TypeError", "ImportError"):
                assert kind not in err, (name, err)
    finally:
        conn.close()


def test_the_running_pythons_are_the_last_candidates(tmp_path: Path) -> None:
    """No Python on PATH, but a server runs under its own (a conda or virtualenv interpreter)."""
    need(PY36)
    server = subprocess.Popen([str(PY36), "-S", "-c", "import time; time.sleep(60)"])
    try:
        path = tools(tmp_path / "bin", "sh", "ls", "sed", "sort")
        r = start(path)
        assert r.returncode == 0, r.stderr
        hello = json.loads(r.stdout.splitlines()[0])["result"]
        # one of the Pythons running here (this pytest's own, the server above, ...): none on PATH
        assert hello["executable"] in running_pythons() and not hello["executable"].startswith(str(path))
        assert str(PY36.resolve()) in running_pythons()
    finally:
        server.kill()
        server.wait()


# ------------------------------------------------------------ Debian's python3-minimal


@pytest.fixture(scope="module")
def minimal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    why = labpy.missing("minimal")
    if why:
        pytest.skip(why)
    return labpy.minimal_stdlib(tmp_path_factory.mktemp("pyminimal"))


def test_python3_minimal_has_no_json_and_is_refused(minimal: Path, tmp_path: Path) -> None:
    path = tools(tmp_path / "bin", "sh", "cat", "timeout", python3=minimal)
    conn = open_connection(parse_host_url(f"local://?path={path}", name="n"))
    try:
        assert conn.mode == "fallback"
        assert f"python3 ({path}/python3) is Python 3." in conn.no_python
        assert " without json; " in conn.no_python or " without json, " in conn.no_python
    finally:
        conn.close()


def test_a_probe_whose_module_is_missing_is_unavailable_and_the_rest_serve(
    minimal: Path, tmp_path: Path
) -> None:
    """python3-minimal plus json: no ctypes (NVML) and no statistics (the P2P probe)."""
    home = minimal.parents[1]
    (home / "lib/python3.11/json").symlink_to("/usr/lib/python3.11/json")
    try:
        conn = open_connection(parse_host_url(f"local://?python={minimal}", name="n"))
        try:
            gone = conn.hello["unavailable"]
            assert gone["probe_p2p"] == "this Python has no module 'statistics'"
            assert gone["probe_nvml"] == "this Python has no module 'ctypes'"
            assert gone["probe_health_nvml"].startswith("it needs probe_nvml, which is unavailable")
            assert "probe_process" not in gone and "probe_journal" not in gone
            with pytest.raises(
                AgentError,
                match="p2p_probe is unavailable on this node: probe_p2p: this Python has no module 'statistics'",
            ):
                conn.call("p2p_probe")
            nvml = conn.facts("health_nvml")["health_nvml"]
            assert "unavailable on this node" in nvml["error"]
            assert conn.call("facts", names=["kernel"])["kernel"]["release"] == os.uname().release
            assert conn.run(["true"]).ok
        finally:
            conn.close()
    finally:
        (home / "lib/python3.11/json").unlink()

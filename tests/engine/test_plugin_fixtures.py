"""The fixtures (target, host, container, gpus, remediate, evidence, check_only), plugin order, timeouts, host keys."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

# Imported here, outside pytester's inline runs: those drop modules first imported inside a run
# from sys.modules, and cryptography's compiled bindings break when imported a second time.
import pytest_gpuhost.exec.backend  # noqa: F401
import pytest_gpuhost.exec.targets  # noqa: F401
from tests.helpers.outcomes import outcome_counts

HOST_IS_OURS = """
import json
import os
import shutil
import socket
import threading
import time

def test_host_is_ours(host, target, request):
    names = [name for name, _ in request.config.pluginmanager.list_name_plugin()]
    order = [n for n in names if n in ("testinfra", "gpuhost")]
    assert order == os.environ["EXPECTED_ORDER"].split(","), names
    assert type(host.backend).__module__ == "pytest_gpuhost.exec.backend"
    assert host.target is target and target.name == "local"
    assert host.run("echo hi").stdout == "hi\\n"
    assert host.file("/").is_directory
"""


@pytest.mark.parametrize(
    ("plugins", "order"),
    [
        (["-p", "testinfra", "-p", "gpuhost"], "testinfra,gpuhost"),
        (["-p", "gpuhost", "-p", "testinfra"], "gpuhost,testinfra"),
    ],
    ids=["testinfra-first", "gpuhost-first"],
)
def test_host_fixture_is_ours_in_both_load_orders(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, plugins: list[str], order: str
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("EXPECTED_ORDER", order)
    pytester.makepyfile(HOST_IS_OURS)
    result = pytester.runpytest(*plugins, "--host=local://", "--report-dir=none")
    result.assert_outcomes(passed=1)


def test_fixtures_per_target(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from pytest_gpuhost.run.remediation import Action, Check

        def test_target(target):
            assert target.name == "local" and target.spec.scheme == "local"
            assert target.container_conn is None and target.vars == {}
            assert target.conn.run(["echo", "x"]).stdout == "x\\n"

        def test_no_container(container):
            pass

        def test_gpus(gpus):
            assert isinstance(gpus, list)
            for gpu in gpus:
                assert gpu.bdf

        def test_check_only(check_only):
            assert check_only is False

        def test_remediate_names_the_target(target, remediate):
            state = {"ok": False}
            out = remediate(name="n", check=lambda: Check(state["ok"], "s"),
                            plan=lambda b: [Action("a", "c")], fix=lambda a, b: state.update(ok=True))
            assert out.outcome == "fixed" and out.target == "local" and out.actions[0].target == "local"

        @pytest.fixture
        def early(evidence):
            evidence.note("from setup")
            yield
            evidence.note("from teardown")

        def test_evidence_goes_to_the_running_phase(early, evidence, request):
            evidence.note("from call")
        """
    )
    result = pytester.runpytest("-v", "-rs", "--host=local://", "--report-name=fx")
    result.stdout.fnmatch_lines(
        ["*test_target?local? PASSED*", "*test_remediate_names_the_target?local? FIXED*"]
    )
    result.stdout.fnmatch_lines(["*local: no container: pass --container=*"])
    assert outcome_counts(result.outlines) == {"passed": 4, "skipped": 1, "fixed": 1}
    import json

    data = json.loads((pytester.path / "reports" / "fx.json").read_text())
    ev = next(t for t in data["tests"] if "test_evidence_goes" in t["nodeid"])["evidence"]
    assert ev["setup"]["notes"] == ["from setup"]
    assert ev["call"]["notes"] == ["from call"]
    assert ev["teardown"]["notes"] == ["from teardown"]


def test_targets_live_in_the_stash_one_object_per_name(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from pytest_gpuhost.errors import GpuhostError
        from pytest_gpuhost.run import targets_stash
        from pytest_gpuhost.run.settings import settings_key

        def test_stash(target, pytestconfig):
            assert targets_stash.get_target(pytestconfig, "local") is target
            assert [s.name for s in pytestconfig.stash[targets_stash.targets_key]] == ["local"]
            assert pytestconfig.stash[settings_key].hosts == ["local://"]
            with pytest.raises(targets_stash.UnknownTarget, match="no target 'nope'.*its targets: local"):
                targets_stash.get_target(pytestconfig, "nope")
            assert issubclass(targets_stash.UnknownTarget, GpuhostError)
            target.conn.run(["true"])
            assert targets_stash.pool_key in pytestconfig.stash
        """
    )
    pytester.makeconftest(
        """
        import pathlib
        from pytest_gpuhost.run import targets_stash

        def pytest_unconfigure(config):
            # The plugin's sessionfinish closed the pool and took it out of the stash.
            pathlib.Path("pool_left.txt").write_text(str(targets_stash.pool_key in config.stash))
        """
    )
    result = pytester.runpytest("--host=local://", "--report-dir=none")
    result.assert_outcomes(passed=1)
    assert (pytester.path / "pool_left.txt").read_text() == "False"


def test_container_fixture_over_its_own_ssh(pytester: pytest.Pytester, sshd: Any) -> None:
    pytester.makepyfile(
        """
        def test_container(container, host):
            assert container.run("echo in-container").stdout == "in-container\\n"
            assert container is not host
        """
    )
    result = pytester.runpytest(
        "--host=local://",
        f"--container={sshd.url}",
        f"--ssh-identity={sshd.identity}",
        f"--known-hosts={sshd.known_hosts}",
        "--report-dir=none",
    )
    result.assert_outcomes(passed=1)


def test_hanging_command_is_killed_at_the_timeout(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os, time

        def test_hang(target):
            t0 = time.monotonic()
            r = target.conn.run(["sh", "-c", "echo $$; echo started; exec sleep 60"])
            assert r.timed_out and r.rc != 0
            assert "started" in r.stdout, "output printed before the timeout is kept"
            assert time.monotonic() - t0 < 10
            pid = int(r.stdout.split()[0])
            time.sleep(0.2)
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"

        def test_check_raises_one_line(target):
            target.conn.run(["sleep", "60"], timeout=1, check=True)
        """
    )
    result = pytester.runpytest("--host=local://", "--command-timeout=1", "--report-dir=none")
    result.assert_outcomes(passed=1, failed=1)
    failure = result.stdout.str().split("_ test_check_raises_one_line[local] _", 1)[1]
    body = [ln for ln in failure.splitlines()[1:] if ln.strip() and not ln.startswith("=")]
    assert body[0].startswith("CommandTimeout: "), body
    assert "Traceback" not in failure and "def test_check" not in failure


def test_unknown_host_key_refused_by_default_accepted_with_accept_new(
    pytester: pytest.Pytester, sshd: Any, tmp_path: Path
) -> None:
    pytester.makepyfile("def test_connect(target):\n    assert target.conn.run(['true']).rc == 0\n")
    known = tmp_path / "known_hosts"
    known.write_text("")
    args = [
        f"--host={sshd.url}",
        f"--ssh-identity={sshd.identity}",
        f"--known-hosts={known}",
        "--report-dir=none",
    ]
    result = pytester.runpytest(*args)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["ConnectError: *"])
    assert known.read_text() == ""
    result = pytester.runpytest(*args, "--host-key-policy=accept-new")
    result.assert_outcomes(passed=1)
    assert known.read_text().strip(), "accept-new did not record the key"
    pytester.runpytest(*args).assert_outcomes(passed=1)
    assert os.stat(known).st_size > 0


def test_command_hook_and_connections_closed_at_session_end(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import json, pathlib
        SEEN = []

        def pytest_gpuhost_command(target, result):
            SEEN.append([target, result.command, result.rc])

        def pytest_unconfigure(config):
            pathlib.Path("seen.json").write_text(json.dumps(SEEN))
        """
    )
    pytester.makepyfile(
        """
        import pathlib

        def test_agent(target):
            assert target.conn.run(["echo", "hooked"]).rc == 0
            pathlib.Path("agent.pid").write_text(str(target.conn.hello["pid"]))
        """
    )
    result = pytester.runpytest("--host=local://", "--report-name=hooks")
    result.assert_outcomes(passed=1)
    seen = json.loads((pytester.path / "seen.json").read_text())
    assert ["local", "echo hooked", 0] in seen
    pid = int((pytester.path / "agent.pid").read_text())
    assert not Path(f"/proc/{pid}").exists(), "the agent outlived the session"
    xml = (pytester.path / "reports" / "hooks.xml").read_text()
    assert '<property name="gpuhost_outcome" value="passed"' in xml


def test_connect_timeout_bounds_a_silent_host(pytester: pytest.Pytester) -> None:
    # A TCP server that accepts and never says a word: no SSH banner ever comes.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        pytester.makepyfile("def test_c(target):\n    target.conn.run(['true'])\n")
        t0 = time.monotonic()
        result = pytester.runpytest(
            f"--host=ssh://root@127.0.0.1:{port}", "--connect-timeout=1", "--report-dir=none"
        )
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        server.close()
    result.assert_outcomes(failed=1)
    assert accepted, "the client never connected"
    # Without a bound paramiko waits 15 s for a banner (or for ever): 10 s leaves room for a loaded CI.
    assert elapsed < 10, f"--connect-timeout=1 took {elapsed:.1f}s"


def test_sudo_runs_the_agent_through_sudo(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "def test_s(target):\n    assert target.conn.run(['id', '-u']).stdout.strip() == '0'\n"
    )
    result = pytester.runpytest("--host=local://", "--sudo", "--report-dir=none")
    if shutil.which("sudo") is None:
        # No sudo here: the agent cannot start, and says so in one line.
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(["ConnectError: cannot start the agent on local: *sudo*"])
    else:
        result.assert_outcomes(passed=1)


SUDO_TESTS = """
def test_missing_program(target):
    assert target.conn.run(["no-such-program-here"]).rc == 0
"""


@pytest.mark.parametrize(
    ("sudo_script", "flags", "hint"),
    [
        pytest.param(None, ["--sudo"], True, id="no sudo on the target"),
        pytest.param('#!/bin/sh\nshift 2\nexec "$@"\n', ["--sudo"], True, id="sudo, program missing"),
        pytest.param('#!/bin/sh\nshift 2\nexec "$@"\n', [], False, id="without --sudo"),
    ],
)
def test_sudo_failures_carry_a_hint(
    pytester: pytest.Pytester, sudo_script: str | None, flags: list[str], hint: bool
) -> None:
    import sys

    bindir = pytester.path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    if sudo_script is not None:
        (bindir / "sudo").write_text(sudo_script)
        (bindir / "sudo").chmod(0o755)
    pytester.makepyfile(test_sudo=SUDO_TESTS)
    result = pytester.runpytest_subprocess(f"--host=local://?path={bindir}", "--report-dir=none", *flags)
    result.assert_outcomes(failed=1)
    lines = [
        "*- gpuhost hint -*",
        "local runs commands through sudo (--sudo) and something could not be run*",
    ]
    if hint:
        result.stdout.fnmatch_lines(lines)
    else:
        result.stdout.no_fnmatch_line(lines[0])

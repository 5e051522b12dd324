"""The Procedure base (pytest_gpuhost/run/procedure.py): undo stack and per-connection reachability.

A small suite runs under pytester against a local:// host and a `pct:101` container reached
through it by a stand-in `pct` (which, like Proxmox's, refuses with "CT 101 not running" once the
container is stopped). Stopping the container must lose the container's link only: the host's
steps go on and the host's undo still runs in the teardown, and the report names the container
as unreachable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

SUITE_CONFTEST = '''
import os
import pathlib
import signal

import pytest

from pytest_gpuhost.run.procedure import Procedure
from pytest_gpuhost.run.remediation import Action, Check

WORK = pathlib.Path(os.environ["TOY_WORK"])


class Toy(Procedure):
    """A host file changed in step 1 and a container "service" stopped in step 2, each with its undo."""

    def __init__(self, target, check_only):
        host, container = Procedure.links_of(target)
        super().__init__(host, check_only=check_only, container=container)

    def step_host_changed(self):
        path = str(WORK / "host.conf")

        def check():
            text = self.host.read_files([path])[path]
            return Check(text == "changed\\n", f"host.conf is {text!r}")

        def fix(actions, before):
            old = self.host.read_files([path])[path]
            self.push_undo("host.conf", "restore host.conf", lambda: self.host.write_file(path, old), link=self.host)
            self.host.write_file(path, "changed\\n")

        return self.step("host changed", check, lambda before: [Action("change host.conf", "write")], fix)

    def step_service_stopped(self):
        path = str(WORK / "service.state")

        def check():
            text = self.container.read_files([path])[path]
            return Check(text == "stopped\\n", f"service is {text!r}")

        def fix(actions, before):
            self.push_undo(
                "service",
                "start the service",
                lambda: self.container.write_file(path, "running\\n"),
                link=self.container,
                after_failure=False,
            )
            self.container.write_file(path, "stopped\\n")

        return self.step("service stopped", check, lambda before: [Action("stop", "write")], fix, on=self.container)

    def step_host_answers(self):
        return self.step("host answers", lambda: Check(self.host.run(["true"]).rc == 0, "host answers"))


@pytest.fixture(scope="module")
def toy(target, check_only):
    proc = Toy(target, check_only)
    yield proc
    proc.finish()
'''

SUITE_TESTS = '''
import os
import pathlib
import signal

WORK = pathlib.Path(os.environ["TOY_WORK"])


def stop_container():
    """As `pct stop 101`: new `pct exec` refused, and the agent inside it killed."""
    (WORK / "STOPPED").touch()
    for pid in (WORK / "pids").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_host_changed(toy, remediate):
    remediate(toy.step_host_changed())


def test_service_stopped(toy, remediate):
    remediate(toy.step_service_stopped())


def test_container_stops(toy):
    if os.environ.get("TOY_STOP_AT") == "mid":
        stop_container()


def test_service_checked(toy, remediate):
    remediate(toy.step_service_stopped())


def test_host_answers(toy, remediate):
    remediate(toy.step_host_answers())
'''

PCT = """#!/bin/sh
# pct exec ID -- CMD...: refused once the container is stopped, as Proxmox's pct does
if [ -e "{work}/STOPPED" ]; then echo "CT $2 not running" >&2; exit 255; fi
echo $$ >> "{work}/pids"
shift 3
exec "$@"
"""


@pytest.mark.parametrize("stop_at", ["start", "mid"])
def test_a_stopped_container_is_not_a_lost_host(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stop_at: str
) -> None:
    """The container stops before the run or between two steps: its steps fail as unreachable, the host's
    steps still pass, the host's undo runs in the teardown, and the report names the container."""
    work = tmp_path / "work"
    bindir = tmp_path / "bin"
    work.mkdir()
    bindir.mkdir()
    (bindir / "pct").write_text(PCT.format(work=work))
    (bindir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for tool in bindir.iterdir():
        tool.chmod(0o755)
    (work / "host.conf").write_text("original\n")
    (work / "service.state").write_text("running\n")
    (work / "pids").write_text("")
    if stop_at == "start":
        (work / "STOPPED").touch()
    pytester.makeconftest(SUITE_CONFTEST)
    pytester.makepyfile(test_toy=SUITE_TESTS)
    monkeypatch.setenv("TOY_WORK", str(work))
    monkeypatch.setenv("TOY_STOP_AT", stop_at)
    result = pytester.runpytest_subprocess(
        f"--host=local://?path={bindir}:/usr/bin:/bin",
        "--container=pct:101",
        "--connect-timeout=5",
        "--command-timeout=10",
        "--report-name=toy",
        "-p",
        "no:cacheprovider",
        "-rA",
    )
    data = json.loads((pytester.path / "reports" / "toy.json").read_text())
    tests = {t["nodeid"].split("::")[-1].split("[")[0]: t for t in data["tests"]}
    outcome = {name: t.get("gpuhost_outcome") or t["outcome"] for name, t in tests.items()}
    text = result.stdout.str()
    if stop_at == "start":
        # the fixture did not fail on the stopped container: only the steps that need it do
        assert outcome["test_host_changed"] == "fixed", text
        assert outcome["test_service_stopped"] == "failed", text
        assert outcome["test_service_checked"] == "failed", text
    else:
        assert outcome["test_host_changed"] == outcome["test_service_stopped"] == "fixed", text
        assert (work / "service.state").read_text() == "stopped\n"
        assert outcome["test_service_checked"] == "failed", text
    assert outcome["test_host_answers"] == "passed", text  # the host is not lost
    assert "local/101 unreachable" in text, text
    # the teardown ran the host's undo: the file is back as it was
    assert (work / "host.conf").read_text() == "original\n"
    teardown = tests["test_host_answers"]["evidence"]["teardown"]
    notes = "\n".join(teardown["notes"])
    assert "undo [local] restore host.conf: done" in notes, notes
    states = {s["label"]: s["value"] for s in teardown["states"]}
    assert states["reachability"]["local"] == "reachable", states
    assert states["reachability"]["local/101"].startswith("unreachable: "), states
    if stop_at == "mid":
        # the container's undo could not run: said so, and the service is left as the run found it
        assert "undo [local/101] start the service: not done: local/101 unreachable" in notes, notes
        assert (work / "service.state").read_text() == "stopped\n"


def test_undo_stack_reverse_order_and_lost_links() -> None:
    """Undos run newest first; one on a lost link is reported, not run; a container is lost with its host."""
    from pytest_gpuhost.errors import ConnectError
    from pytest_gpuhost.run.procedure import Link, LinkLost, Procedure

    host = Link("h", lambda: "host connection")
    container = Link("h/101", lambda: "container connection", parent=host)
    proc = Procedure(host, check_only=False, container=container)
    ran: list[str] = []

    def refuse() -> None:
        raise OSError("refused")

    proc.push_undo("svc", "start the service", lambda: ran.append("svc"), link=container, after_failure=False)
    proc.push_undo("bind", "bind again", lambda: ran.append("bind"), link=host)
    proc.push_undo(
        "bind", "bind again (a second push keeps the first place)", lambda: ran.append("x"), link=host
    )
    proc.push_undo("conf", "restore conf", lambda: ran.append("conf"), link=host)
    proc.push_undo("bad", "a refused undo", refuse, link=host)
    proc.resolve("conf")  # its step put it back itself
    problems = proc.undo()
    assert ran == ["bind"]  # newest first; "svc" is skipped once an undo before it failed
    assert problems == [
        "a refused undo: failed: OSError: refused",
        "start the service: not done: an undo before it failed",
    ]
    assert proc.pending() == []

    container.mark_lost(ConnectError("CT 101 not running"))
    assert host.lost is None and container.lost == "CT 101 not running"
    proc.push_undo("svc", "start the service", lambda: ran.append("svc2"), link=container)
    proc.push_undo("bind", "bind again", lambda: ran.append("bind2"), link=host)
    assert proc.undo() == ["start the service: not done: h/101 unreachable (CT 101 not running)"]
    assert ran == ["bind", "bind2"]

    host2 = Link("g", lambda: "host connection")
    inner = Link("g/101", lambda: "container connection", parent=host2)
    host2.mark_lost(ConnectError("no route to host"))
    with pytest.raises(LinkLost, match="g/101 unreachable since: through g: no route to host"):
        inner.connection()


def test_only_unreachable_loses_a_link() -> None:
    """An operation failing on a target that answers leaves the link up; Unreachable from a raw
    connection inside a step is charged to the step's link."""
    from pytest_gpuhost.errors import AgentError, AgentLost, GpuhostError
    from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url
    from pytest_gpuhost.run.procedure import Link, LinkLost, Procedure

    conn = open_connection(parse_host_url("local://"), TargetOptions(command_timeout=10))
    try:
        link = Link("local", lambda: conn)
        with pytest.raises(AgentError):
            link.call("no_such_op")
        with pytest.raises(GpuhostError):
            link.run(["false"], check=True)
        assert link.lost is None and link.run(["true"]).rc == 0
    finally:
        conn.close()

    host = Link("h", lambda: "host connection")
    proc = Procedure(host, check_only=False)

    def check() -> Any:
        raise AgentLost("agent on h died during backup_send")

    with pytest.raises(AgentLost):
        proc.step("artifacts backed up", check).check()
    assert host.lost == "agent on h died during backup_send"
    with pytest.raises(LinkLost, match="h unreachable since: agent on h died"):
        host.call("hello")

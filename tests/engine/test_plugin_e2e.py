"""A small remediation suite end to end: local:// and loopback sshd, -n 2, HTML and JSON reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# Imported here, outside pytester's inline runs: those drop modules first imported inside a run
# from sys.modules, and cryptography's compiled bindings break when imported a second time.
import pytest_gpuhost.exec.backend  # noqa: F401
import pytest_gpuhost.exec.targets  # noqa: F401
from tests.helpers.outcomes import outcome_counts

# Files on the target (this machine, reached through the agent): check "content is good",
# fix writes it with the agent's write_file. Every command goes through target.conn.
SUITE = """
import os
import pathlib
import shlex
import pytest
from pytest_gpuhost.run.remediation import Action, Check, Remediation

STATE_DIR = pathlib.Path(__file__).with_name("state_dir.txt").read_text()

class FileHolds(Remediation):
    def __init__(self, target, name, want):
        self.conn = target.conn
        self.path = os.path.join(STATE_DIR, target.name.replace("/", "_") + "-" + name)
        self.want = want
        self.name = f"{name} holds {want}"

    def check(self):
        r = self.conn.run(["cat", self.path], timeout=10)
        got = r.stdout if r.rc == 0 else None
        return Check(got == self.want, f"{self.path}: {got!r}", state={"content": got})

    def plan(self, before):
        return [Action(f"write {self.want!r} to {self.path}",
                       f"printf %s {shlex.quote(self.want)} > {shlex.quote(self.path)}")]

    def fix(self, actions, before):
        r = self.conn.write_file(self.path, self.want, timeout=10)
        if not r.ok:
            raise OSError(r.errno, r.error)

@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_file(target, remediate, name):
    remediate(FileHolds(target, name, "good"))
"""


def _seed(state: Path, target: str) -> None:
    (state / f"{target}-a").write_text("good")
    (state / f"{target}-b").write_text("bad")
    (state / f"{target}-d").write_text("good")


def _files(state: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(state.iterdir())}


def _run_suite(
    pytester: pytest.Pytester, target_args: list[str], target: str, tmp_path: Path
) -> dict[str, Any]:
    state = tmp_path / "state"
    state.mkdir()
    (pytester.path / "state_dir.txt").write_text(str(state))
    _seed(state, target)
    pytester.makepyfile(test_suite=SUITE)
    before = _files(state)

    result = pytester.runpytest(*target_args, "-n", "2", "--check-only", "--report-name=check")
    assert outcome_counts(result.outlines) == {"passed": 2, "would fix": 2}, result.outlines[-40:]
    assert _files(state) == before, "--check-only changed the target"

    result = pytester.runpytest(*target_args, "-n", "2", "--report-name=fix")
    assert outcome_counts(result.outlines) == {"passed": 2, "fixed": 2}, result.outlines[-40:]
    assert set(_files(state).values()) == {"good"} and len(_files(state)) == 4

    result = pytester.runpytest(*target_args, "--report-name=again")
    assert outcome_counts(result.outlines) == {"passed": 4}, result.outlines[-40:]

    reports = pytester.path / "reports"
    assert {"check.html", "check.json", "fix.html", "fix.json", "fix.xml", "again.json"} <= {
        p.name for p in reports.iterdir()
    }
    data: dict[str, Any] = json.loads((reports / "fix.json").read_text())
    return data


def _check_fix_report(data: dict[str, Any], target: str) -> None:
    by_name = {t["nodeid"].split("[", 1)[1].rstrip("]"): t for t in data["tests"]}
    assert {t["target"] for t in data["tests"]} == {target}
    b = by_name[f"{target}-b"]
    assert b["gpuhost_outcome"] == "fixed" and b["outcome"] == "passed"
    commands = b["evidence"]["call"]["commands"]
    assert (
        commands[0]["command"].startswith("cat ")
        and commands[0]["stdout"] == "bad"
        and commands[0]["rc"] == 0
    )
    assert any(c["command"].startswith("echo good > ") for c in commands), commands
    assert [s["label"] for s in b["evidence"]["call"]["states"]] == ["before", "after"]
    assert b["evidence"]["call"]["actions"][0]["status"] == "done"
    assert by_name[f"{target}-a"]["gpuhost_outcome"] == "passed"


def test_suite_against_local(pytester: pytest.Pytester, tmp_path: Path) -> None:
    data = _run_suite(pytester, ["--host=local://"], "local", tmp_path)
    _check_fix_report(data, "local")


def test_suite_against_sshd(pytester: pytest.Pytester, tmp_path: Path, sshd: Any) -> None:
    args = [f"--host={sshd.url}", f"--ssh-identity={sshd.identity}", f"--known-hosts={sshd.known_hosts}"]
    data = _run_suite(pytester, args, "127.0.0.1", tmp_path)
    _check_fix_report(data, "127.0.0.1")

"""Each named safety check is guarded: scripts/mutate.py breaks it in a copy and a test must fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def runs_here(guard: str, nodeids: set[str]) -> bool:
    """True when this session runs ``guard`` (a file, or a node id and its parametrizations)."""
    return any(n == guard or n.startswith((f"{guard}::", f"{guard}[")) for n in nodeids)


def test_every_named_safety_check_has_a_test_that_fails_without_it(request: pytest.FixtureRequest) -> None:
    # A kill proves something only when the same tests pass unmutated. When this session runs
    # every guarding test itself (the full suite, CI), a red guard fails the run on its own, so
    # the script's control (one more session over all of them) is left out; run alone, it runs.
    script = [sys.executable, str(ROOT / "scripts" / "mutate.py")]
    guards = subprocess.run([*script, "--guards"], capture_output=True, text=True, check=True).stdout.split()
    nodeids = {item.nodeid for item in request.session.items}
    here = all(runs_here(g, nodeids) for g in guards)
    r = subprocess.run(
        [*script, *(["--no-control"] if here else [])], capture_output=True, text=True, timeout=1200
    )
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "survived" not in r.stdout and " killed" in r.stdout


def _mutate():
    return load_script("mutate")


def test_the_control_runs_each_guarding_test_once_and_a_whole_file_covers_its_node_ids() -> None:
    m = _mutate()
    a = m.Mutation("a", "", "x", "o", "n", ("tests/t_one.py", "tests/t_two.py::test_b"))
    b = m.Mutation("b", "", "x", "o", "n", ("tests/t_one.py::test_a", "tests/t_two.py::test_b"))
    assert m.guarding_tests([a, b]) == ["tests/t_one.py", "tests/t_two.py::test_b"]


def test_a_control_that_fails_unmutated_is_reported_failed() -> None:
    m = _mutate()
    gone = m.Mutation("gone", "", "x", "o", "n", ("tests/test_no_such_file_here.py",))
    verdict, _ = m.run_control([gone], sys.executable)
    assert verdict.startswith("failed: pytest exit 4"), verdict


def test_the_control_is_left_only_when_the_session_runs_every_guard() -> None:
    ids = {"tests/test_a.py::test_x[1]", "tests/test_a.py::test_y", "tests/test_b.py::test_z"}
    assert runs_here("tests/test_a.py", ids) and runs_here("tests/test_a.py::test_x", ids)
    assert not runs_here("tests/test_a.py::test_xy", ids) and not runs_here("tests/test_c.py", ids)

"""Each named safety check is guarded: scripts/mutate.py breaks it in a copy and a test must fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_named_safety_check_has_a_test_that_fails_without_it() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mutate.py")], capture_output=True, text=True, timeout=1200
    )
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "survived" not in r.stdout and " killed" in r.stdout


def _mutate():  # the script is not a package module: load it from its path
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpuhost_mutate", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


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

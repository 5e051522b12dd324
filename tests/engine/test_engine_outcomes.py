"""The remediation engine's outcomes, check-only, procedures and terminal summary (pytester)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.outcomes import outcome_counts

# A remediation against a file: check "content is ok", fix writes "ok" (and logs each fix).
ENGINE_TESTS = """
import pathlib
import pytest
from pytest_gpuhost.run.remediation import Action, Check

HERE = pathlib.Path(__file__).parent

def file_rem(remediate, name, writes="ok"):
    path = HERE / name
    def check():
        text = path.read_text() if path.exists() else ""
        return Check(text == "ok", f"{name} is {text!r}", state={"content": text})
    def plan(before):
        return [Action(f"write ok to {name}", f"echo ok > {name}")]
    def fix(actions, before):
        with open(HERE / "fixes.log", "a") as log:
            log.write(name + "\\n")
        path.write_text(writes)
    return remediate(name=f"{name} holds ok", check=check, plan=plan, fix=fix)

def test_holds(remediate):
    file_rem(remediate, "a.txt")

def test_broken(remediate):
    file_rem(remediate, "b.txt")

def test_unfixable(remediate):
    file_rem(remediate, "c.txt", writes="still wrong")

def test_not_here(remediate):
    remediate(name="no gpus", check=lambda: Check(True, "n/a", skip="no NVIDIA GPU on this host"))
"""


@pytest.fixture
def engine(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_engine=ENGINE_TESTS)
    (pytester.path / "a.txt").write_text("ok")
    (pytester.path / "b.txt").write_text("broken")
    return pytester


def test_outcomes_and_terminal_summary(engine: pytest.Pytester) -> None:
    result = engine.runpytest("-v", "--report-dir=none")
    result.stdout.fnmatch_lines(
        [
            "*test_holds PASSED*",
            "*test_broken FIXED*",
            "*test_unfixable FAILED*",
            "*test_not_here SKIPPED (no gpus: *",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*failed: c.txt holds ok: fix did not verify",
            "*before: c.txt is ''",
            "*after:  c.txt is 'still wrong'",
        ]
    )
    assert outcome_counts(result.outlines) == {"failed": 1, "passed": 1, "skipped": 1, "fixed": 1}
    assert result.ret == 1
    assert (engine.path / "b.txt").read_text() == "ok"


def test_check_only_changes_nothing_and_shows_actions(engine: pytest.Pytester) -> None:
    result = engine.runpytest("-v", "--check-only", "--report-dir=none")
    result.stdout.fnmatch_lines(["*test_broken WOULD FIX*", "*test_unfixable WOULD FIX*"])
    result.stdout.fnmatch_lines(
        ["*= would fix (check-only) =*", "*test_broken*", "*write ok to b.txt: echo ok > b.txt"]
    )
    assert outcome_counts(result.outlines) == {"passed": 1, "skipped": 1, "would fix": 2}
    assert result.ret == 1, "would fix must fail the run (CI gating)"
    assert (engine.path / "b.txt").read_text() == "broken"
    assert not (engine.path / "fixes.log").exists(), "check-only called a fix"


def test_second_run_passes_everywhere(engine: pytest.Pytester) -> None:
    engine.runpytest("--report-dir=none", "--deselect=test_engine.py::test_unfixable")
    assert (engine.path / "fixes.log").read_text() == "b.txt\n"
    result = engine.runpytest("--report-dir=none", "--deselect=test_engine.py::test_unfixable")
    assert outcome_counts(result.outlines) == {"passed": 2, "skipped": 1, "deselected": 1}
    assert (engine.path / "fixes.log").read_text() == "b.txt\n", "a second run fixed again"


def test_fix_that_raises_fails_with_before_and_after(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from pytest_gpuhost.run.remediation import Action, Check, Remediation

        class Stuck(Remediation):
            name = "unbind 0000:01:00.0"
            def check(self):
                return Check(False, "bound to nvidia", state={"driver": "nvidia"})
            def plan(self, before):
                return [Action("unbind", "echo 0000:01:00.0 > /sys/bus/pci/drivers/nvidia/unbind")]
            def fix(self, actions, before):
                raise OSError(16, "Device or resource busy")

        def test_stuck(remediate):
            remediate(Stuck())
        """
    )
    result = pytester.runpytest("--report-dir=none")
    result.stdout.fnmatch_lines(
        [
            "*failed: unbind 0000:01:00.0: fix raised OSError: [[]Errno 16[]] Device or resource busy",
            "*before: bound to nvidia",
            "*after:  bound to nvidia",
        ]
    )
    result.assert_outcomes(failed=1)


def test_hooks_veto_extend_and_observe(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        from pytest_gpuhost.run.remediation import Action
        SEEN = []

        def pytest_gpuhost_before_fix(item, target, remediation, actions, check_only):
            if "vfio" in remediation.name:
                return "GPU belongs to a VM"
            actions.append(Action("log it", "logger fixed", destructive=False))

        def pytest_gpuhost_after_fix(item, target, remediation, actions, outcome, after):
            SEEN.append(("after", remediation.name, outcome, after.ok, [a.command for a in actions]))

        def pytest_gpuhost_outcome(item, outcome):
            SEEN.append(("outcome", outcome.name, outcome.outcome))

        def pytest_sessionfinish(session):
            import json, pathlib
            pathlib.Path("seen.json").write_text(json.dumps(SEEN))
        """
    )
    pytester.makepyfile(
        """
        from pytest_gpuhost.run.remediation import Action, Check
        state = {"vfio": False, "plain": False}
        got = []

        def rem(remediate, name):
            def fix(actions, before):
                got.extend(a.command for a in actions)
                state[name] = True
            return remediate(name=name, check=lambda: Check(state[name], name), fix=fix,
                             plan=lambda b: [Action("set", "set " + name)])

        def test_vetoed(remediate):
            rem(remediate, "vfio")

        def test_extended(remediate):
            rem(remediate, "plain")
            assert got == ["set plain", "logger fixed"]
        """
    )
    result = pytester.runpytest("--report-dir=none")
    result.stdout.fnmatch_lines(["*failed: vfio: vetoed: GPU belongs to a VM*"])
    assert outcome_counts(result.outlines) == {"failed": 1, "fixed": 1}
    seen = json.loads((pytester.path / "seen.json").read_text())
    assert seen == [
        ["outcome", "vfio", "failed"],
        ["after", "plain", "fixed", True, ["set plain", "logger fixed"]],
        ["outcome", "plain", "fixed"],
    ]


def test_procedure_blocks_after_failed_step_not_after_would_fix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from pytest_gpuhost.run.remediation import Action, Check
        pytestmark = pytest.mark.gpuhost_procedure

        def test_one(remediate):
            remediate(name="one", check=lambda: Check(False, "no"), fix=lambda a, b: None,
                      plan=lambda b: [Action("do", "true")])

        def test_two(remediate):
            remediate(name="two", check=lambda: Check(True, "yes"))

        def test_three():
            pass
        """
    )
    result = pytester.runpytest("-rs", "--report-dir=none")
    result.stdout.fnmatch_lines(["*blocked: step test_one failed*"])
    result.assert_outcomes(failed=1, skipped=2)
    result = pytester.runpytest("--check-only", "--report-dir=none")
    assert outcome_counts(result.outlines) == {"passed": 2, "would fix": 1}


def test_worst_outcome_of_several_and_report_attributes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from pytest_gpuhost.run.remediation import Check
        state = {"x": False}

        def test_two(target, remediate, evidence):
            remediate(name="holds", check=lambda: Check(True, "fine"))
            out = remediate(name="x", check=lambda: Check(state["x"], "x"), fix=lambda a, b: state.update(x=True))
            assert out.outcome == "fixed" and out
            evidence.measure("bandwidth", 24.5, "GB/s")
        """
    )
    result = pytester.runpytest("-n", "2", "--report-name=run1", "--host=local://")
    assert outcome_counts(result.outlines) == {"fixed": 1}
    data = json.loads(Path(pytester.path / "reports" / "run1.json").read_text())
    (test,) = data["tests"]
    assert test["gpuhost_outcome"] == "fixed" and test["outcome"] == "passed"
    assert [r["outcome"] for r in test["remediations"]] == ["passed", "fixed"]
    assert test["evidence"]["call"]["measures"] == [
        {"name": "bandwidth", "value": 24.5, "unit": "GB/s", "target": ""}
    ]
    assert data["summary"] == {"fixed": 1}


def test_check_only_without_a_planned_fix_fails_rather_than_would_fix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from pytest_gpuhost.run.remediation import Check

        def test_pure_check(remediate):
            remediate(name="temperature", check=lambda: Check(False, "GPU 3 at 93 C"))
        """
    )
    result = pytester.runpytest("--check-only", "--report-dir=none", "-rA")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*no fix is planned: GPU 3 at 93 C*"])
    assert "would fix" not in result.stdout.lines[-1]


def test_final_step_runs_after_a_failed_step(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from pytest_gpuhost.run.remediation import Check

        pytestmark = pytest.mark.gpuhost_procedure

        def test_one(remediate):
            remediate(name="one", check=lambda: Check(False, "broken"))

        def test_two():
            pass

        @pytest.mark.gpuhost_final
        def test_verdict():
            pass
        """
    )
    result = pytester.runpytest("--report-dir=none", "-rs")
    result.assert_outcomes(failed=1, skipped=1, passed=1)
    result.stdout.fnmatch_lines(["*blocked: step test_one failed*"])


def test_action_status_says_what_happened_to_each_planned_action(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from pytest_gpuhost.run.remediation import Action, Check

        def plan(before):
            return [Action("restart", "systemctl restart x")]

        def test_fixed(target, remediate):
            state = {"ok": False}
            remediate(name="a", check=lambda: Check(state["ok"], "a"), plan=plan,
                      fix=lambda actions, before: state.update(ok=True))

        def test_not_verified(target, remediate):
            remediate(name="b", check=lambda: Check(False, "b"), plan=plan, fix=lambda actions, before: None)

        def test_fix_raised(target, remediate):
            def fix(actions, before):
                raise OSError("no")
            remediate(name="c", check=lambda: Check(False, "c"), plan=plan, fix=fix)

        def test_check_only(target, remediate):
            remediate(name="d", check=lambda: Check(False, "d"), plan=plan, fix=lambda actions, before: None)
        """
    )
    pytester.runpytest(
        "--host=local://",
        "--report-name=s",
        "--deselect=test_action_status_says_what_happened_to_each_planned_action.py::test_check_only[local]",
    )
    pytester.runpytest("--host=local://", "--report-name=c", "--check-only", "-k", "check_only")
    statuses = {}
    for name in ("s", "c"):
        data = json.loads((pytester.path / "reports" / f"{name}.json").read_text())
        for t in data["tests"]:
            statuses[t["check"]] = [a["status"] for a in t["evidence"]["call"]["actions"]]
    assert statuses == {
        "fixed": ["done"],
        "not_verified": ["ran, not verified"],
        "fix_raised": ["failed"],
        "check_only": ["planned"],
    }

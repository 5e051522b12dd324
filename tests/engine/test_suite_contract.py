"""The suite contract (pytest_gpuhost/run/suite.py): each suite declared once, the rest made from it."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

from pytest_gpuhost.run import options
from pytest_gpuhost.run.suite import Suite, option, registered, table_of

ROOT = Path(__file__).resolve().parents[2]
SUITES = registered("suites")
#: Functions in suites/ still over the limit, with their length now: each may only shrink.
LONG: dict[str, int] = {}


def test_every_registered_suite_is_declared_with_the_contract() -> None:
    assert sorted(s.name for s in SUITES) == ["accept", "decommission", "health", "p2p"]


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_every_option_default_is_read_from_the_declaration(suite: Suite) -> None:
    """Each option's default is its dataclass field's: the table has no default of its own."""
    fresh = suite.options()
    by_name = {o.name: o for o in suite.table}
    for f in dataclasses.fields(suite.options):
        declared = f.metadata.get("gpuhost_option")
        if declared is None:
            continue
        opt = by_name.pop(declared.ini or f"{suite.name}_{f.name}")
        want = f.default if f.default is not dataclasses.MISSING else None
        assert opt.default == want and opt.help.startswith(f"{suite.label or 'suites/' + suite.name}: "), (
            opt.name
        )
        if want is not None:
            assert getattr(fresh, f.name) == want, f.name
    assert by_name == {}


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_docs_options_table_shows_each_declared_default(suite: Suite) -> None:
    """docs/options.md has a row per option of the suite, with the declared default where it has one."""
    rows = {}
    for line in (ROOT / "docs" / "options.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) >= 4 and cells[1].startswith("`") and cells[1].endswith("`"):
            rows[cells[1].strip("`")] = cells[2]
    for opt in suite.table:
        assert opt.name in rows, f"docs/options.md has no row for {opt.name}"
        shown = options.show_default(opt.default)
        if shown:
            want = {"on": "on", "off": "off"}.get(shown, shown)
            assert rows[opt.name] in (want, f"`{want}`") or (
                not opt.default and rows[opt.name] in ("none (no fix)",)
            ), (
                opt.name,
                rows[opt.name],
                shown,
            )


@pytest.mark.parametrize("suite", [s for s in SUITES if s.steps], ids=lambda s: s.name)
def test_the_suites_tests_are_its_declared_steps_in_order(suite: Suite) -> None:
    module = importlib.import_module(f"suites.{suite.name}.test_{suite.name}")
    tests = [n for n in vars(module) if n.startswith("test_")]
    assert tests == [s.test_name for s in suite.steps]
    for spec in suite.steps:
        fn = getattr(module, spec.test_name)
        assert fn.__doc__ == spec.holds and fn.__module__ == module.__name__
    finals = [s.test_name for s in suite.steps if s.final]
    for name in finals:
        assert any(m.name == "gpuhost_final" for m in getattr(getattr(module, name), "pytestmark", []))
    # a blocking suite's failed step skips the later ones; accept's every check runs regardless
    marked = getattr(module, "pytestmark", None)
    assert (getattr(marked, "name", None) == "gpuhost_procedure") == suite.blocking
    assert suite.blocking == (suite.name != "accept")


def test_an_option_field_makes_one_option_with_its_default_and_ini_name() -> None:
    @dataclasses.dataclass
    class Opts:
        wait: float = option(5.0, flag="--x-wait", help="how long (default {default})", parse=options.seconds)
        when: str = option(flag=None, ini="x_when_ini", help="ini only")
        fixed: int = 3

    wait, when = table_of(Opts, "x")
    assert (wait.name, wait.flag, wait.default, wait.help_text) == (
        "x_wait",
        "--x-wait",
        5.0,
        "suites/x: how long (default 5)",
    )
    assert (when.name, when.flag, when.default) == ("x_when_ini", None, None)


def test_no_function_in_suites_is_over_100_lines() -> None:
    """A step is a Remediation class with named check, plan and fix, not one long closure."""
    found = {}
    for path in sorted((ROOT / "suites").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 100:
                    found[f"{path.relative_to(ROOT)}:{node.name}"] = length
    grown = {k: v for k, v in found.items() if v > LONG.get(k, 100)}
    assert grown == {}
    assert set(LONG) <= set(found), f"shorter now: drop {sorted(set(LONG) - set(found))} from LONG"

#!/usr/bin/env python3
"""Write the tables docs/ shows from the code that defines them; `--check` only compares.

Each table sits in its doc between a start marker and an end marker, `<!-- generated: NAME -->`
and `<!-- /generated: NAME -->`; what lies between is replaced. Today: the health thresholds
(`health.thresholds.THRESHOLDS`) and the health checks (`health.checks.DECLARED`), both in
docs/fleet.md, and the module indexes: every module of `pytest_gpuhost/exec/` in docs/EXEC.md,
every other module of `pytest_gpuhost/`, `suites/` and `gpulab/` in docs/INTERNALS.md, each with
the first line of its docstring (the module's own one-line summary is the one home of what it
holds). `--check` exits 1 naming each stale table, so a test (tests/project/test_docs_tables.py) fails
when the code changed and the doc did not.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pytest_gpuhost.modules.health.checks import checks_table  # noqa: E402
from pytest_gpuhost.modules.health.thresholds import markdown_table  # noqa: E402

PACKAGES = ("pytest_gpuhost", "suites", "gpulab")
EXEC = "pytest_gpuhost/exec/"


def modules(where: str = "") -> list[Path]:
    """Every module (and package with a docstring) of the packages, under `where` when given."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py" and not path.read_text(encoding="utf-8").strip():
                continue
            if rel.startswith(where):
                out.append(path)
    return out


def summary(path: Path) -> str:
    """The first line of a module's docstring; ValueError for a module without one."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not doc:
        raise ValueError(f"{path.relative_to(ROOT)} has no docstring: say in one line what it holds")
    return doc.strip().splitlines()[0].replace("|", "\\|")


def module_table(paths: list[Path]) -> str:
    """A markdown table of modules: the path (a package as `dir/`) and its one-line summary."""
    rows = ["| module | what it holds |", "|---|---|"]
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        name = rel[: -len("__init__.py")] if path.name == "__init__.py" else rel
        rows.append(f"| `{name}` | {summary(path)} |")
    return "\n".join(rows) + "\n"


def exec_index() -> str:
    return module_table(modules(EXEC))


def internals_index() -> str:
    return module_table([p for p in modules() if not p.relative_to(ROOT).as_posix().startswith(EXEC)])


#: name -> (doc, the function that renders the table)
TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "thresholds": ("docs/fleet.md", markdown_table),
    "checks": ("docs/fleet.md", checks_table),
    "exec-modules": ("docs/EXEC.md", exec_index),
    "modules": ("docs/INTERNALS.md", internals_index),
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- generated: {name} -->\n", f"<!-- /generated: {name} -->"


def render(text: str, name: str, table: str) -> str:
    """Return ``text`` with the table ``name`` replaced by ``table``; ValueError when a marker is missing."""
    start, end = markers(name)
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no '{start.strip()}' ... '{end}' block")
    return text[: i + len(start)] + table + text[j:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 when a table is stale")
    args = ap.parse_args(argv)
    stale = 0
    for name, (doc, fn) in TABLES.items():
        path = ROOT / doc
        text = path.read_text(encoding="utf-8")
        try:
            new = render(text, name, fn())
        except ValueError as e:
            print(f"docs_tables: {doc}: {e}", file=sys.stderr)
            return 2
        if new == text:
            continue
        if args.check:
            stale += 1
            print(f"docs_tables: {doc}: the {name} table is stale; run scripts/docs_tables.py")
        else:
            path.write_text(new, encoding="utf-8")
            print(f"docs_tables: {doc}: {name} table written")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())

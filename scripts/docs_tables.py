#!/usr/bin/env python3
"""Write the tables docs/ shows from the code that defines them; `--check` only compares.

Each table sits in its doc between a start marker and an end marker, `<!-- generated: NAME -->`
and `<!-- /generated: NAME -->`; what lies between is replaced. Today: the health thresholds
(`health.thresholds.THRESHOLDS`) and the health checks (`health.checks.DECLARED`), both in
docs/fleet.md. `--check` exits 1 naming each stale table, so
a test (tests/test_docs_tables.py) fails when the code changed and the doc did not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pytest_gpuhost.modules.health.checks import checks_table  # noqa: E402
from pytest_gpuhost.modules.health.thresholds import markdown_table  # noqa: E402

#: name -> (doc, the function that renders the table)
TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "thresholds": ("docs/fleet.md", markdown_table),
    "checks": ("docs/fleet.md", checks_table),
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

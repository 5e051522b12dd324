"""The tables docs/ shows are generated from the code (scripts/docs_tables.py) and kept current."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _script():
    return load_script("docs_tables")


def test_every_generated_table_in_docs_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert _script().main(["--check"]) == 0, capsys.readouterr().out


def test_a_threshold_changed_in_the_code_makes_the_doc_stale() -> None:
    m = _script()
    doc = (ROOT / "docs" / "fleet.md").read_text()
    table = m.TABLES["thresholds"][1]()
    assert m.render(doc, "thresholds", table) == doc
    changed = table.replace("| `temperature_max` | 85 |", "| `temperature_max` | 90 |")
    assert changed != table and m.render(doc, "thresholds", changed) != doc
    with pytest.raises(ValueError, match="no '<!-- generated: nothing -->'"):
        m.render(doc, "nothing", table)


def test_one_thresholds_table_in_the_docs() -> None:
    """One thresholds table in all of docs/, the generated one: no second, hand-kept copy to drift."""
    from pytest_gpuhost.modules.health.thresholds import markdown_table

    docs = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    assert docs.count("| variable | default | meaning |") == 1
    for row in markdown_table().splitlines()[2:]:
        assert docs.count(row) == 1, row

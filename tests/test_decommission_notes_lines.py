"""The line renderer of NOTES.md and the verdict (suites/decommission/notes.py `md`, `cell`)."""

from __future__ import annotations

import pytest

from suites.decommission.notes import cell, md

KEY_ID = "AKIAIOSFODNN7EXAMPLE"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("a\nb", "a\\nb"),
        ("a\r\nb", "a\\r\\nb"),
        ("\x1b[2J\x1b]0;t\x07", "\\x1b[2J\\x1b]0;t\\x07"),
        ("a\u2028b\x85c", "a\\u2028b\\x85c"),
        (f"/d/creds-{KEY_ID}", "/d/creds-***"),
        ("/d/db password=hunter2", "/d/db password=***"),
        ("plain /data/a b $(x)", "plain /data/a b $(x)"),
    ],
)
def test_md_gives_one_line_with_no_secret_and_no_control_byte(text: str, want: str) -> None:
    assert md(text) == want
    assert "\n" not in md(text) and md(text).isprintable()


def test_cell_keeps_a_pipe_in_its_column() -> None:
    assert cell("NVIDIA | B200\n") == "NVIDIA \\| B200\\n"

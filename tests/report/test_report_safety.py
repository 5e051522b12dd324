"""Node strings (target names, parameter ids, check summaries) are inert in every output.

HTML: proved in Chromium's DOM after the report's own JavaScript has built the table (pytest-html
inserts the rows as HTML). Terminal: control characters and escape sequences are shown, not obeyed.
"""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

PAYLOAD = "<img src=x onerror=document.title='pwned'>"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
)

CONFTEST = f"""
from pytest_gpuhost.exec.targets import parse_host_url

def pytest_gpuhost_targets(config, targets):
    # Inventories refuse such names; the hook is the way round that a conftest could take.
    targets.append(parse_host_url("local://", name={PAYLOAD + chr(27) + "[31m"!r}))
"""

TESTS = """
import pytest
from pytest_gpuhost.run.remediation import Check

def test_ok(target):
    pass

def test_broken(target, remediate):
    remediate(
        name="clear\\x1b[2Jscreen",
        check=lambda: Check(False, "bad\\x1b]0;retitled\\x07 \\r<script>alert(1)</script>"),
        fix=lambda actions, before: None,
    )

@pytest.mark.parametrize("value", ["<script>alert(2)</script>", "<b onmouseover=alert(3)>x</b>"])
def test_param(target, value):
    pass
"""


class _Elements(HTMLParser):
    """Collect every start tag with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_title = tag == "title"

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag: str) -> None:
        self._in_title = False


@pytest.fixture
def payload_run(pytester: pytest.Pytester) -> tuple[pytest.RunResult, Path]:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_safety=TESTS)
    result = pytester.runpytest_subprocess("--report-name=r", "-rA")
    report = pytester.path / "reports" / "r.html"
    assert report.is_file(), result.stdout.str()
    return result, report


def test_markup_in_node_strings_is_inert_in_chromium(payload_run: tuple[pytest.RunResult, Path]) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it)")
    _, report = payload_run
    assert "onerror=document.title" in report.read_text(), "the payload reaches the report (escaped)"
    dom = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, "--dump-dom", report.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    parser = _Elements()
    parser.feed(dom)
    rows = [attrs for tag, attrs in parser.tags if tag == "td" and attrs.get("class") == "col-testId"]
    assert len(rows) >= 4, "the report's script built the results table"
    handlers = [(tag, a) for tag, a in parser.tags for name in a if name.startswith("on")]
    # pytest-html's own reload button is the one element with a handler.
    assert [a for _, a in handlers] == [
        {"class": "summary__reload__button hidden", "onclick": "location.reload()"}
    ]
    assert [a for tag, a in parser.tags if tag == "img" and a.get("src") == "x"] == []
    assert [tag for tag, _ in parser.tags if tag == "script"] == ["script"], "only the report's own script"
    # the title names the node: its escape bytes shown as text, its markup inert (no element above)
    assert parser.title.startswith("gpuhost run: ") and "\x1b" not in parser.title, parser.title


def test_control_characters_are_shown_not_obeyed_in_the_terminal(
    payload_run: tuple[pytest.RunResult, Path],
) -> None:
    result, _ = payload_run
    out = result.stdout.str()
    for raw in ("\x1b", "\x07", "\r"):
        assert raw not in out, (raw, [line for line in result.outlines if raw in line])
    assert "\\x1b[2J" in out and "\\x07" in out
    result.stdout.fnmatch_lines(["*gpuhost fleet*", "*1 failed*"])

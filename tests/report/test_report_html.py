"""The HTML report: outcome and target columns, targets x checks matrix, evidence per row, heatmaps, Chromium."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

# Imported here, outside pytester's inline runs (see test_plugin_fixtures.py).
import pytest_gpuhost.exec.targets  # noqa: F401
from pytest_gpuhost.report.html import check_name, heatmap

SUITE = """
import pytest
from pytest_gpuhost.run.remediation import Action, Check

state = {"fixed": False}

@pytest.fixture
def prepared(target, evidence):
    target.conn.run(["echo", "setup-marker"])
    yield
    evidence.note("teardown-marker")

def test_fixme(target, prepared, remediate, evidence):
    evidence.matrix("p2p before", ["GPU0", "GPU1"], [[None, 3.1], [2.9, None]], threshold=20)
    def fix(actions, before):
        target.conn.run(["echo", "fixing-now"])
        state["fixed"] = True
    remediate(name="p2p identity", check=lambda: Check(state["fixed"], "fixed" if state["fixed"] else "DMA-FQ",
                                                       state={"type": "identity" if state["fixed"] else "DMA-FQ"}),
              plan=lambda b: [Action("set identity", "echo identity > /sys/kernel/iommu_groups/12/type")], fix=fix)
    evidence.matrix("p2p after", ["GPU0", "GPU1"], [[None, 24.8], [25.1, None]], threshold=20)

def test_fine(target):
    assert target.conn.run(["true"]).rc == 0

def test_broken(target):
    assert target.conn.run(["sh", "-c", "echo '<b>not bold</b>'; exit 3"]).rc == 0
"""


def _report_data(path: Path) -> dict[str, Any]:
    blob = re.search(r'data-jsonblob="([^"]*)"', path.read_text())
    assert blob, "no data blob in the report"
    data: dict[str, Any] = json.loads(html.unescape(blob.group(1)))
    return data


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the suite once (with -n 2) and return the HTML report's path."""
    work = tmp_path_factory.mktemp("report")
    (work / "test_rep.py").write_text(SUITE)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--host=local://",
            "--report-name=rep",
            "test_rep.py",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "1 failed, 1 passed, 1 fixed" in proc.stdout.splitlines()[-1]
    return work / "reports" / "rep.html"


def test_row_shows_outcome_target_and_evidence(report: Path) -> None:
    data = _report_data(report)
    rows = {nodeid.split("::")[1]: entries[0] for nodeid, entries in data["tests"].items()}
    fixme = rows["test_fixme[local]"]
    cells = "".join(fixme["resultsTableRow"])
    assert (
        'class="gh-outcome gh-fixed">fixed<' in cells and '<td class="col-gpuhostTarget">local</td>' in cells
    )
    extras = "".join(e["content"] for e in fixme["extras"] if e["format_type"] == "html")
    for text in (
        "gpuhost evidence (setup)",
        "echo setup-marker",
        "gpuhost evidence (call)",
        "echo fixing-now",
        "set identity",
        "echo identity &gt; /sys/kernel/iommu_groups/12/type",
        "teardown-marker",
        '"type": "DMA-FQ"',
        '"type": "identity"',
    ):
        assert html.escape(text) in extras or text in extras, text
    # before/after heatmaps side by side, on one scale, cells coloured and marked under the threshold
    assert extras.count('<table class="gh-heat">') == 2 and 'class="gh-heat-pair"' in extras
    assert 'class="gh-below"' in extras and "24.80" in extras

    broken = rows["test_broken[local]"]
    assert 'gh-failed">failed<' in "".join(broken["resultsTableRow"])
    extras = "".join(e["content"] for e in broken["extras"])
    assert "&lt;b&gt;not bold&lt;/b&gt;" in extras and "<b>not bold</b>" not in extras, (
        "stdout must be escaped"
    )
    assert 'class="gh-rc-bad">3<' in extras


def test_summary_matrix_of_targets_and_checks(report: Path) -> None:
    text = report.read_text()
    matrix = text[text.index('id="gpuhost-matrix"') :]
    matrix = matrix[: matrix.index("</table>")]
    # The fleet summary's check names: one function names a check in every output.
    assert "<th>fixme</th><th>fine</th><th>broken</th>" in matrix.replace("\n", "")
    assert "<th>local</th>" in matrix and "gh-fixed" in matrix and "gh-failed" in matrix
    assert '<th class="sortable" data-column-type="gpuhostOutcome">Outcome</th>' in text


def test_check_names_drop_the_file_test_prefix_and_target() -> None:
    assert check_name("suites/p2p/test_a.py::test_x[gpu-1]", "gpu-1") == "x"
    assert check_name("t.py::test_x[gpu-1-a.txt]", "gpu-1") == "x[a.txt]"
    assert check_name("t.py::test_x[a-gpu-1]", "gpu-1") == "x[a]"
    assert check_name("t.py::test_x[a-b]", "") == "x[a-b]"
    assert check_name("t.py::TestC::test_y", "") == "TestC::y"
    assert check_name("t.py::test_xid[gpu-1]", "gpu-1", "xid_errors") == "xid_errors", "an explicit name wins"


def test_heatmap_colours_follow_values() -> None:
    table = heatmap(
        {"name": "bw", "labels": ["0", "1"], "values": [[None, 10.0], [50.0, None]], "unit": "GB/s"}
    )
    colours = re.findall(r"background:hsl\((\d+),", table)
    assert colours == ["0", "120"], "lowest red, highest green"
    assert table.count("N/A") == 2


CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="chromium is not installed (/usr/bin/chromium)")
def test_report_renders_in_headless_chromium(report: Path) -> None:
    profile = tempfile.mkdtemp(prefix="gpuhost-chromium-")
    try:
        proc = subprocess.run(
            [
                str(CHROMIUM),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--dump-dom",
                report.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    dom = proc.stdout
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The rows exist only once the report's JavaScript has run: this is the rendered DOM.
    # One chunk per result row (evidence tables have their own implicit <tbody>s).
    rows = [r for r in dom.split('<tbody class="results-table-row')[1:] if 'class="col-gpuhostOutcome"' in r]
    assert len(rows) == 3, len(rows)
    fixme = next(r for r in rows if "test_fixme" in r)
    # What the fix changed is in the result row itself, shown while pytest-html collapses the row.
    assert re.search(
        r'<tr class="collapsible"[^>]*>\s*<td class="col-result[^>]*>[^<]*</td>\s*'
        r'<td class="col-gpuhostOutcome"><span class="gh-outcome gh-fixed">fixed</span>'
        r'<div class="gh-changed">p2p identity: DMA-FQ',
        fixme,
    ), fixme[:600]
    assert '<td class="col-gpuhostTarget">local</td>' in fixme
    assert 'class="extraHTML"' in fixme and "echo fixing-now" in fixme and "gh-heat" in fixme
    assert 'id="gpuhost-matrix"' in dom


def test_fixed_rows_say_what_changed_and_pytest_html_counts_agree(report: Path) -> None:
    data = _report_data(report)
    rows = {nodeid.split("::")[1]: entries[0] for nodeid, entries in data["tests"].items()}
    fixme = rows["test_fixme[local]"]
    cells = html.unescape("".join(fixme["resultsTableRow"]))
    # In the row itself: pytest-html collapses passed rows, and a fixed test is one of them.
    assert 'class="gh-changed"' in cells
    assert "p2p identity: DMA-FQ \u2192 fixed" in cells
    assert "done: set identity: echo identity > /sys/kernel/iommu_groups/12/type" in cells
    # The before/after states as a unified diff, as Ansible's --check --diff.
    extras = html.unescape("".join(e["content"] for e in fixme["extras"] if e["format_type"] == "html"))
    diff = extras[extras.index('<pre class="gh-diff">') :]
    diff = re.sub(r"<[^>]+>", "", diff[: diff.index("</pre>")])
    assert diff.splitlines() == ["--- before: type", "+++ after: type", "@@ -1 +1 @@", "-DMA-FQ", "+identity"]
    text = report.read_text()
    # pytest-html's filter says what the badges say: 1 failed, 1 passed, 1 fixed.
    assert "2 Passed (1 fixed)," in text and "1 Failed," in text
    assert ".gh-fleet{white-space:pre-wrap" in text, "the Fleet text wraps"


def test_heatmap_colours_are_relative_to_the_threshold() -> None:
    table = heatmap(
        {
            "name": "bw",
            "labels": ["0", "1", "2"],
            "values": [[None, 21.0, 40.0], [5.0, None, 19.0], [20.0, 30.0, None]],
            "threshold": 20,
        }
    )
    hues = [int(h) for h in re.findall(r"background:hsl\((\d+),", table)]
    values = [21.0, 40.0, 5.0, 19.0, 20.0, 30.0]
    for value, hue in zip(values, hues, strict=True):
        if value >= 20:
            assert hue >= 75, (value, hue, "at or above the threshold is never red")
        else:
            assert hue <= 30, (value, hue, "below the threshold is red to orange")
    # 21 is the lowest value above the threshold in this matrix, and still green-ish, not red.
    assert hues[values.index(40.0)] == 120 and hues[values.index(5.0)] == 0


def test_state_diff_is_a_unified_diff_per_changed_key() -> None:
    from pytest_gpuhost.report.diff import state_diff

    before = {"/etc/modprobe.d/nvidia.conf": "options a=1\noptions b=2\n", "mode": "off", "same": 1}
    after = {"/etc/modprobe.d/nvidia.conf": "options a=1\noptions b=3\n", "mode": "on", "same": 1}
    assert state_diff(before, after) == [
        "--- before: /etc/modprobe.d/nvidia.conf",
        "+++ after: /etc/modprobe.d/nvidia.conf",
        "@@ -1,2 +1,2 @@",
        " options a=1",
        "-options b=2",
        "+options b=3",
        "--- before: mode",
        "+++ after: mode",
        "@@ -1 +1 @@",
        "-off",
        "+on",
    ]
    assert state_diff(before, before) == []


def test_fleet_count_line_counts_hosts_and_results_apart() -> None:
    from pytest_gpuhost.report.summary import count_line

    one = {
        "checks": ["a", "b", "c", "d"],
        "hosts": {
            "gpu-1": {
                "status": "failed",
                "checks": {
                    "a": {"outcome": "passed"},
                    "b": {"outcome": "fixed"},
                    "c": {"outcome": "would fix"},
                    "d": {"outcome": "skipped"},
                },
            }
        },
    }
    assert (
        count_line(one)
        == "1 host x 4 checks = 4 results: 1 passed, 1 fixed, 1 would fix, 1 skipped; hosts: 0 ok, 1 failed"
    )


@pytest.mark.skipif(not CHROMIUM.exists(), reason="chromium is not installed (/usr/bin/chromium)")
def test_the_answer_opens_the_rendered_report_and_a_screenshot_is_kept(report: Path) -> None:
    """The verdict in words is the first thing on the page, read from the DOM Chromium rendered.

    The screenshot is kept under reports/ci/ (ignored by git) for CI to show a reviewer.
    """
    profile = tempfile.mkdtemp(prefix="gpuhost-chromium-")
    shots = Path(__file__).resolve().parents[2] / "reports" / "ci"
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / "report-answer.png"
    base = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}"]  # fmt: skip
    try:
        dom = subprocess.run(
            [*base, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=60
        )
        pic = subprocess.run(
            [*base, "--hide-scrollbars", "--window-size=1280,900", f"--screenshot={shot}", report.as_uri()],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    banner = re.search(r'<div id="gpuhost-answer">(.*?)</div></div>', page, re.S)
    assert banner, page[:3000]
    assert re.search(r'class="gh-answer gh-answer-bad" data-target="local" data-ok="false"', banner.group(1))
    assert "<h2>local: NEEDS ATTENTION: 1 of 3 checks</h2>" in banner.group(1)
    assert "broken: failed" in banner.group(1)
    # before the matrix and the rows: the answer first
    assert page.index('id="gpuhost-answer"') < page.index('id="gpuhost-matrix"')
    assert "<title>gpuhost run: local</title>" in page or "gpuhost run: local" in page
    assert pic.returncode == 0 and shot.stat().st_size > 10_000, pic.stderr[-2000:]


PROCEDURE = """
import pytest
from pytest_gpuhost.run.remediation import Check

pytestmark = pytest.mark.gpuhost_procedure

def test_first(target, remediate):
    remediate(name="first", check=lambda: Check(False, "the first step found the host broken"))

def test_second(target, remediate):
    remediate(name="second", check=lambda: Check(True, "fine"))
"""


def test_a_skipped_step_says_why_in_a_sentence(tmp_path: Path) -> None:
    """No raw (path, line, reason) tuple and no plugin path in a skipped row: a sentence."""
    (tmp_path / "test_proc.py").write_text(PROCEDURE)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--host=local://", "--report-name=proc",
            "test_proc.py"]  # fmt: skip
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:]
    data = _report_data(tmp_path / "reports" / "proc.html")
    second = next(e for n, es in data["tests"].items() if "test_second" in n for e in es)
    log = html.unescape("".join(second["log"]))
    assert "Not run: the step before it, first, failed" in log, log
    assert "site-packages" not in log and "remediation.py" not in log and "('" not in log, log

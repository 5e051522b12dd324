"""The run record: one check name and one result per test, the same in every output."""

from __future__ import annotations

import html
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

# Imported here, outside pytester's inline runs (see test_plugin_fixtures.py).
import pytest_gpuhost.exec.targets  # noqa: F401
from pytest_gpuhost.run.record import check_name, combine, one_line, phase_result

REPO = Path(__file__).resolve().parents[2]

SUITE = """
import pytest
from pytest_gpuhost.run.remediation import Check

@pytest.fixture
def broken_setup():
    raise OSError("no such device")

@pytest.fixture
def broken_teardown():
    yield
    raise OSError("could not put it back")

def test_fine(target):
    pass

def test_broken(target):
    assert False, "it broke"

def test_unprepared(target, broken_setup):
    pass

def test_messy(target, broken_teardown):
    pass

@pytest.mark.parametrize("port", ["eth0", "eth1"])
def test_link(target, port):
    assert port == "eth0", "link down"

def test_named(target, request, remediate):
    request.node.user_properties.append(("gpuhost_check", "driver_version"))
    remediate(name="x", check=lambda: Check(True, "fine"))

def test_skipped(target):
    pytest.skip("not on this host")
"""

EXPECTED = {
    "fine": "passed",
    "broken": "failed",
    "unprepared": "error",
    "messy": "error",
    "link[eth0]": "passed",
    "link[eth1]": "failed",
    "driver_version": "passed",
    "skipped": "skipped",
}


def test_every_output_names_and_judges_each_check_alike(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_rr=SUITE)
    prom = pytester.path / "gpuhost.prom"
    r = pytester.runpytest_subprocess(
        "--host=local://",
        "-n",
        "2",
        "--report-name=rr",
        f"--prometheus-textfile={prom}",
        "-p",
        "no:cacheprovider",
    )
    r.assert_outcomes(passed=4, failed=2, errors=2, skipped=1)
    reports = pytester.path / "reports"

    fleet = json.loads((reports / "fleet-summary.json").read_text())
    cells = fleet["hosts"]["local"]["checks"]
    assert {c: cell["outcome"] for c, cell in cells.items()} == EXPECTED
    assert fleet["checks"] == list(cells) and set(fleet["checks"]) == set(EXPECTED)
    assert cells["unprepared"]["summary"] == "OSError: no such device"
    assert cells["messy"]["summary"] == "teardown: OSError: could not put it back"

    data = json.loads((reports / "rr.json").read_text())
    assert {t["check"]: t["result"] for t in data["tests"]} == EXPECTED
    assert {t["target"] for t in data["tests"]} == {"local"}

    text = (reports / "rr.html").read_text()
    matrix = html.unescape(text[text.index('id="gpuhost-matrix"') :].split("</table>", 1)[0])
    names = re.findall(r"<th>([^<]*)</th>", matrix)
    assert names[0] == "target" and set(names[1:]) == set(EXPECTED) | {"local"}
    for check, result in EXPECTED.items():
        assert f"gh-{result.replace(' ', '-')}" in matrix, check

    junit = ET.parse(reports / "rr.xml").getroot()
    props = {
        (case.get("name"), p.get("name")): p.get("value")
        for case in junit.iter("testcase")
        for p in case.iter("property")
    }
    junit_checks = {v for (_, name), v in props.items() if name == "gpuhost_check"}
    assert junit_checks == set(EXPECTED)
    assert props[("test_link[local-eth1]", "gpuhost_outcome")] == "failed"

    samples = dict(
        re.findall(r'^gpuhost_check_ok\{host="local",check="([^"]+)"\} (\d)$', prom.read_text(), re.M)
    )
    assert samples == {
        c: ("1" if r in ("passed", "fixed") else "0") for c, r in EXPECTED.items() if r != "skipped"
    }


def _report(
    when: str, outcome: str, gpuhost_outcome: str | None = None, longrepr: object = None
) -> pytest.TestReport:
    rep = pytest.TestReport("t.py::test_x[h]", ("t.py", 1, "test_x"), {}, outcome, longrepr, when)  # type: ignore[arg-type]
    if gpuhost_outcome is not None:
        rep.gpuhost_outcome = gpuhost_outcome  # type: ignore[attr-defined]
    return rep


def test_phases_combine_into_one_result() -> None:
    setup_ok, teardown_ok = _report("setup", "passed"), _report("teardown", "passed")
    assert phase_result(setup_ok) is None and phase_result(teardown_ok) is None
    assert phase_result(_report("setup", "failed")) == "error"
    assert phase_result(_report("call", "failed", "would fix")) == "would fix"
    assert phase_result(_report("call", "passed", "fixed")) == "fixed"
    # a failed teardown spoils a pass, but never hides a failure
    assert combine("fixed", _report("teardown", "failed")) == "error"
    assert combine("would fix", _report("teardown", "failed")) == "would fix"
    assert combine(None, setup_ok) is None


def test_messages_are_one_redacted_line() -> None:
    rep = _report("call", "failed", longrepr="Traceback\n  line\nRuntimeError: password=hunter2x failed")
    assert one_line(rep) == "RuntimeError: password=*** failed"
    skip = _report("setup", "skipped", longrepr=("t.py", 1, "Skipped: not here"))
    assert one_line(skip) == "not here"


def test_check_name_is_shared_by_html_and_fleet() -> None:
    from pytest_gpuhost.report import html as html_report

    assert html_report.check_name is check_name
    assert check_name("suites/health/test_health.py::test_xid[gpu-1]", "gpu-1") == "xid"


def test_fleet_line_of_an_engine_failure_says_the_outcome_once(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from pytest_gpuhost.run.remediation import Action, Check

        def test_persistence(target, remediate):
            remediate(name="persistence", check=lambda: Check(False, "persistence mode off"),
                      plan=lambda b: [Action("enable", "nvidia-smi -pm 1")], fix=lambda a, b: None)
        """
    )
    result = pytester.runpytest("--host=local://", "--check-only", "--report-dir=none")
    result.stdout.fnmatch_lines(
        [
            "1 host x 1 check = 1 result: 1 would fix; hosts: 0 ok, 1 failed",
            "  local persistence: would fix: persistence: persistence mode off",
        ]
    )
    result = pytester.runpytest("--host=local://", "--report-dir=none")
    result.stdout.fnmatch_lines(["  local persistence: failed: persistence: fix did not verify"])

"""The `cannot see` outcome: neither passed nor failed, counted apart in every output (pytester)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from pytest_gpuhost.report.prometheus import prometheus_text
from pytest_gpuhost.report.summary import count_line, host_status, summary_lines
from tests.helpers.outcomes import outcome_counts

BLIND_TESTS = """
from pytest_gpuhost.run.remediation import Check

WHY = "cannot read the kernel log: denied (EPERM); run the check on the host, or give it CAP_SYSLOG"

def test_xid(remediate):
    remediate(name="xid", check=lambda: Check(True, WHY, cannot_see=WHY))

def test_sxid(remediate):
    remediate(name="sxid", check=lambda: Check(True, WHY, cannot_see=WHY))

def test_disk(remediate):
    remediate(name="disk", check=lambda: Check(True, "80% free"))
"""


def test_cannot_see_is_counted_apart_and_leaves_the_exit_status(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_blind=BLIND_TESTS)
    result = pytester.runpytest("-v", "--report-dir=none", "--junitxml=out.xml")
    result.stdout.fnmatch_lines(["*test_xid CANNOT SEE*", "*test_disk PASSED*"])
    assert outcome_counts(result.outlines) == {"passed": 1, "cannot see": 2}
    assert result.ret == 0
    # said once for both checks, with what would let them see
    result.stdout.fnmatch_lines(
        [
            "*= cannot see (neither passed nor failed) =*",
            "xid, sxid: cannot read the kernel log: denied (EPERM)*",
        ]
    )
    root = ET.parse(pytester.path / "out.xml").getroot()
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["gpuhost_cannot_see"] == "2"
    cases = {c.get("name"): c for c in root.iter("testcase")}
    outcome = {
        p.get("value") for p in cases["test_xid"].iter("property") if p.get("name") == "gpuhost_outcome"
    }
    assert outcome == {"cannot see"}
    assert cases["test_xid"].find("skipped") is not None and cases["test_xid"].find("failure") is None


def test_cannot_see_fail_makes_ci_fail(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_blind=BLIND_TESTS)
    pytester.makeini("[pytest]\ngpuhost_cannot_see = fail\n")
    result = pytester.runpytest("-v", "--report-dir=none")
    assert outcome_counts(result.outlines) == {"passed": 1, "cannot see": 2}
    assert result.ret == 1
    result = pytester.runpytest("-v", "--report-dir=none", "--cannot-see=report")
    assert result.ret == 0


def test_a_bad_cannot_see_value_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_blind=BLIND_TESTS)
    result = pytester.runpytest("--cannot-see=ignore")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--cannot-see*ignore*"])


def _fleet() -> dict[str, object]:
    why = "cannot read the kernel log: denied (EPERM); run the check on the host"
    blind = {"outcome": "cannot see", "summary": why}
    return {
        "checks": ["xid", "sxid", "pcie_link"],
        "hosts": {
            "node-a": {
                "status": "ok",
                "checks": {"xid": blind, "sxid": blind, "pcie_link": {"outcome": "passed", "summary": "ok"}},
            },
            "node-b": {
                "status": "ok",
                "checks": {"xid": blind, "sxid": blind, "pcie_link": {"outcome": "failed", "summary": "x8"}},
            },
        },
    }


def test_fleet_summary_and_prometheus_count_cannot_see_apart() -> None:
    fleet = _fleet()
    assert "4 cannot see" in count_line(fleet)
    lines = summary_lines(fleet)
    # one line for the reason, its checks and its hosts: not one per host and check
    blind = [line for line in lines if "cannot see on" in line]
    assert blind == [
        "xid, sxid cannot see on node-a, node-b: cannot read the kernel log: denied (EPERM); run the check on the host"
    ]
    text = prometheus_text(fleet)
    assert 'gpuhost_check_cannot_see{host="node-a",check="xid"} 1' in text
    assert 'gpuhost_host_cannot_see{host="node-a"} 2' in text
    # a blind check is neither 1 nor 0 in gpuhost_check_ok
    assert 'gpuhost_check_ok{host="node-a",check="xid"}' not in text
    assert 'gpuhost_check_ok{host="node-b",check="pcie_link"} 0' in text


def test_host_status_counts_cannot_see_only_when_asked() -> None:
    cells = {"xid": {"outcome": "cannot see"}, "disk": {"outcome": "passed"}}
    assert host_status(cells) == "ok"
    assert host_status(cells, cannot_see_fails=True) == "failed"


def test_an_error_shared_by_a_hosts_checks_is_said_once() -> None:
    """An unreachable host fails every check with the same line: the summary says it once."""
    down = {"outcome": "error", "summary": "ConnectError: ssh: connect to host 10.0.0.9 port 22: timed out"}
    fleet = {
        "checks": ["gpu_count", "xid", "pcie_link", "ecc"],
        "hosts": {
            "gpu-09": {
                "status": "error",
                "checks": {c: down for c in ("gpu_count", "xid", "pcie_link", "ecc")},
            }
        },
    }
    lines = [line for line in summary_lines(fleet) if "gpu-09" in line]
    assert lines == [
        "  gpu-09 gpu_count, xid, pcie_link and 1 more (4 checks): error: "
        "ConnectError: ssh: connect to host 10.0.0.9 port 22: timed out"
    ]

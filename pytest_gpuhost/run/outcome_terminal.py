"""How the remediation outcomes read in pytest's terminal: their letters and words, and sections.

`fixed`, `would fix` and `cannot see` get a category of their own in pytest's counts line and in
`-v` (`FIXED`, `WOULD FIX`, `CANNOT SEE`); at the end of the run a section per category lists the
tests (at most `SUMMARY_LIMIT` each) with what was or would be done, and what could not be seen
is said once per target. The outcomes themselves are run/remediation.py's.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run.record import CANNOT_SEE, FIXED, WOULD_FIX

__all__ = ["SUMMARY_LIMIT", "cannot_see_lines", "report_teststatus", "terminal_summary"]

SUMMARY_LIMIT = 40  # tests listed per terminal section; a fleet run has thousands


def report_teststatus(report: pytest.TestReport) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    """Give fixed and would-fix their own terminal categories, letters and words."""
    if report.when != "call":
        return None
    outcome = getattr(report, "gpuhost_outcome", None)
    if outcome == FIXED and report.passed:
        return FIXED, "+", ("FIXED", {"green": True, "bold": True})
    if outcome == WOULD_FIX and report.failed:
        return WOULD_FIX, "W", ("WOULD FIX", {"yellow": True, "bold": True})
    if outcome == CANNOT_SEE:
        return CANNOT_SEE, "?", ("CANNOT SEE", {"yellow": True})
    return None


def cannot_see_lines(reports: list[Any]) -> list[str]:
    """Return one line per target and what its checks could not see (the same reason said once).

    A node that denies the kernel log makes two checks blind for one reason; a fleet of such
    nodes says it once per host, never once per test.
    """
    by_target: dict[str, dict[str, list[str]]] = {}
    for rep in reports:
        target = str(getattr(rep, "gpuhost_target", "") or "")
        for rem in getattr(rep, "gpuhost_remediations", []):
            if rem.get("outcome") == CANNOT_SEE:
                by_target.setdefault(target, {}).setdefault(str(rem.get("reason", "")), []).append(
                    str(rem.get("name"))
                )
    lines = []
    for target, reasons in by_target.items():
        for reason, names in reasons.items():
            where = f"{target}: " if target else ""
            lines.append(f"{where}{', '.join(names)}: {reason}")
    return lines


def terminal_summary(terminalreporter: Any) -> None:
    """Print what was fixed and what would be fixed, with the actions, after the test run."""

    def line(text: str) -> None:
        terminalreporter.write_line(printable(redact(text)))

    # a run against targets says these in its fleet summary, once per reason and its hosts
    blind = [r for r in terminalreporter.stats.get(CANNOT_SEE, []) if not getattr(r, "gpuhost_target", "")]
    if blind:
        terminalreporter.write_sep("=", "cannot see (neither passed nor failed)", yellow=True)
        shown = cannot_see_lines(blind)
        for text in shown[:SUMMARY_LIMIT]:
            line(text)
        if len(shown) > SUMMARY_LIMIT:
            line(f"... and {len(shown) - SUMMARY_LIMIT} more: see the HTML and JSON reports")
    for category, title in ((WOULD_FIX, "would fix (check-only)"), (FIXED, "fixed")):
        reports = terminalreporter.stats.get(category, [])
        if not reports:
            continue
        terminalreporter.write_sep("=", title, yellow=category == WOULD_FIX, green=category == FIXED)
        for rep in reports[:SUMMARY_LIMIT]:
            line(rep.nodeid)
            for rem in getattr(rep, "gpuhost_remediations", []):
                if rem["outcome"] != category:
                    continue
                line(f"  {rem['name']}: {rem['before'].get('summary', '')}")
                for action in rem["actions"]:
                    where = f"[{action['target']}] " if action.get("target") else ""
                    line(f"    - {where}{action['description']}: {action['command']}")
        if len(reports) > SUMMARY_LIMIT:
            line(f"... and {len(reports) - SUMMARY_LIMIT} more: see the HTML and JSON reports")

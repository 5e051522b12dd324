"""The answer first: each target's verdict in words, on the terminal's last lines and atop the report.

A suite says its answer for a target with `evidence.current().answer(...)` ("SAFE TO TERMINATE:
2,010 files ...", "P2P RESTORED on 4 GPUs: ..."). A target whose suite said none (a health
check, a plain test file) gets one made from its results: "OK: 27 checks passed" or "NEEDS
ATTENTION: 2 checks: xid (...), ecc (...)". With more than one target the first line says how
many need a person ("3 of 200 nodes need you"), and those come first.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run.record import BAD, CANNOT_SEE, FIXED, PASSED, SKIPPED, RunRecord

__all__ = [
    "ANSWER_CSS",
    "answers",
    "banner_html",
    "fleet_line",
    "terminal_lines",
    "terminal_summary",
    "title",
]

#: Problems shown under a target on the terminal and in the banner (the report has them all).
SHOWN = 10

ANSWER_CSS = """
.gh-answer{font-family:sans-serif;border-radius:6px;padding:10px 14px;margin:8px 0;color:#fff}
.gh-answer-ok{background:#2e7d32}.gh-answer-bad{background:#c62828}
.gh-answer h2{margin:0;font-size:20px;color:#fff}.gh-answer ul{margin:6px 0 0 18px;padding:0}
.gh-answer li{margin:2px 0}
.gh-answer-table{border-collapse:collapse;margin-top:6px;background:#fff;color:#222}
.gh-answer-table td,.gh-answer-table th{border:1px solid #ccc;padding:2px 8px;text-align:left}.gh-fleet-line{font:bold 18px sans-serif;margin:8px 0}
"""


def _generic(target: str, records: list[Any]) -> dict[str, Any]:
    """The answer for a target whose suite gave none, from its tests' results."""
    bad = [t for t in records if t.result in BAD]
    if bad and all(t.unreachable for t in bad):  # one cause, said once
        return {
            "target": target,
            "ok": False,
            "headline": f"UNREACHABLE: {bad[0].unreachable}; {len(bad)} of {len(records)} checks not run",
            "details": [],
        }
    if bad:
        details = [
            f"{t.check}: {t.result}: {t.summary}" if t.summary else f"{t.check}: {t.result}" for t in bad
        ]
        return {
            "target": target,
            "ok": False,
            "headline": f"NEEDS ATTENTION: {len(bad)} of {len(records)} checks",
            "details": details,
        }
    fixed = sum(1 for t in records if t.result == FIXED)
    passed = sum(1 for t in records if t.result == PASSED)
    skipped = sum(1 for t in records if t.result == SKIPPED)
    blind = [t for t in records if t.result == CANNOT_SEE]
    parts = [f"{passed + fixed} checks passed"]
    if fixed:
        parts.append(f"{fixed} of them fixed by this run")
    if blind:
        parts.append(f"{len(blind)} could not see")
    if skipped:
        parts.append(f"{skipped} not applicable")
    details = [f"{t.check}: cannot see: {t.summary}" for t in blind]
    return {"target": target, "ok": True, "headline": "OK: " + ", ".join(parts), "details": details}


def answers(run_record: RunRecord) -> list[dict[str, Any]]:
    """Every target's answer, those that need a person first (then in the order targets reported)."""
    said = run_record.answers()
    by_target: dict[str, list[Any]] = {}
    for t in run_record.decided():
        by_target.setdefault(t.target, []).append(t)
    out = []
    for target, records in by_target.items():
        if not target:
            continue  # tests without a target (the plugin's own) have no node to answer for
        a = said.get(target)
        if a is not None:
            # a suite's good answer never hides a test of that target that failed or broke
            bad = [t for t in records if t.result in BAD]
            if bad and a.get("ok"):
                a = dict(a, ok=False, headline="NEEDS ATTENTION: " + str(a["headline"]))
                a["details"] = [*(f"{t.check}: {t.result}: {t.summary}" for t in bad), *a.get("details", [])]
            out.append(a)
        else:
            out.append(_generic(target, records))
    return sorted(out, key=lambda a: bool(a.get("ok")))


def fleet_line(found: Sequence[Mapping[str, Any]]) -> str:
    """'3 of 200 nodes need you' (or 'none of 200 nodes needs you'); '' for a single target."""
    if len(found) < 2:
        return ""
    bad = sum(1 for a in found if not a.get("ok"))
    if not bad:
        return f"none of {len(found)} nodes needs you"
    return f"{bad} of {len(found)} nodes need{'s' if bad == 1 else ''} you"


def _clean(text: Any) -> str:
    return printable(redact(str(text))).replace("\n", "\\n")


def terminal_lines(found: Sequence[Mapping[str, Any]]) -> list[str]:
    """The terminal's closing lines: the fleet line, then each target's answer and its problems."""
    lines = []
    head = fleet_line(found)
    if head:
        lines.append(head)
    for a in found:
        lines.append(f"{_clean(a.get('target'))}: {_clean(a.get('headline'))}")
        details = list(a.get("details") or [])
        lines += [f"  - {_clean(d)}" for d in details[:SHOWN]]
        if len(details) > SHOWN:
            lines.append(f"  - ... and {len(details) - SHOWN} more (see the report)")
    return lines


def banner_html(found: Sequence[Mapping[str, Any]]) -> str:
    """One banner per target, green or red, the verdict as a heading; the fleet line above them."""
    out = ['<div id="gpuhost-answer">']
    head = fleet_line(found)
    if head:
        out.append(f'<p class="gh-fleet-line" id="gpuhost-fleet-line">{html.escape(redact(head))}</p>')
    for a in found:
        cls = "gh-answer-ok" if a.get("ok") else "gh-answer-bad"
        target = html.escape(redact(str(a.get("target"))))
        out.append(
            f'<div class="gh-answer {cls}" data-target="{target}" data-ok="{str(bool(a.get("ok"))).lower()}">'
            f"<h2>{target}: {html.escape(redact(str(a.get('headline'))))}</h2>"
        )
        details = list(a.get("details") or [])
        if details:
            out.append("<ul>" + "".join(f"<li>{html.escape(redact(str(d)))}</li>" for d in details[:SHOWN]))
            if len(details) > SHOWN:
                out.append(f"<li>... and {len(details) - SHOWN} more: see the rows below</li>")
            out.append("</ul>")
        table = list(a.get("table") or [])
        if len(table) > 1:
            head, *rows = table
            out.append('<table class="gh-answer-table"><tr>')
            out += [f"<th>{html.escape(redact(str(c)))}</th>" for c in head]
            out.append("</tr>")
            for row in rows:
                out.append("<tr>" + "".join(f"<td>{html.escape(redact(str(c)))}</td>" for c in row) + "</tr>")
            out.append("</table>")
        out.append("</div>")
    out.append("</div>")
    return "".join(out)


def title(kind: str, names: Sequence[str]) -> str:
    """The report's title: the suite and the node (or how many nodes), never the run's file name."""
    if not names:
        return f"gpuhost: {kind}"
    who = names[0] if len(names) == 1 else f"{len(names)} nodes"
    return _clean(f"gpuhost {kind}: {who}")


def terminal_summary(terminalreporter: Any) -> None:
    """Write the answers as the run's last section (controller only; nothing without targets)."""
    config = terminalreporter.config
    if hasattr(config, "workerinput"):
        return
    from pytest_gpuhost.run.record import record_key

    run_record = config.stash.get(record_key, None)
    if run_record is None:
        return
    found = answers(run_record)
    if not found:
        return
    bad = any(not a.get("ok") for a in found)
    terminalreporter.write_sep("=", "gpuhost: the answer", red=bad, green=not bad, bold=True)
    for line in terminal_lines(found):
        terminalreporter.write_line(
            line, red=bad and not line.startswith("  "), bold=not line.startswith("  ")
        )

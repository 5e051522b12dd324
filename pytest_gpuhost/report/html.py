"""The HTML report: output paths, outcome and target columns, targets x checks matrix, evidence, heatmaps.

Built on pytest-html 4 (hooks `pytest_html_results_table_header/row`, `pytest_html_results_summary`;
evidence travels as `report.extras` HTML). Everything is inline HTML and CSS, so the
self-contained report opens anywhere without network access.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.redact import redact
from pytest_gpuhost.report import answer
from pytest_gpuhost.report.diff import render_diff, state_diff
from pytest_gpuhost.report.outputs import configure_outputs
from pytest_gpuhost.run.evidence import connections
from pytest_gpuhost.run.record import FIXED, WOULD_FIX, check_name, phase_result, record_key
from pytest_gpuhost.run.targets_stash import targets_key

__all__ = [
    "HtmlCustomisation",
    "add_extras",
    "check_name",
    "configure_outputs",
    "heatmap",
    "render_evidence",
]

OUTCOME_CSS = """
.gh-outcome{display:inline-block;padding:1px 6px;border-radius:3px;font-weight:bold;color:#fff}
.gh-passed{background:#2e7d32}.gh-fixed{background:#1565c0}.gh-would-fix{background:#ef6c00}
.gh-failed{background:#c62828}.gh-skipped{background:#757575}.gh-error{background:#6a1b9a}
.gh-ev{font-family:sans-serif;font-size:13px;margin:6px 0}
.gh-ev h4{margin:8px 0 4px}
.gh-ev table{border-collapse:collapse;margin:4px 0}
.gh-ev td,.gh-ev th{border:1px solid #ccc;padding:2px 6px;vertical-align:top;text-align:left}
.gh-ev pre{margin:0;white-space:pre-wrap;max-height:24em;overflow:auto;font-size:12px}
.gh-rc-bad{color:#c62828;font-weight:bold}
.gh-heat td{text-align:right;font-family:monospace;min-width:4.5em;color:#000}
.gh-ev td,.gh-matrix td{color:#222}
.gh-heat .gh-below{outline:2px solid #c62828;outline-offset:-2px}
.gh-heat-pair{display:flex;gap:24px;flex-wrap:wrap}
.gh-matrix td,.gh-matrix th{border:1px solid #ccc;padding:2px 6px}
.gh-fleet{white-space:pre-wrap;overflow-wrap:anywhere}
.gh-changed{font-size:12px;margin-top:3px;white-space:normal}
.gh-diff .gh-add{background:#e6ffec}.gh-diff .gh-del{background:#ffebe9}.gh-diff .gh-hunk{color:#6a737d}
"""


def _css_class(outcome: str) -> str:
    return "gh-" + outcome.replace(" ", "-")


def outcome_badge(outcome: str) -> str:
    """Return the styled HTML label of a gpuhost outcome."""
    return f'<span class="gh-outcome {_css_class(outcome)}">{html.escape(outcome)}</span>'


# --- evidence as HTML -----------------------------------------------------------------------


def _pre(text: Any) -> str:
    return f"<pre>{html.escape(str(text))}</pre>" if text not in (None, "") else ""


def _json_pre(value: Any) -> str:
    if isinstance(value, str):
        return _pre(value)
    return _pre(json.dumps(value, indent=1, default=str))


def _frac(value: float, low: float, high: float) -> float:
    return 0.5 if high <= low else max(0.0, min(1.0, (value - low) / (high - low)))


def _heat_colour(value: float, low: float, high: float, threshold: float | None = None) -> str:
    """Colour a cell, light enough for black text.

    With a threshold the colour says which side of it a value is on: below is red to orange,
    at or above is yellow-green to green (never red, however it compares with the rest).
    Without one: red for the lowest value through yellow to green for the highest.
    """
    if threshold is None:
        hue = int(120 * _frac(value, low, high))
    elif value < threshold:
        hue = int(30 * _frac(value, low, threshold))
    else:
        hue = 75 + int(45 * _frac(value, threshold, high))
    return f"hsl({hue},70%,75%)"


def heatmap(matrix: dict[str, Any], scale: tuple[float, float] | None = None) -> str:
    """Render one matrix of measurements as an HTML table coloured by value (red low, green high)."""
    labels = matrix.get("labels", [])
    values = matrix.get("values", [])
    flat = [v for row in values for v in row if isinstance(v, int | float) and math.isfinite(v)]
    low, high = scale if scale is not None else ((min(flat), max(flat)) if flat else (0.0, 0.0))
    threshold = matrix.get("threshold")
    unit = matrix.get("unit") or ""
    title = html.escape(str(matrix.get("name", "")))
    target = matrix.get("target")
    caption = f"{title} ({html.escape(unit)})" + (f" on {html.escape(str(target))}" if target else "")
    if threshold is not None:
        caption += f", threshold {threshold:g}"
    out = [f'<table class="gh-heat"><caption>{caption}</caption><tr><th></th>']
    out += [f"<th>{html.escape(str(label))}</th>" for label in labels]
    out.append("</tr>")
    for i, row in enumerate(values):
        out.append(f"<tr><th>{html.escape(str(labels[i]) if i < len(labels) else str(i))}</th>")
        for value in row:
            if not isinstance(value, int | float) or not math.isfinite(value):
                out.append('<td style="background:#eee">N/A</td>')
                continue
            below = threshold is not None and value < threshold
            cls = ' class="gh-below"' if below else ""
            colour = _heat_colour(value, low, high, threshold if isinstance(threshold, int | float) else None)
            out.append(f'<td{cls} style="background:{colour}">{value:.2f}</td>')
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def _heatmaps(matrices: list[dict[str, Any]]) -> str:
    """Render matrices; ones sharing a name and target (before/after) side by side on one scale."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for m in matrices:
        key = (
            str(m.get("name", "")).removesuffix(" before").removesuffix(" after"),
            str(m.get("target", "")),
        )
        groups.setdefault(key, []).append(m)
    out = []
    for group in groups.values():
        flat = [
            v
            for m in group
            for row in m.get("values", [])
            for v in row
            if isinstance(v, int | float) and math.isfinite(v)
        ]
        scale = (min(flat), max(flat)) if flat else None
        out.append('<div class="gh-heat-pair">' + "".join(heatmap(m, scale) for m in group) + "</div>")
    return "".join(out)


def _state_diffs(states: list[dict[str, Any]]) -> str:
    """Show what changed between each target's `before` and `after` state as a unified diff."""
    by_target: dict[str, dict[str, Any]] = {}
    for s in states:
        if s.get("label") in ("before", "after"):
            by_target.setdefault(str(s.get("target", "")), {})[s["label"]] = s.get("value")
    out = []
    for target, pair in by_target.items():
        if "before" in pair and "after" in pair:
            lines = state_diff(pair["before"], pair["after"])
            if lines:
                where = f" on {html.escape(target)}" if target else ""
                out.append(f"<h4>changed{where}</h4>" + render_diff(lines))
    return "".join(out)


def connection_line(c: dict[str, Any]) -> str:
    """Say in one escaped line how a target was reached: "gpu-07 (host): OpenSSH_9.2p1 ..., agent"."""
    client = str(c.get("version") or c.get("client") or "?")
    mode = f", {c['mode']}" if c.get("mode") else ""
    via = f" ({c['via']})" if c.get("via") else ""
    node = [f"{k} {c['node_' + k]}" for k in ("python", "kernel") if c.get("node_" + k)]
    if node and c.get("node_executable"):
        node[0] += f" ({c['node_executable']})"
    if c.get("node_version"):
        node.append(f"agent {c['node_version']}")
    if c.get("no_python"):
        node.append(str(c["no_python"]))  # the fallback's reason, one line
    there = f"; on the node: {', '.join(node)}" if node else ""
    return html.escape(redact(f"{c.get('target', '')} ({c.get('to', 'host')}): {client}{mode}{via}{there}"))


def render_evidence(when: str, ev: dict[str, Any], remediations: list[dict[str, Any]] | None = None) -> str:
    """Render one phase's evidence (and the test's remediations) as an HTML fragment."""
    out = [
        f'<div class="gh-ev" data-phase="{html.escape(when)}"><h4>gpuhost evidence ({html.escape(when)})</h4>'
    ]
    for c in ev.get("connections") or []:
        out.append(f'<p class="gh-conn">connected: {connection_line(c)}</p>')
    for rem in remediations or []:
        out.append(
            f"<p>{outcome_badge(rem['outcome'])} <b>{html.escape(rem['name'])}</b>"
            f"{' on ' + html.escape(rem['target']) if rem.get('target') else ''}: "
            f"{html.escape(rem.get('reason') or (rem.get('before') or {}).get('summary', ''))}</p>"
        )
    if ev.get("actions"):
        out.append("<table><tr><th>action</th><th>command</th><th>target</th><th>status</th></tr>")
        for a in ev["actions"]:
            out.append(
                f"<tr><td>{html.escape(str(a.get('description', '')))}</td><td>{_pre(a.get('command', ''))}</td>"
                f"<td>{html.escape(str(a.get('target', '')))}</td><td>{html.escape(str(a.get('status', '')))}</td></tr>"
            )
        out.append("</table>")
    if ev.get("states"):
        by_label: dict[str, list[dict[str, Any]]] = {}
        for s in ev["states"]:
            by_label.setdefault(s["label"], []).append(s)
        out.append(
            "<table><tr>" + "".join(f"<th>{html.escape(label)}</th>" for label in by_label) + "</tr><tr>"
        )
        for states in by_label.values():
            out.append("<td>" + "".join(_json_pre(s["value"]) for s in states) + "</td>")
        out.append("</tr></table>")
        out.append(_state_diffs(ev["states"]))
    if ev.get("commands"):
        out.append(
            "<table><tr><th>target</th><th>command</th><th>rc</th><th>duration</th><th>stdout</th><th>stderr</th></tr>"
        )
        for c in ev["commands"]:
            rc = c.get("rc")
            bad = rc != 0 or c.get("timed_out")
            rc_text = html.escape(str(rc)) + (" (timed out)" if c.get("timed_out") else "")
            rc_cls = ' class="gh-rc-bad"' if bad else ""
            duration = c.get("duration")
            dur_text = f"{duration * 1000:.1f} ms" if isinstance(duration, int | float) else ""
            out.append(
                f"<tr><td>{html.escape(str(c.get('target', '')))}</td><td>{_pre(c.get('command', ''))}</td>"
                f"<td{rc_cls}>{rc_text}</td><td>{dur_text}</td>"
                f"<td>{_pre(c.get('stdout', ''))}</td><td>{_pre(c.get('stderr', ''))}</td></tr>"
            )
        out.append("</table>")
    if ev.get("measures"):
        out.append("<table><tr><th>measurement</th><th>value</th><th>target</th></tr>")
        for m in ev["measures"]:
            unit = f" {m['unit']}" if m.get("unit") else ""
            out.append(
                f"<tr><td>{html.escape(str(m['name']))}</td><td>{html.escape(str(m['value']) + unit)}</td>"
                f"<td>{html.escape(str(m.get('target', '')))}</td></tr>"
            )
        out.append("</table>")
    if ev.get("matrices"):
        out.append(_heatmaps(ev["matrices"]))
    if ev.get("notes"):
        out.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in ev["notes"]) + "</ul>")
    out.append("</div>")
    return "".join(out)


def add_extras(report: pytest.TestReport) -> None:
    """Append the phase's evidence to `report.extras` as HTML (pytest-html shows all phases' extras)."""
    ev = getattr(report, "gpuhost_evidence", None) or {}
    remediations = getattr(report, "gpuhost_remediations", None) or []
    if not ev and not remediations:
        return
    extra = {
        "name": f"gpuhost evidence ({report.when})",
        "format_type": "html",
        "content": render_evidence(report.when, ev, remediations),
        "mime_type": None,
        "extension": None,
    }
    report.extras = [*getattr(report, "extras", []), extra]  # type: ignore[attr-defined]


# --- pytest-html hooks (controller only) ----------------------------------------------------


def _what_changed(report: pytest.TestReport) -> str:
    """Say what a fix did, in the row itself: pytest-html collapses passed rows, fixed ones included."""
    lines = []
    for rem in getattr(report, "gpuhost_remediations", None) or []:
        after = rem.get("after") or {}
        if rem.get("outcome") == FIXED and after:
            before = (rem.get("before") or {}).get("summary", "")
            lines.append(f"{rem.get('name')}: {before} \u2192 {after.get('summary', '')}")
    ev = getattr(report, "gpuhost_evidence", None) or {}
    for action in ev.get("actions") or []:
        if action.get("status") in ("done", "ran, not verified", "failed"):
            lines.append(f"{action['status']}: {action.get('description', '')}: {action.get('command', '')}")
    if not lines:
        return ""
    return '<div class="gh-changed">' + "<br>".join(html.escape(redact(line)) for line in lines) + "</div>"


def _suite_of(config: Any) -> str:
    """The suite a run runs ("p2p", "decommission", "health"), from its arguments; else "run"."""
    for arg in getattr(config.invocation_params, "args", ()):
        name = str(arg).split("::", 1)[0].rstrip("/").rsplit("/", 1)[-1].rsplit(".", 1)[-1]
        if name in ("p2p", "decommission", "health", "accept"):
            return name
    return "run"


def _changed_html(run_record: Any) -> str:
    """What the run changed (each fix, before -> after) and what it measured before and after.

    Shown under the answer, before the rows: the P2P heatmaps of every target side by side, on one
    scale, and one line per fix; the rows below keep the full evidence.
    """
    fixes: list[str] = []
    matrices: list[dict[str, Any]] = []
    for t in run_record.decided():
        for rem in t.remediations:
            if rem.get("outcome") == FIXED:
                before = (rem.get("before") or {}).get("summary", "")
                after = (rem.get("after") or {}).get("summary", "")
                fixes.append(f"{t.target}: {rem.get('name')}: {before} \u2192 {after}")
        for phase in ("setup", "call", "teardown"):
            matrices += (t.evidence.get(phase) or {}).get("matrices") or []
    out = ['<div id="gpuhost-changed">']
    if fixes:
        out.append("<h3>What this run changed</h3><ul>")
        out += [f"<li>{html.escape(redact(line))}</li>" for line in fixes[:100]]
        if len(fixes) > 100:
            out.append(f"<li>... and {len(fixes) - 100} more: see the rows below</li>")
        out.append("</ul>")
    if matrices:
        out.append(f'<h3>Measured</h3><div class="gh-ev">{_heatmaps(matrices[:32])}</div>')
    out.append("</div>")
    return "".join(out) if len(out) > 2 else ""


class HtmlCustomisation:
    """pytest-html hooks: Outcome and Target columns, the targets x checks matrix, the CSS.

    The matrix and the counts come from the run record, so its names and results are the
    fleet summary's.
    """

    def __init__(self, config: pytest.Config | None = None) -> None:
        self.report_data: Any = None
        self.config = config

    @pytest.hookimpl(optionalhook=True)
    def pytest_html_report_title(self, report: Any) -> None:
        self.report_data = report  # pytest-html's ReportData: its outcome labels are relabelled below
        # the suite and the node, not the run's file name: "gpuhost decommission: b200-node07"
        # (asked at the session's start: the targets are known, their answers not yet)
        names = [str(t.name) for t in self.config.stash.get(targets_key, [])] if self.config else []
        report.title = (
            answer.title(_suite_of(self.config), names) if names else f"gpuhost: {Path(report.title).stem}"
        )

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Put the nodes in the report's environment box: their Python, kernel and the agent's version.

        pytest-html shows pytest-metadata's dict, read by reference when the page is written: the
        controller's Python and platform are renamed to say whose they are, and each node's own
        facts (from its agent's hello) join them.
        """
        try:
            from pytest_metadata.plugin import metadata_key
        except ImportError:  # pytest-html without pytest-metadata: no environment box to fill
            return
        meta = session.config.stash.get(metadata_key, None)
        if not isinstance(meta, dict):
            return
        for key in ("Python", "Platform"):
            if key in meta:
                meta[f"Controller {key.lower()}"] = meta.pop(key)
        for c in connections():
            facts = [f"{k} {c['node_' + k]}" for k in ("python", "kernel") if c.get("node_" + k)]
            if c.get("node_version"):
                facts.append(f"agent {c['node_version']}")
            if facts:
                where = "" if c.get("to", "host") == "host" else f" ({c.get('to')})"
                meta[redact(f"Node {c.get('target', '')}{where}")] = redact(", ".join(facts))

    @pytest.hookimpl(optionalhook=True)
    def pytest_html_results_table_header(self, cells: list[str]) -> None:
        cells.insert(1, '<th class="sortable" data-column-type="gpuhostOutcome">Outcome</th>')
        cells.insert(3, '<th class="sortable" data-column-type="gpuhostTarget">Target</th>')

    @pytest.hookimpl(optionalhook=True)
    def pytest_html_results_table_row(self, report: pytest.TestReport, cells: list[str]) -> None:
        # pytest-html writes the test id into the row raw and its page inserts the row as HTML:
        # a node id holding markup (a target or parameter named `<img onerror=...>`) would run.
        test_id = report.nodeid if report.when == "call" else f"{report.nodeid}::{report.when}"
        for i, cell in enumerate(cells):
            if cell.startswith('<td class="col-testId">'):
                cells[i] = f'<td class="col-testId">{html.escape(redact(test_id))}</td>'
        outcome = phase_result(report) or report.outcome
        target = getattr(report, "gpuhost_target", "") or ""
        changed = _what_changed(report) if report.when == "call" else ""
        cells.insert(1, f'<td class="col-gpuhostOutcome">{outcome_badge(outcome)}{changed}</td>')
        cells.insert(3, f'<td class="col-gpuhostTarget">{html.escape(redact(target))}</td>')

    @pytest.hookimpl(optionalhook=True)
    def pytest_html_results_table_html(self, report: pytest.TestReport, data: list[str]) -> None:
        """Say why a step was skipped in a sentence, not as pytest's (path, line, reason) tuple.

        The tuple names a file of the plugin (under site-packages when installed) and a line in
        it, which tell a reviewer nothing; the reason does.
        """
        if not (report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3):
            return
        reason = " ".join(str(report.longrepr[2]).removeprefix("Skipped: ").split())
        if reason.startswith("blocked: step ") and reason.endswith(" failed"):
            step = reason.removeprefix("blocked: step ").removesuffix(" failed")
            step = step.split("[", 1)[0].removeprefix("test_").replace("_", " ")  # the step's own name
            sentence = (
                f"Not run: the step before it, {step}, failed, and a procedure stops at its first failure."
            )
        else:
            sentence = f"Not applicable here: {reason}."
        text = f'<div class="gh-skip">{html.escape(redact(sentence))}</div>'
        if data and report.longreprtext:
            data[0] = text  # pytest-html's first entry is the report's long text: the tuple
        else:
            data.insert(0, text)

    @pytest.hookimpl(optionalhook=True)
    def pytest_html_results_summary(
        self, prefix: list[str], summary: list[str], postfix: list[str], session: Any
    ) -> None:
        prefix.append(f"<style>{OUTCOME_CSS}{answer.ANSWER_CSS}</style>")
        run_record = session.config.stash.get(record_key, None)
        if run_record is not None:
            found = answer.answers(run_record)
            if found:  # the answer first: a reviewer decides from the banner, the rows are the evidence
                prefix.append(answer.banner_html(found))
                prefix.append(_changed_html(run_record))
        conns = connections()
        if conns:  # how every target was reached: the SSH client and its version, agent or fallback
            prefix.append(
                '<p class="gh-conns" id="gpuhost-connections"><b>Connections</b><br>'
                + "<br>".join(connection_line(c) for c in conns)
                + "</p>"
            )
        run_record = session.config.stash.get(record_key, None)
        if run_record is None:
            return
        cells = {key: str(t.result) for key, t in run_record.cells().items()}
        counts: dict[str, int] = {}
        for outcome in cells.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        if not counts:
            return
        self._relabel(counts)
        prefix.append(
            '<p class="gh-counts">'
            + " ".join(f"{outcome_badge(k)} {v}" for k, v in sorted(counts.items()))
            + "</p>"
        )
        checks = run_record.checks()
        rows = ['<h3>Targets x checks</h3><table class="gh-matrix" id="gpuhost-matrix"><tr><th>target</th>']
        rows += [f"<th>{html.escape(redact(c))}</th>" for c in checks]
        rows.append("</tr>")
        for target in run_record.targets():
            rows.append(f"<tr><th>{html.escape(redact(target or '(no target)'))}</th>")
            for check in checks:
                cell = cells.get((target, check))
                rows.append(f"<td>{outcome_badge(cell) if cell else ''}</td>")
            rows.append("</tr>")
        rows.append("</table>")
        summary.append("".join(rows))

    def _relabel(self, counts: dict[str, int]) -> None:
        """Make pytest-html's filter counts say what our badges say: fixed and would-fix among them.

        pytest-html's categories are fixed (its page filters on them), so a fixed test stays in
        "Passed" and a would-fix in "Failed"; their labels say how many of those they are.
        """
        outcomes = getattr(self.report_data, "outcomes", None)
        if not isinstance(outcomes, dict):
            return
        for category, ours in (("passed", FIXED), ("failed", WOULD_FIX)):
            if counts.get(ours) and category in outcomes:
                outcomes[category]["label"] = f"{outcomes[category]['label']} ({counts[ours]} {ours})"

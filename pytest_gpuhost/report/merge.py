"""Merge per-node fleet summaries into one fleet report: `python -m pytest_gpuhost.merge`.

Each node of a Slurm allocation or Kubernetes job runs the health suite on itself
(`--host=local:// --fleet-json=s3://bucket/nightly/2026-11-30/`) and leaves one summary;
afterwards one command merges them:

    python -m pytest_gpuhost.merge s3://bucket/nightly/2026-11-30/ -o fleet.html
    python -m pytest_gpuhost.merge node1.json node2.json reports/ -o fleet.html --previous last.json

Sources are summary files, directories (every `*.json` in them) and `s3://bucket/prefix`
(every `*.json` object under it; endpoint from `--endpoint-url` or boto3's usual environment,
e.g. `AWS_ENDPOINT_URL`). A host present in several summaries keeps its newest run. Writes the
HTML matrix (`-o`), the merged summary JSON beside it (`--json`, default: the `-o` path with
`.json`), optionally a Prometheus textfile, and exits 1 when any host failed or could not be
checked, 2 on bad input, so a CI job can gate on it.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.exec.s3io import S3Store
from pytest_gpuhost.redact import printable, redact_obj
from pytest_gpuhost.report.files import load_summary
from pytest_gpuhost.report.prometheus import write_prometheus
from pytest_gpuhost.report.summary import BAD, FORMAT, compare, fleet_judgements, iter_cells, summary_lines

__all__ = ["MergeError", "load_sources", "main", "merge", "render_html"]


class MergeError(GpuhostError):
    """A merge source names nothing to merge (an empty directory or prefix, a missing file)."""


def load_sources(sources: Sequence[str], store: S3Store | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Load every summary the sources name; raise a GpuhostError naming an unreadable one."""
    store = store or S3Store()
    found: list[str] = []
    for src in sources:
        if src.startswith("s3://"):
            if src.endswith(".json"):
                found.append(src)
            else:
                urls = store.list(src, suffix=".json")
                if not urls:
                    raise MergeError(f"{src}: no .json objects under this prefix")
                found += urls
        elif Path(src).is_dir():
            files = sorted(str(p) for p in Path(src).glob("*.json"))
            if not files:
                raise MergeError(f"{src}: no .json files in this directory")
            found += files
        else:
            found.append(src)
    out = []
    for src in found:
        try:
            out.append((src, load_summary(src, store)))
        except OSError as exc:
            raise MergeError(f"{src}: {exc.strerror or exc}") from None
    return out


def merge(summaries: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Merge summaries: union of hosts (newest run wins per host), union of checks in order."""
    hosts: dict[str, Any] = {}
    when: dict[str, float] = {}
    checks: list[str] = []
    sources: list[dict[str, Any]] = []
    times: list[float] = []
    for src, s in summaries:
        run = s.get("run") or {}
        finished = float(run.get("finished") or 0)
        times.append(finished)
        sources.append(
            {"source": src, "node": run.get("node"), "finished": finished, "hosts": len(s.get("hosts") or {})}
        )
        for c in s.get("checks") or []:
            if c not in checks:
                checks.append(c)
        for host, h in (s.get("hosts") or {}).items():
            if host not in hosts or finished >= when[host]:
                hosts[host] = dict(h, source=src)
                when[host] = finished
    started = min(times, default=time.time())
    finished = max(times, default=time.time())
    return {
        "format": FORMAT,
        "run": {
            "started": started,
            "finished": finished,
            "duration": round(finished - started, 3),
            "merged_from": sources,
        },
        "checks": checks,
        "hosts": dict(sorted(hosts.items())),
        "fleet": fleet_judgements(hosts),
    }


_COLORS = {
    "passed": "#c8e6c9",
    "fixed": "#bbdefb",
    "would fix": "#ffe0b2",
    "failed": "#ffcdd2",
    "error": "#e57373",
    "skipped": "#eeeeee",
}


def render_html(summary: Mapping[str, Any], title: str = "GPU fleet health") -> str:
    """Render the merged summary as one self-contained HTML page: the host x check matrix."""
    e = html.escape
    checks = list(summary.get("checks") or [])
    hosts = summary.get("hosts") or {}
    run = summary.get("run") or {}
    counts: dict[str, int] = {}
    for h in hosts.values():
        counts[h.get("status", "?")] = counts.get(h.get("status", "?"), 0) + 1
    out = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{e(title)}</title><style>",
        "body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}",
        "td,th{border:1px solid #999;padding:2px 6px}th.c{writing-mode:vertical-rl;transform:rotate(180deg)}",
        "td.cell{text-align:center;cursor:help}td.host{font-weight:bold}",
        "</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f"<p>{len(hosts)} hosts x {len(checks)} checks; "
        + ", ".join(f"{n} {e(s)}" for s, n in sorted(counts.items()))
        + f"; runs finished {e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(float(run.get('finished') or 0))))}</p>",
        "<table id='matrix'><tr><th>host</th><th>status</th>"
        + "".join(f"<th class='c'>{e(c)}</th>" for c in checks)
        + "</tr>",
    ]
    for host, h in hosts.items():
        row = [f"<tr data-host='{e(host)}'><td class='host'>{e(host)}</td><td>{e(h.get('status', '?'))}</td>"]
        for c in checks:
            cell = (h.get("checks") or {}).get(c)
            if cell is None:
                row.append("<td></td>")
                continue
            outcome = str(cell.get("outcome"))
            tip = "\n".join([str(cell.get("summary") or "")] + [str(r) for r in cell.get("reasons") or []])
            mark = {
                "passed": "ok",
                "fixed": "fixed",
                "would fix": "fix",
                "failed": "FAIL",
                "error": "ERR",
                "skipped": "-",
            }.get(outcome, outcome)
            row.append(
                f"<td class='cell' data-check='{e(c)}' data-outcome='{e(outcome)}' "
                f"style='background:{_COLORS.get(outcome, '#fff')}' title='{e(tip)}'>{e(mark)}</td>"
            )
        out.append("".join(row) + "</tr>")
    out.append("</table>")
    fl = summary.get("fleet") or {}
    if fl:
        out.append("<h2>Fleet</h2><ul>")
        for check, j in fl.items():
            versions = "; ".join(f"{e(v)} on {len(n)} host(s)" for v, n in (j.get("versions") or {}).items())
            out.append(
                f"<li>{e(check)}: {'uniform' if j.get('uniform') else '<b>NOT uniform</b>'}: {versions}</li>"
            )
        out.append("</ul>")
    comp = summary.get("comparison")
    if comp and not comp.get("error"):
        out.append(f"<h2>Since {e(str(comp.get('previous')))}</h2><ul>")
        for c in comp.get("newly_failed") or []:
            out.append(
                f"<li>newly failed: {e(c['host'])} {e(c['check'])} (was {e(str(c['was']))}): {e(c['summary'])}</li>"
            )
        for c in comp.get("recovered") or []:
            out.append(f"<li>recovered: {e(c['host'])} {e(c['check'])} (was {e(str(c['was']))})</li>")
        out.append("</ul>")
    bad = [(hst, c, cell) for hst, c, cell in iter_cells(summary) if cell.get("outcome") in BAD]
    if bad:
        out.append("<h2>Why</h2><ul>")
        for hst, c, cell in bad:
            reasons = "".join(f"<li>{e(str(r))}</li>" for r in cell.get("reasons") or [])
            out.append(
                f"<li><b>{e(hst)}</b> {e(c)}: {e(str(cell.get('outcome')))}: {e(str(cell.get('summary') or ''))}"
                + (f"<ul>{reasons}</ul>" if reasons else "")
                + "</li>"
            )
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the merge command line; return the exit status."""
    ap = argparse.ArgumentParser(prog="python -m pytest_gpuhost.merge", description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help="summary files, directories, s3://bucket/prefix")
    ap.add_argument("-o", "--output", required=True, help="HTML report to write")
    ap.add_argument("--json", help="merged summary JSON to write (default: OUTPUT with .json)")
    ap.add_argument("--previous", help="an earlier merged summary: list newly failed and recovered")
    ap.add_argument("--prometheus-textfile", help="also write a Prometheus textfile for node_exporter")
    ap.add_argument("--endpoint-url", help="S3 endpoint (default: boto3's configuration)")
    args = ap.parse_args(argv)
    store = S3Store(args.endpoint_url)
    try:
        summaries = load_sources(args.sources, store)
        merged = redact_obj(merge(summaries))  # summaries of older versions were not redacted
        if args.previous:
            previous = load_summary(args.previous, store)
            merged["comparison"] = {"previous": args.previous, **compare(previous, merged)}
    except (OSError, GpuhostError) as exc:
        print(printable(f"merge: {exc}"), file=sys.stderr)
        return 2
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(merged), encoding="utf-8")
    json_path = args.json or str(out.with_suffix(".json"))
    Path(json_path).write_text(json.dumps(merged, indent=1, default=str), encoding="utf-8")
    if args.prometheus_textfile:
        write_prometheus(merged, args.prometheus_textfile)
    for line in summary_lines(merged)[1:]:
        print(printable(line))
    print(f"merged {len(summaries)} summaries: {out} {json_path}")
    return 1 if any(h.get("status") != "ok" for h in merged["hosts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

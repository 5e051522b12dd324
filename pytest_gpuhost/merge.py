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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.exec.s3io import S3Store
from pytest_gpuhost.redact import MASK, printable, redact, secret_name
from pytest_gpuhost.report.files import load_summary
from pytest_gpuhost.report.prometheus import write_prometheus
from pytest_gpuhost.report.summary import (
    BAD,
    FORMAT,
    compare,
    count_line,
    fleet_judgements,
    iter_cells,
    name_list,
    summary_lines,
)

__all__ = ["MergeError", "load_sources", "main", "merge", "redact_merged", "render_html"]

#: Summaries read at once (S3 GETs in flight; S3Store's connection pool is 16).
LOAD_WORKERS = 16
#: Up to this many hosts, the healthy hosts' rows are shown open; above it, folded.
OPEN_HEALTHY_MAX = 100
#: Up to this many healthy hosts, their rows are a matrix; above it, their names only.
HEALTHY_MATRIX_MAX = 2000


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

    def load(src: str) -> tuple[str, dict[str, Any]]:
        try:
            return src, load_summary(src, store)
        except OSError as exc:
            raise MergeError(f"{src}: {exc.strerror or exc}") from None

    # One request per object: S3 GETs are waits, not work, so they overlap (a thousand nodes
    # one after another take ~10 s on loopback, more over a network). Files go the same way.
    if len(found) < 4:
        return [load(src) for src in found]
    if any(src.startswith("s3://") for src in found):
        store.client  # noqa: B018 - made once here, not by each thread at once (the property is lazy)
    with ThreadPoolExecutor(max_workers=min(LOAD_WORKERS, len(found))) as pool:
        return list(pool.map(load, found))


class _Redactor:
    """`redact_obj` with every string and key judged once: a fleet repeats the same strings.

    Same result as `redact_obj` (redaction is a function of the text while no new secret is
    remembered, and merging remembers none); a thousand nodes' summaries hold ~200,000 strings,
    most of them the same check summaries, which `redact_obj` ran every pattern over one by one.
    """

    def __init__(self) -> None:
        self.text: dict[str, str] = {}
        self.names: dict[str, bool] = {}

    def __call__(self, obj: Any) -> Any:
        t = type(obj)  # JSON gives exact dicts, lists and strs: test those first, isinstance is slow
        if t is str or (t is not dict and t is not list and isinstance(obj, str)):
            done = self.text.get(obj)
            if done is None:
                done = self.text[obj] = redact(obj)
            return done
        if t is dict or isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                if isinstance(v, str) and isinstance(k, str):
                    secret = self.names.get(k)
                    if secret is None:
                        secret = self.names[k] = secret_name(k)
                    out[k] = MASK if secret else self(v)
                else:
                    out[k] = self(v)
            return out
        if t is list or isinstance(obj, list | tuple):
            return [self(v) for v in obj]
        return obj


def redact_merged(obj: Any) -> Any:
    """Redact a merged summary (as `redact_obj`, each distinct string once)."""
    return _Redactor()(obj)


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
#: Each outcome's mark in a cell and its CSS class (colours by class, not per cell: 20,000 cells).
_MARKS = {
    "passed": ("ok", "p"),
    "fixed": ("fixed", "x"),
    "would fix": ("fix", "w"),
    "failed": ("FAIL", "f"),
    "error": ("ERR", "e"),
    "skipped": ("-", "s"),
}
_OUTCOME_ORDER = ("failed", "error", "would fix", "fixed", "passed", "skipped")
_STATUS_ORDER = {"error": 0, "failed": 1}
#: Find-a-host box: filters the rows of both tables and opens the folded healthy hosts.
_FIND_JS = (
    "function ghFind(q){q=q.toLowerCase();var d=document.getElementById('healthy');"
    "if(d&&q)d.open=true;document.querySelectorAll('[data-host]').forEach(function(r){"
    "r.style.display=r.dataset.host.toLowerCase().indexOf(q)<0?'none':''})}"
)


def _cell(check: str, cell: Mapping[str, Any] | None, detail: bool) -> str:
    """One matrix cell; `detail` (hosts not ok) adds the check, outcome and the reasons' tooltip."""
    e = html.escape
    if cell is None:
        return "<td></td>"
    outcome = str(cell.get("outcome"))
    mark, cls = _MARKS.get(outcome, (outcome, "u"))
    tip = "\n".join([str(cell.get("summary") or "")] + [str(r) for r in cell.get("reasons") or []])
    if detail:
        return (
            f"<td class='cell {cls}' data-check='{e(check)}' data-outcome='{e(outcome)}' "
            f"title='{e(tip)}'>{e(mark)}</td>"
        )
    # A healthy host's passed cells say "ok" only (the merged JSON has every summary); the
    # rest keep their one-line reason (why skipped, what was fixed).
    title = "" if outcome == "passed" else f" title='{e(tip)}'"
    return f"<td class='{cls}'{title}>{e(mark)}</td>"


def _rows(hosts: Mapping[str, Any], names: list[str], checks: list[str], detail: bool) -> list[str]:
    e = html.escape
    out = []
    for host in names:
        h = hosts[host]
        cells = h.get("checks") or {}
        out.append(
            f"<tr data-host='{e(host)}'><td class='host'>{e(host)}</td><td>{e(str(h.get('status', '?')))}</td>"
            + "".join(_cell(c, cells.get(c), detail) for c in checks)
            + "</tr>"
        )
    return out


def _check_table(summary: Mapping[str, Any], checks: list[str]) -> list[str]:
    """Per check: how many hosts ended each way (the column totals a 1,000-row matrix hides)."""
    e = html.escape
    counts: dict[str, dict[str, int]] = {c: {} for c in checks}
    for _, check, cell in iter_cells(summary):
        per = counts.setdefault(check, {})
        o = str(cell.get("outcome"))
        per[o] = per.get(o, 0) + 1
    shown = [o for o in _OUTCOME_ORDER if any(o in per for per in counts.values())]
    out = ["<table id='checks'><tr><th>check</th>" + "".join(f"<th>{e(o)}</th>" for o in shown) + "</tr>"]
    for check, per in counts.items():
        out.append(
            f"<tr><td>{e(check)}</td>"
            + "".join(
                f"<td class='{_MARKS[o][1] if per.get(o) and o != 'passed' else ''}'>{per.get(o, '')}</td>"
                for o in shown
            )
            + "</tr>"
        )
    return [*out, "</table>"]


def render_html(summary: Mapping[str, Any], title: str = "GPU fleet health") -> str:
    """Render the merged summary as one self-contained HTML page.

    Usable at a thousand hosts: the count line and a per-check table first, then the matrix of
    the hosts that are not ok (every cell with its reasons as a tooltip), then the healthy hosts'
    rows, folded above OPEN_HEALTHY_MAX hosts (names only above HEALTHY_MATRIX_MAX), then the
    fleet judgements and the reasons. A box finds a host by name. Every node string is escaped.
    """
    e = html.escape
    checks = list(summary.get("checks") or [])
    hosts = summary.get("hosts") or {}
    run = summary.get("run") or {}
    bad_hosts = sorted(
        (n for n, h in hosts.items() if h.get("status") != "ok"),
        key=lambda n: (_STATUS_ORDER.get(str(hosts[n].get("status")), 2), n),
    )
    ok_hosts = [n for n, h in hosts.items() if h.get("status") == "ok"]
    finished = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(run.get("finished") or 0)))
    head = (
        "<tr><th>host</th><th>status</th>" + "".join(f"<th class='c'>{e(c)}</th>" for c in checks) + "</tr>"
    )
    out = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{e(title)}</title><style>",
        "body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}",
        "td,th{border:1px solid #999;padding:2px 6px}th.c{writing-mode:vertical-rl;transform:rotate(180deg)}",
        "td.cell{text-align:center;cursor:help}td.host{font-weight:bold}summary{cursor:pointer;font-size:15px}",
        "".join(f"td.{cls}{{background:{_COLORS[o]}}}" for o, (_, cls) in _MARKS.items()),
        f"</style><script>{_FIND_JS}</script></head><body>",
        f"<h1>{e(title)}</h1>",
        f"<p id='counts'>{e(count_line(summary))}; runs finished {e(finished)}</p>",
        "<p><label>find a host: <input id='find' oninput='ghFind(this.value)'></label></p>",
        *_check_table(summary, checks),
        f"<h2>Hosts not ok: {len(bad_hosts)}</h2>",
        "<table id='matrix'>" + head,
        *_rows(hosts, bad_hosts, checks, detail=True),
        "</table>",
    ]
    if ok_hosts:
        is_open = " open" if len(hosts) <= OPEN_HEALTHY_MAX else ""
        out += [
            f"<details id='healthy'{is_open}><summary>Healthy hosts: {len(ok_hosts)} "
            "(every check passed, fixed or skipped)</summary>",
        ]
        if len(ok_hosts) <= HEALTHY_MATRIX_MAX:
            out += [
                "<table id='healthy-matrix'>" + head,
                *_rows(hosts, ok_hosts, checks, detail=False),
                "</table>",
            ]
        else:  # 10,000 hosts: 7.6 MB of rows Chromium takes seconds to load; names only (the JSON has all)
            out.append(
                f"<p>{len(ok_hosts)} names; each host's cells are in the merged JSON, each check's "
                "counts in the table above.</p><p id='healthy-names'>"
                + " ".join(f"<span data-host='{html.escape(n)}'>{html.escape(n)}</span>" for n in ok_hosts)
                + "</p>"
            )
        out.append("</details>")
    fl = summary.get("fleet") or {}
    if fl:
        out.append("<h2>Fleet</h2><ul>")
        for check, j in fl.items():
            by_count = sorted((j.get("versions") or {}).items(), key=lambda kv: -len(kv[1]))
            if j.get("uniform"):
                versions = "; ".join(f"{e(v)} on all {len(n)} host(s)" for v, n in by_count)
            else:  # the most common version counted, the others with their hosts named
                versions = "; ".join(
                    f"{e(v)} on {len(n)} host(s)" if i == 0 else f"{e(v)} on {e(name_list(n, 50))}"
                    for i, (v, n) in enumerate(by_count)
                )
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
        bad.sort(key=lambda t: (_STATUS_ORDER.get(str(hosts[t[0]].get("status")), 2), t[0]))
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
        merged = redact_merged(merge(summaries))  # summaries of older versions were not redacted
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
    # Compact: json's C encoder runs only without indent (20 MB of a thousand nodes: 0.3 s, not 2 s).
    Path(json_path).write_text(json.dumps(merged, separators=(",", ":"), default=str), encoding="utf-8")
    if args.prometheus_textfile:
        write_prometheus(merged, args.prometheus_textfile)
    for line in summary_lines(merged)[1:]:
        print(printable(line))
    print(f"merged {len(summaries)} summaries: {out} {json_path}")
    return 1 if any(h.get("status") != "ok" for h in merged["hosts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

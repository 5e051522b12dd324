"""Fleet runs: host selection with `--limit`, and the fleet outputs the controller writes.

`--limit EXPR` (ini `gpuhost_limit`) keeps the targets whose name or inventory group matches,
with `and`, `or`, `not` and parentheses as in `-k`; a word matches a host when it equals (or,
with `*`/`?`/`[...]`, glob-matches) the host's name or one of its groups
(`spec.vars["groups"]`). It is applied in `pytest_gpuhost_targets`, in every process alike, so
every xdist worker collects the same hosts in the same order.

On the controller (never in an xdist worker) every test report that names a target is recorded
as one cell of a hosts x checks table. At the end of the session that table becomes:

* a fleet summary JSON (`--fleet-json PATH|s3://bucket/prefix/`, default
  `fleet-summary.json` in `--report-dir`), the unit `python -m pytest_gpuhost.report.merge` merges;
* a Prometheus textfile for node_exporter's textfile collector (`--prometheus-textfile`,
  registered by suites/health), written atomically;
* a comparison with a previous summary (`--previous`), listing what newly failed and what
  recovered, in the JSON and the terminal summary;
* fleet-wide judgements no single host can make: driver and CUDA versions uniform.

Tests feed it through `item.user_properties` (`gpuhost_host`, `gpuhost_check`,
`gpuhost_verdict`); without them the check is the test's name without `test_` and the host is
taken from the node id (see `pytest_gpuhost.run.scheduling.host_of_nodeid`).
"""

from __future__ import annotations

import fnmatch
import html
import json
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.run.scheduling import TARGET_NAMES, host_of_nodeid

__all__ = [
    "BAD",
    "FORMAT",
    "FleetRecorder",
    "LimitError",
    "compare",
    "compile_limit",
    "fleet_judgements",
    "prometheus_text",
    "write_prometheus",
]

FORMAT = "pytest-gpuhost/fleet-summary/1"
#: Outcomes that count as "not healthy" in comparisons and gauges.
BAD = ("failed", "would fix", "error")
#: Outcomes that count as healthy; `skipped` is neither.
GOOD = ("passed", "fixed")
_RECORDER = pytest.StashKey["FleetRecorder"]()
_LIMIT = pytest.StashKey[Callable[[str, Sequence[str]], bool]]()


# ---------------------------------------------------------------- --limit expressions


class LimitError(ValueError):
    """A --limit expression does not parse; the message points at the offending token."""


_TOKEN = re.compile(r"\s*(?:(\()|(\))|([^\s()]+))")


def compile_limit(expr: str) -> Callable[[str, Sequence[str]], bool]:
    """Compile a `--limit` expression into `match(name, groups) -> bool`."""
    tokens: list[str] = []
    pos = 0
    text = expr.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise LimitError(f"cannot read {text[pos:]!r}")
        tokens.append(m.group(1) or m.group(2) or m.group(3))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    if not tokens:
        raise LimitError("empty expression")
    i = 0

    def peek() -> str | None:
        return tokens[i] if i < len(tokens) else None

    def take() -> str:
        nonlocal i
        tok = tokens[i]
        i += 1
        return tok

    Node = Callable[[str, Sequence[str]], bool]

    def parse_or() -> Node:
        left = parse_and()
        while peek() == "or":
            take()
            right = parse_and()
            left = (lambda a, b: lambda n, g: a(n, g) or b(n, g))(left, right)
        return left

    def parse_and() -> Node:
        left = parse_not()
        while peek() == "and":
            take()
            right = parse_not()
            left = (lambda a, b: lambda n, g: a(n, g) and b(n, g))(left, right)
        return left

    def parse_not() -> Node:
        if peek() == "not":
            take()
            inner = parse_not()
            return lambda n, g: not inner(n, g)
        return parse_primary()

    def parse_primary() -> Node:
        tok = peek()
        if tok is None:
            raise LimitError(f"expression ends early: {expr!r}")
        if tok == "(":
            take()
            inner = parse_or()
            if peek() != ")":
                raise LimitError(f"missing ')' in {expr!r}")
            take()
            return inner
        if tok in (")", "and", "or", "not"):
            raise LimitError(f"unexpected {tok!r} in {expr!r}")
        word = take()
        return lambda n, g: fnmatch.fnmatchcase(n, word) or any(fnmatch.fnmatchcase(x, word) for x in g)

    node = parse_or()
    if i != len(tokens):
        raise LimitError(f"unexpected {tokens[i]!r} in {expr!r}")
    return node


def _spec_groups(spec: Any) -> list[str]:
    groups = (getattr(spec, "vars", None) or {}).get("groups") or []
    return [str(g) for g in groups] if isinstance(groups, list | tuple) else [str(groups)]


# ---------------------------------------------------------------- options, configure, hook


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpuhost")
    group.addoption(
        "--limit",
        dest="gpuhost_limit",
        default=None,
        metavar="EXPR",
        help="run only targets whose name or inventory group matches EXPR "
        "(and/or/not/parentheses, globs): --limit 'rack1 and not gpu-07'",
    )
    group.addoption(
        "--fleet-json",
        dest="gpuhost_fleet_json",
        default=None,
        metavar="PATH|s3://BUCKET/PREFIX/",
        help="where the controller writes the hosts x checks summary (default reports/fleet-summary.json); "
        "an s3:// prefix ending in / gets <node name>.json",
    )
    parser.addini("gpuhost_limit", "default for --limit", default="")
    parser.addini("gpuhost_fleet_json", "default for --fleet-json", default="")


def _opt(config: pytest.Config, dest: str) -> tuple[str | None, str]:
    """Return (value, where it came from) for an option with an ini twin of the same name."""
    value = config.getoption(dest, None)
    if value:
        return str(value), "--" + dest.removeprefix("gpuhost_").replace("_", "-")
    try:
        ini = config.getini(dest)
    except ValueError:  # the ini twin is registered by a suite that is not loaded
        return None, ""
    return (str(ini), f"ini {dest}") if ini else (None, "")


def _limit_matcher(config: pytest.Config) -> Callable[[str, Sequence[str]], bool] | None:
    """Return the compiled --limit (compiled once; the targets hook may run before our configure)."""
    if _LIMIT in config.stash:
        return config.stash[_LIMIT]
    limit, where = _opt(config, "gpuhost_limit")
    if not limit:
        return None
    try:
        config.stash[_LIMIT] = compile_limit(limit)
    except LimitError as exc:
        raise pytest.UsageError(
            f"{where}={limit!r}: {exc}; write names or groups joined by and/or/not, "
            "e.g. --limit 'rack1 and not gpu-node-07'"
        ) from None
    return config.stash[_LIMIT]


def pytest_configure(config: pytest.Config) -> None:
    _limit_matcher(config)
    if not hasattr(config, "workerinput"):
        recorder = FleetRecorder(config)
        config.stash[_RECORDER] = recorder
        config.pluginmanager.register(recorder, "gpuhost-fleet-recorder")


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_gpuhost_targets(config: pytest.Config, targets: list[Any]) -> Any:
    """Apply --limit after every other implementation, and record the final target names."""
    result = yield
    match = _limit_matcher(config)
    if match is not None:
        before = len(targets)
        targets[:] = [t for t in targets if match(str(t.name), _spec_groups(t))]
        if before and not targets:
            limit, where = _opt(config, "gpuhost_limit")
            raise pytest.UsageError(f"{where}={limit!r} matches none of the {before} targets")
    config.stash[TARGET_NAMES] = [str(t.name) for t in targets]
    return result


# ---------------------------------------------------------------- recording on the controller


@dataclass
class Cell:
    """One host x check result."""

    outcome: str
    summary: str = ""
    reasons: list[str] = field(default_factory=list)
    nodeid: str = ""
    duration: float = 0.0
    state: Any = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"outcome": self.outcome, "summary": self.summary, "nodeid": self.nodeid}
        if self.reasons:
            d["reasons"] = self.reasons
        if self.state is not None:
            d["state"] = self.state
        d["duration"] = round(self.duration, 3)
        return d


def _first_line(report: pytest.TestReport) -> str:
    lr = report.longrepr
    if lr is None:
        return ""
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    crash = getattr(lr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return " ".join(str(crash.message).split())[:500]
    text = str(lr).strip().splitlines()
    return text[-1][:500] if text else ""


def _check_of(nodeid: str) -> str:
    name = nodeid.rsplit("::", 1)[-1].split("[", 1)[0]
    return name.removeprefix("test_")


class FleetRecorder:
    """Collect host x check cells from test reports; write the fleet outputs at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.cells: dict[str, dict[str, Cell]] = {}
        self.round_trips: dict[str, dict[str, int]] = {}
        self.checks: list[str] = []
        self.started = time.time()
        self.outputs: list[str] = []
        self.summary: dict[str, Any] | None = None

    def _where(self, report: pytest.TestReport) -> tuple[str | None, str, dict[str, Any]]:
        props = dict(report.user_properties or [])
        known: list[str] = self.config.stash.get(TARGET_NAMES, [])
        # Without targets (a run of ordinary tests) a parametrized id is no host: no fleet rows.
        host = props.get("gpuhost_host") or (host_of_nodeid(report.nodeid, known) if known else None)
        check = props.get("gpuhost_check") or _check_of(report.nodeid)
        verdict = props.get("gpuhost_verdict")
        return (str(host) if host else None), str(check), (verdict if isinstance(verdict, dict) else {})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        host, check, verdict = self._where(report)
        if host is None:
            return
        row = self.cells.setdefault(host, {})
        props: dict[str, Any] = dict(report.user_properties or [])
        for key in ("gpuhost_round_trips", "gpuhost_conn_round_trips"):
            if isinstance(props.get(key), int):
                rt = self.round_trips.setdefault(host, {})
                short = key.removeprefix("gpuhost_")
                rt[short] = max(rt.get(short, 0), props[key])
        if report.when == "setup" and report.outcome != "passed":
            outcome = "skipped" if report.skipped else "error"
            row[check] = Cell(outcome, _first_line(report), nodeid=report.nodeid, duration=report.duration)
            self._note_check(check)
        elif report.when == "call":
            outcome = getattr(report, "gpuhost_outcome", None) or report.outcome
            summary = verdict.get("summary") or _first_line(report)
            row[check] = Cell(
                str(outcome),
                str(summary),
                list(verdict.get("reasons") or []),
                report.nodeid,
                report.duration,
                verdict.get("state"),
            )
            self._note_check(check)
        elif report.when == "teardown" and report.failed and check in row and row[check].outcome in GOOD:
            row[check] = Cell("error", "teardown: " + _first_line(report), nodeid=report.nodeid)

    def _note_check(self, check: str) -> None:
        if check not in self.checks:
            self.checks.append(check)

    def build(self) -> dict[str, Any]:
        """Return the fleet summary of what was recorded (see docs/fleet.md for the format)."""
        finished = time.time()
        hosts: dict[str, Any] = {}
        for host, row in self.cells.items():
            cells = {c: row[c].as_dict() for c in self.checks if c in row}
            hosts[host] = {"status": host_status(cells), "checks": cells}
            if host in self.round_trips:
                hosts[host].update(self.round_trips[host])
        return {
            "format": FORMAT,
            "run": {
                "started": self.started,
                "finished": finished,
                "duration": round(finished - self.started, 3),
                "node": socket.gethostname(),
                "argv": list(sys.argv[1:]),
            },
            "checks": list(self.checks),
            "hosts": hosts,
            "fleet": fleet_judgements(hosts),
        }

    def _summarize(self) -> dict[str, Any] | None:
        """Build the summary (with the comparison) once; None when no test named a target."""
        if self.summary is not None or not self.cells:
            return self.summary
        summary = self.build()
        prev_path, _ = _opt(self.config, "gpuhost_previous")
        if prev_path:
            try:
                previous = load_summary(prev_path)
            except (OSError, ValueError) as exc:
                summary["comparison"] = {"previous": prev_path, "error": str(exc)}
            else:
                summary["comparison"] = {"previous": prev_path, **compare(previous, summary)}
        self.summary = summary
        return summary

    @pytest.hookimpl(optionalhook=True)
    def pytest_html_results_summary(
        self, prefix: list[str], summary: list[str], postfix: list[str], session: Any
    ) -> None:
        """Add the fleet section (failures, uniformity, comparison) below pytest-html's summary."""
        built = self._summarize()
        if built is None:
            return
        text = "\n".join(summary_lines(built)[2:])
        postfix.append(f'<h3>Fleet</h3><pre class="gh-fleet" id="gpuhost-fleet">{html.escape(text)}</pre>')

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        summary = self._summarize()
        if summary is None:
            return
        dest, _ = _opt(self.config, "gpuhost_fleet_json")
        dest = dest or self._default_dest()
        if dest:
            try:
                self.outputs.append("fleet summary: " + write_summary(summary, dest))
            except Exception as exc:  # S3 or disk trouble must not hide the test results
                self.outputs.append(f"fleet summary NOT written to {dest}: {exc}")
        prom, _ = _opt(self.config, "gpuhost_prometheus_textfile")
        if prom:
            try:
                write_prometheus(summary, prom)
                self.outputs.append("Prometheus textfile: " + prom)
            except OSError as exc:
                self.outputs.append(f"Prometheus textfile NOT written to {prom}: {exc}")

    def _default_dest(self) -> str | None:
        """Return reports/fleet-summary.json in the run's report dir (None with --report-dir=none)."""
        from pytest_gpuhost.plugin import settings_key

        settings = self.config.stash.get(settings_key, None)
        report_dir = getattr(settings, "report_dir", "reports")
        if not report_dir:
            return None
        path = Path(report_dir)
        if not path.is_absolute():
            path = self.config.invocation_params.dir / path
        return str(path / "fleet-summary.json")

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.summary is None:
            return
        for line in summary_lines(self.summary) + self.outputs:
            terminalreporter.write_line(line)


def host_status(cells: Mapping[str, Mapping[str, Any]]) -> str:
    """Return a host's status: error (unreachable or broken run), failed, or ok."""
    outcomes = [c.get("outcome") for c in cells.values()]
    if "error" in outcomes:
        return "error"
    if any(o in ("failed", "would fix") for o in outcomes):
        return "failed"
    return "ok"


def fleet_judgements(hosts: Mapping[str, Any]) -> dict[str, Any]:
    """Judge what needs the whole fleet: are driver and CUDA versions the same everywhere."""
    out: dict[str, Any] = {}
    for check in ("driver_version", "cuda_version"):
        by_version: dict[str, list[str]] = {}
        for host, h in sorted(hosts.items()):
            state = ((h.get("checks") or {}).get(check) or {}).get("state") or {}
            version = state.get(check) if isinstance(state, Mapping) else None
            if version:
                by_version.setdefault(str(version), []).append(host)
        if by_version:
            out[check] = {"uniform": len(by_version) == 1, "versions": by_version}
    return out


# ---------------------------------------------------------------- comparison, outputs


def _bad_cells(summary: Mapping[str, Any]) -> dict[tuple[str, str], Mapping[str, Any]]:
    out = {}
    for host, h in (summary.get("hosts") or {}).items():
        for check, cell in (h.get("checks") or {}).items():
            out[(host, check)] = cell
    return out


def compare(previous: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """List the cells that newly failed and those that recovered since `previous`.

    Newly failed: not healthy now, and healthy, skipped or absent before (`was` says which).
    Recovered: healthy now, not healthy before. Skipped now counts as neither.
    """
    prev, cur = _bad_cells(previous), _bad_cells(current)
    newly, recovered = [], []
    for key, cell in sorted(cur.items()):
        before = prev.get(key)
        was = before.get("outcome") if before else "absent"
        if cell.get("outcome") in BAD and was not in BAD:
            newly.append(
                {
                    "host": key[0],
                    "check": key[1],
                    "outcome": cell.get("outcome"),
                    "was": was,
                    "summary": cell.get("summary", ""),
                }
            )
        elif cell.get("outcome") in GOOD and was in BAD:
            recovered.append(
                {"host": key[0], "check": key[1], "was": was, "summary": cell.get("summary", "")}
            )
    return {"newly_failed": newly, "recovered": recovered}


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """Return the terminal summary of a fleet run, a few lines."""
    hosts = summary.get("hosts") or {}
    by_status: dict[str, list[str]] = {}
    for host, h in sorted(hosts.items()):
        by_status.setdefault(h.get("status", "?"), []).append(host)
    lines = ["", "=" * 20 + " gpuhost fleet " + "=" * 20]
    parts = [
        f"{len(hosts)} hosts x {len(summary.get('checks') or [])} checks: {len(by_status.get('ok', []))} ok"
    ]
    for status in ("failed", "error"):
        names = by_status.get(status, [])
        if names:
            parts.append(f"{len(names)} {status}")
    lines.append(", ".join(parts))
    for host in by_status.get("failed", []) + by_status.get("error", []):
        bad = [(c, cell) for c, cell in hosts[host]["checks"].items() if cell.get("outcome") in BAD]
        for check, cell in bad[:6]:
            lines.append(f"  {host} {check}: {cell.get('outcome')}: {cell.get('summary', '')}")
        if len(bad) > 6:
            lines.append(f"  {host}: {len(bad) - 6} more")
    for check, j in (summary.get("fleet") or {}).items():
        versions = j.get("versions") or {}
        if j.get("uniform"):
            ((v, names),) = versions.items()
            lines.append(f"{check}: {v} on all {len(names)} hosts")
        else:
            shown = "; ".join(
                f"{v} on {', '.join(n)}" for v, n in sorted(versions.items(), key=lambda kv: -len(kv[1]))
            )
            lines.append(f"{check}: NOT uniform across the fleet: {shown}")
    comp = summary.get("comparison")
    if comp:
        if comp.get("error"):
            lines.append(f"previous run {comp.get('previous')}: unreadable: {comp['error']}")
        else:
            lines.append(
                f"since {comp.get('previous')}: {len(comp['newly_failed'])} newly failed, {len(comp['recovered'])} recovered"
            )
            for c in comp["newly_failed"]:
                lines.append(f"  newly failed: {c['host']} {c['check']} (was {c['was']}): {c['summary']}")
            for c in comp["recovered"]:
                lines.append(f"  recovered: {c['host']} {c['check']} (was {c['was']})")
    return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(summary: Mapping[str, Any]) -> str:
    """Render a fleet summary in the Prometheus text exposition format.

    `gpuhost_check_ok{host,check}` is 1 when the check held (or was fixed) and 0 when it failed,
    would be fixed, or could not run; skipped checks have no sample. Plus a per-host gauge and
    the run's timestamp and duration, so an alert can also catch a run that stopped happening.
    """
    out = [
        "# HELP gpuhost_check_ok 1 if the health check held (or was fixed) at the last run, 0 if not.",
        "# TYPE gpuhost_check_ok gauge",
    ]
    hosts = summary.get("hosts") or {}
    for host, h in sorted(hosts.items()):
        for check, cell in (h.get("checks") or {}).items():
            outcome = cell.get("outcome")
            if outcome in GOOD or outcome in BAD:
                value = 1 if outcome in GOOD else 0
                out.append(f'gpuhost_check_ok{{host="{_label(host)}",check="{_label(check)}"}} {value}')
    out += [
        "# HELP gpuhost_host_ok 1 if every check on the host held at the last run.",
        "# TYPE gpuhost_host_ok gauge",
    ]
    for host, h in sorted(hosts.items()):
        out.append(f'gpuhost_host_ok{{host="{_label(host)}"}} {1 if h.get("status") == "ok" else 0}')
    run = summary.get("run") or {}
    out += [
        "# HELP gpuhost_last_run_timestamp_seconds When the last health run finished, Unix time.",
        "# TYPE gpuhost_last_run_timestamp_seconds gauge",
        f"gpuhost_last_run_timestamp_seconds {float(run.get('finished') or time.time()):.3f}",
        "# HELP gpuhost_last_run_duration_seconds How long the last health run took.",
        "# TYPE gpuhost_last_run_duration_seconds gauge",
        f"gpuhost_last_run_duration_seconds {float(run.get('duration') or 0):.3f}",
    ]
    return "\n".join(out) + "\n"


def _atomic_write(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    # Same directory, then rename: node_exporter never reads a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".gpuhost-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_prometheus(summary: Mapping[str, Any], path: str) -> None:
    """Write the Prometheus textfile atomically (temp file in the same directory, rename)."""
    _atomic_write(path, prometheus_text(summary))


def write_summary(summary: Mapping[str, Any], dest: str) -> str:
    """Write the fleet summary to a path or an s3:// URL; return where it went."""
    text = json.dumps(summary, indent=1, sort_keys=False, default=str)
    if dest.startswith("s3://"):
        from pytest_gpuhost.report.merge import s3_put

        if dest.endswith("/"):
            dest = dest + socket.gethostname() + ".json"
        s3_put(dest, text.encode("utf-8"))
        return dest
    _atomic_write(dest, text)
    return dest


def load_summary(source: str) -> dict[str, Any]:
    """Read one fleet summary from a path or an s3:// URL; raise ValueError if it is not one."""
    if source.startswith("s3://"):
        from pytest_gpuhost.report.merge import s3_get

        data = s3_get(source).decode("utf-8")
    else:
        data = Path(source).read_text(encoding="utf-8")
    try:
        summary = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{source}: not JSON: {exc}") from None
    if not isinstance(summary, dict) or summary.get("format") != FORMAT:
        raise ValueError(f"{source}: not a pytest-gpuhost fleet summary (format {FORMAT})")
    return summary


def iter_cells(summary: Mapping[str, Any]) -> Iterable[tuple[str, str, Mapping[str, Any]]]:
    """Yield (host, check, cell) of a summary."""
    for host, h in (summary.get("hosts") or {}).items():
        for check, cell in (h.get("checks") or {}).items():
            yield host, check, cell

"""Fleet runs: the fleet outputs the controller writes (host selection, `--limit`, is `run/limit.py`).

On the controller (never in an xdist worker) the run record (`run/record.py`) holds every test
that ran against a target; at the end of the session it becomes:

* a fleet summary JSON (`--fleet-json PATH|s3://bucket/prefix/`, default
  `fleet-summary.json` in `--report-dir`), the unit `python -m pytest_gpuhost.merge` merges;
* a Prometheus textfile for node_exporter's textfile collector (`--prometheus-textfile`,
  one of the plugin's options in `run/settings.py`), written atomically;
* a comparison with a previous summary (`--previous`), listing what newly failed and what
  recovered, in the JSON and the terminal summary;
* fleet-wide judgements no single host can make: driver and CUDA versions uniform.

Tests can name their row and column with `item.user_properties` (`gpuhost_host`,
`gpuhost_check`) and add a verdict (`gpuhost_verdict`: summary, reasons, state); without them
the host is the test's target and the check is `record.check_name` of the node id.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pytest
from _pytest.junitxml import xml_key  # where junitxml keeps its LogXML; no public accessor

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.redact import printable, redact, redact_argv, redact_obj
from pytest_gpuhost.report.files import load_summary, write_summary
from pytest_gpuhost.report.prometheus import prometheus_text, write_prometheus
from pytest_gpuhost.report.summary import (
    BAD,
    FORMAT,
    GOOD,
    build_summary,
    compare,
    fleet_judgements,
    host_status,
    iter_cells,
    summary_lines,
)
from pytest_gpuhost.run import record, settings

__all__ = [
    "BAD",
    "FORMAT",
    "GOOD",
    "FleetRecorder",
    "FleetReport",
    "compare",
    "fleet_judgements",
    "host_status",
    "iter_cells",
    "load_summary",
    "prometheus_text",
    "summary_lines",
    "write_prometheus",
    "write_summary",
]

_REPORT = pytest.StashKey["FleetReport"]()


def _opt(config: pytest.Config, dest: str) -> tuple[str | None, str]:
    """Return (value, where it came from) of one of the plugin's options (declared in run/settings.py)."""
    s = settings.read(config)
    key = dest.removeprefix("gpuhost_")
    value = getattr(s, key)
    return (str(value), str(s.sources[key])) if value else (None, "")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Give the JUnit XML the count of checks that cannot see (before junitxml writes it).

    JUnit has no outcome between passed and failed: those tests are `<skipped>` (or failures
    with `--cannot-see=fail`), each with the property `gpuhost_outcome="cannot see"`, and the
    suite's property `gpuhost_cannot_see` counts them.
    """
    report = session.config.stash.get(_REPORT, None)
    xml = session.config.stash.get(xml_key, None)
    if report is None or xml is None:
        return
    n = sum(1 for t in report.record.decided() if t.result == record.CANNOT_SEE)
    xml.add_global_property("gpuhost_cannot_see", str(n))


def pytest_configure(config: pytest.Config) -> None:
    run_record = record.install(config)
    if run_record is not None:
        report = FleetReport(config, run_record)
        config.stash[_REPORT] = report
        config.pluginmanager.register(report, "gpuhost-fleet-report")


class FleetReport:
    """Turn the run record into the fleet summary, its comparison, Prometheus textfile and lines."""

    def __init__(self, config: pytest.Config, run_record: record.RunRecord) -> None:
        self.config = config
        self.record = run_record
        self.outputs: list[str] = []
        self.summary: dict[str, Any] | None = None

    def _summarize(self) -> dict[str, Any] | None:
        """Build the summary (with the comparison) once; None when no test named a target."""
        if self.summary is not None:
            return self.summary
        # Redacted once here: the JSON, Prometheus, HTML Fleet section and terminal all read it.
        summary = build_summary(self.record, cannot_see=settings.read(self.config).cannot_see)
        summary["run"]["argv"] = redact_argv(summary["run"]["argv"])  # `--password VALUE` is two items
        summary = redact_obj(summary)
        if not summary["hosts"]:
            return None
        prev_path, _ = _opt(self.config, "gpuhost_previous")
        if prev_path:
            try:
                previous = load_summary(prev_path)
            except (OSError, GpuhostError) as exc:
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
            except (OSError, GpuhostError) as exc:  # S3 or disk trouble must not hide the results
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
        report_dir = settings.read(self.config).report_dir
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
            terminalreporter.write_line(printable(redact(line)))


#: The name this class had when it collected the results itself.
FleetRecorder = FleetReport

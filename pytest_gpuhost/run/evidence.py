"""Per-test evidence: commands, states, measurements, matrices, notes and actions.

Each test phase (setup, call, teardown) gets its own `Evidence`; `current()` returns the one of
the phase that is running, or the session bucket outside of tests (connections opened at
configure time, closed at session end). A plain module global rather than a contextvar, so that
commands a test runs from worker threads are recorded into that test too.

Everything is redacted when it is recorded, so secrets never sit in memory in a form that a
report could pick up. Records are plain JSON-able dicts: they travel from xdist workers on the
report (`report.gpuhost_evidence`), are folded into the run record (`run/record.py`) on the
controller and end in `reports/<name>.json` (`report/jsonfile.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any

import pytest

from pytest_gpuhost.exec import observe
from pytest_gpuhost.redact import redact, redact_env, redact_obj
from pytest_gpuhost.run import record

__all__ = [
    "Evidence",
    "MAX_OUTPUT",
    "activate",
    "attach",
    "connection",
    "connections",
    "current",
    "jsonable",
    "phase",
    "session_evidence",
]

# Output kept per stream and command; the rest is cut with a marker (a report must stay openable).
MAX_OUTPUT = 64 * 1024


def jsonable(value: Any) -> Any:
    """Convert a value to something `json.dumps` accepts (dataclasses, sets, paths, bytes)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    return str(value)


def _cut(text: str) -> str:
    if len(text) <= MAX_OUTPUT:
        return text
    return text[:MAX_OUTPUT] + f"\n... [{len(text) - MAX_OUTPUT} more characters cut]"


class Evidence:
    """What one test phase saw and did on its targets."""

    def __init__(self, phase: str = "session") -> None:
        self.phase = phase
        self.commands: list[dict[str, Any]] = []
        self.states: list[dict[str, Any]] = []
        self.measures: list[dict[str, Any]] = []
        self.matrices: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.actions: list[dict[str, Any]] = []
        #: The answer a suite gives for a target, in words (`answer`); the outputs open with it.
        self.answers: list[dict[str, Any]] = []
        #: How each target was reached (client and version, mode), recorded where it was opened.
        self.connections: list[dict[str, Any]] = []

    def command(self, result: Any) -> None:
        """Record one command result (a `CommandResult` or a dict with the same fields)."""
        data = jsonable(result) if not isinstance(result, Mapping) else dict(result)
        if not isinstance(data, dict):
            data = {"command": str(data)}
        command = data.get("command", "")
        if isinstance(command, list | tuple):
            command = " ".join(str(c) for c in command)
        record: dict[str, Any] = {
            "target": str(data.get("target", "")),
            "command": redact(str(command)),
            "rc": data.get("rc"),
            "stdout": _cut(redact(str(data.get("stdout") or ""))),
            "stderr": _cut(redact(str(data.get("stderr") or ""))),
            "start": data.get("start"),
            "duration": data.get("duration"),
            "timed_out": bool(data.get("timed_out", False)),
        }
        env = data.get("env")
        if isinstance(env, Mapping) and env:
            record["env"] = redact_env({str(k): str(v) for k, v in env.items()})
        self.commands.append(record)

    def state(self, label: str, value: Any, target: str = "") -> None:
        """Record a state of the host, e.g. "before" and "after" a fix."""
        self.states.append({"label": label, "target": target, "value": redact_obj(jsonable(value))})

    def measure(self, name: str, value: Any, unit: str | None = None, target: str = "") -> None:
        """Record one scalar measurement (a bandwidth, a checksum, a count)."""
        self.measures.append(
            {"name": name, "value": redact_obj(jsonable(value)), "unit": unit, "target": target}
        )

    def matrix(
        self,
        name: str,
        labels: Sequence[str],
        values: Sequence[Sequence[float | None]],
        unit: str = "GB/s",
        threshold: float | None = None,
        target: str = "",
    ) -> None:
        """Record a square matrix of measurements (rows and columns share `labels`); shown as a heatmap.

        `None` (or NaN) cells are pairs without a value (self, or not measured). Cells below
        `threshold` are marked in the report.
        """
        rows = [
            [None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v) for v in row]
            for row in values
        ]
        self.matrices.append(
            {
                "name": name,
                "labels": [str(x) for x in labels],
                "values": rows,
                "unit": unit,
                "threshold": threshold,
                "target": target,
            }
        )

    def note(self, text: str) -> None:
        """Record a line of free text."""
        self.notes.append(redact(str(text)))

    def action(self, action: Any, status: str) -> None:
        """Record an `Action` with its status: planned, done, ran, not verified, failed, vetoed."""
        data = jsonable(action)
        if not isinstance(data, dict):
            data = {"description": str(data)}
        data = redact_obj(data)
        data["status"] = status
        for existing in self.actions:
            if all(existing.get(k) == data.get(k) for k in ("description", "command", "target")):
                existing["status"] = status
                return
        self.actions.append(data)

    def answer(
        self,
        target: str,
        ok: bool,
        headline: str,
        details: Sequence[str] = (),
        table: Sequence[Sequence[Any]] = (),
    ) -> None:
        """Record the answer the operator came for, for one target: "SAFE TO TERMINATE: ...".

        `headline` is one line that starts with the verdict in capitals; `details` are the
        problems or figures behind it, one line each; `table` (a header row, then rows) is shown
        under the banner (a decommission's categories). The terminal's last lines, the report's
        banner and the JSON file say it first (report/answer.py).
        """
        self.answers.append(
            {
                "target": str(target),
                "ok": bool(ok),
                "headline": redact(" ".join(str(headline).split())),
                "details": [redact(" ".join(str(d).split())) for d in details][:50],
                "table": [[redact(str(c)) for c in row] for row in table][:201],
            }
        )

    @property
    def empty(self) -> bool:
        """Tell whether nothing was recorded."""
        return not (
            self.commands
            or self.states
            or self.measures
            or self.matrices
            or self.notes
            or self.actions
            or self.answers
            or self.connections
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-able record (only the non-empty kinds)."""
        out: dict[str, Any] = {}
        for key in (
            "commands",
            "states",
            "measures",
            "matrices",
            "notes",
            "actions",
            "answers",
            "connections",
        ):
            value = getattr(self, key)
            if value:
                out[key] = value
        return json.loads(json.dumps(out, default=str))


_session = Evidence("session")
_active: Evidence | None = None


def current() -> Evidence:
    """Return the Evidence of the running test phase, or the session bucket between tests."""
    return _active if _active is not None else _session


def session_evidence() -> Evidence:
    """Return the bucket for evidence recorded outside any test phase."""
    return _session


def reset_session() -> Evidence:
    """Start a fresh session bucket (a new pytest session in the same process, as pytester runs)."""
    global _session
    _session = Evidence("session")
    _unsent.clear()
    return _session


#: Connections opened in this process that no test report has carried yet (see `attach`).
_unsent: list[dict[str, Any]] = []


def _add_connection(bucket: list[dict[str, Any]], info: dict[str, Any]) -> None:
    key = (info.get("target"), info.get("to"))
    if not any((c.get("target"), c.get("to")) == key for c in bucket):
        bucket.append(info)


def connection(info: Mapping[str, Any]) -> None:
    """Record how a target was reached: `target`, `to` (host or container), `client`, `version`, `mode`.

    Kept in the run's evidence (the session bucket: the JSON file's `session.connections`, the
    HTML report's header) and in the evidence of the test phase that opened it (or, for a
    connection opened between tests, the next test phase reported in this process), so an xdist
    worker's connections reach the controller on a test report.
    """
    data = redact_obj(jsonable(dict(info)))
    _add_connection(_session.connections, data)
    if _active is not None:
        _add_connection(_active.connections, data)
    else:
        _add_connection(_unsent, data)


def connections() -> list[dict[str, Any]]:
    """Return the run's connections as recorded so far (on the controller: every worker's too)."""
    return list(_session.connections)


def activate(ev: Evidence | None) -> Evidence | None:
    """Make `ev` the current Evidence; return the previous one (to restore it)."""
    global _active
    previous, _active = _active, ev
    return previous


def _record_command(target: str, result: Any) -> None:
    """Record a command a connection made; exec.observe hands it over already redacted."""
    current().command(result)


observe.add_command_observer(_record_command)


# --- pytest integration (called from plugin.py's hooks) -------------------------------------

_phases_key = pytest.StashKey[dict[str, Evidence]]()


@contextlib.contextmanager
def phase(item: pytest.Item, when: str) -> Iterator[Evidence]:
    """Make a fresh Evidence current for one phase of `item`, and keep it for its report."""
    ev = Evidence(when)
    item.stash.setdefault(_phases_key, {})[when] = ev
    previous = activate(ev)
    try:
        yield ev
    finally:
        activate(previous)


def _phase(item: pytest.Item, when: str) -> Generator[None, object, object]:
    with phase(item, when):
        return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _phase(item, "setup"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _phase(item, "call"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _phase(item, "teardown"))


def of(item: pytest.Item, when: str) -> Evidence | None:
    """Return the Evidence recorded for one phase of `item`, if any."""
    return item.stash.get(_phases_key, {}).get(when)


def attach(item: pytest.Item, report: pytest.TestReport) -> None:
    """Put the phase's record on the report (evidence, target, check); redact the failure text.

    Called after the remediation engine set `report.gpuhost_outcome`, so the JUnit properties
    `record.annotate` writes carry it.
    """
    ev = of(item, report.when)
    record.annotate(item, report)
    data = ev.to_dict() if ev is not None else {}
    if _unsent:  # opened between tests (a prefetch at collection, configure): carried by this report
        data["connections"] = [*data.get("connections", []), *_unsent]
        _unsent.clear()
    report.gpuhost_evidence = data  # type: ignore[attr-defined]
    scrub(report)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the controller, keep the connections a worker's report carries in the run's evidence."""
    for info in (getattr(report, "gpuhost_evidence", None) or {}).get("connections") or []:
        if isinstance(info, dict):
            _add_connection(_session.connections, info)


def scrub(report: pytest.TestReport) -> None:
    """Redact a report's failure text and captured sections (only when something is hidden).

    A failure's repr is kept as an object unless redaction changes its text, so ordinary
    tracebacks keep their formatting.
    """
    if report.longrepr is not None:
        text = str(report.longrepr) if not isinstance(report.longrepr, tuple) else report.longrepr[2]
        hidden = redact(text)
        if hidden != text:
            if isinstance(report.longrepr, tuple):
                report.longrepr = (report.longrepr[0], report.longrepr[1], hidden)
            else:
                report.longrepr = hidden
    report.sections = [(title, redact(content)) for title, content in report.sections]
    # JUnit XML writes these as <property> values; the record and the fleet summary read them.
    report.user_properties = [(name, redact_obj(value)) for name, value in report.user_properties]

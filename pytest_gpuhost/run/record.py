"""The run record: each test's target, check name, outcome, evidence and verdict, collected once.

Two halves. In the process that runs a test (an xdist worker, or the only process), `annotate`
puts the phase's record on its report: `gpuhost_target`, `gpuhost_check` (and the evidence and
outcome that `evidence.attach` and the remediation engine put there), plus the JUnit properties
`gpuhost_outcome` and `gpuhost_check`. On the controller, `RunRecord` folds the reports of each
test into one `TestRecord`. Every output reads that record: the HTML matrix, the JSON evidence
file, the fleet summary (and so the Prometheus textfile and the merge).

One vocabulary for results: the remediation outcomes (`passed`, `fixed`, `would fix`, `failed`,
`skipped`, `cannot see`) plus `error` for a test whose setup or teardown failed. `cannot see` is
a check whose input the node does not give (the kernel log denied, no systemd, a tool missing):
neither healthy nor not, counted apart everywhere. One function names a check:
`check_name`, the same in every output.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_gpuhost.redact import redact, redact_obj

__all__ = [
    "BAD",
    "CANNOT_SEE",
    "GOOD",
    "OUTCOMES",
    "RESULTS",
    "TARGET_PARAM",
    "RunRecord",
    "TestRecord",
    "annotate",
    "check_name",
    "install",
    "one_line",
    "phase_result",
    "record_key",
    "target_name",
]

PASSED, FIXED, FAILED, WOULD_FIX, SKIPPED, ERROR, CANNOT_SEE = (
    "passed",
    "fixed",
    "failed",
    "would fix",
    "skipped",
    "error",
    "cannot see",
)
#: What a remediation (and so a test's call) can end as.
OUTCOMES = (PASSED, FIXED, FAILED, WOULD_FIX, SKIPPED, CANNOT_SEE)
#: What a test ends as in the outputs: an outcome, or `error` when setup or teardown failed.
RESULTS = (*OUTCOMES, ERROR)
#: Results that count as "not healthy" in comparisons and gauges.
BAD = (FAILED, WOULD_FIX, ERROR)
#: Results that count as healthy; `skipped` and `cannot see` are neither.
GOOD = (PASSED, FIXED)

#: The indirect parameter that carries a test's target name.
TARGET_PARAM = "_gpuhost_target"
#: Longest message kept per test (a crash message can hold a whole dump).
MESSAGE_LIMIT = 500


def target_name(item: pytest.Item) -> str:
    """Return the name of the target an item runs against ("" when it has none)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return ""
    value = callspec.params.get(TARGET_PARAM)
    return "" if value is None else str(value)


def check_name(nodeid: str, target: str = "", check: str | None = None) -> str:
    """Return the name of the check a test is, the same in every output and in the merge.

    An explicit name (the `gpuhost_check` user property) wins. Otherwise it is the test's name
    without its file, without `test_`, and without the target's part of the parameter id:
    `suites/x/test_a.py::test_link[gpu-1-eth0]` is `link[eth0]` on gpu-1.
    """
    if check:
        return str(check)
    name = nodeid.split("::", 1)[-1]
    base, bracket, params = name.partition("[")
    head, sep, func = base.rpartition("::")
    base = head + sep + func.removeprefix("test_")
    if not bracket:
        return base
    params = params.removesuffix("]")
    if target:
        if params == target:
            return base
        for rest in (params.removeprefix(target + "-"), params.removesuffix("-" + target)):
            if rest != params:
                return f"{base}[{rest}]"
    return f"{base}[{params}]"


def phase_result(report: pytest.TestReport) -> str | None:
    """Return the result one phase's report gives its test, or None when it gives none.

    A failed or skipped setup decides the test (`error`, `skipped`); the call gives the
    remediation outcome; a passing setup or teardown gives nothing.
    """
    if report.when == "call":
        return str(getattr(report, "gpuhost_outcome", None) or report.outcome)
    if report.failed:
        return ERROR
    if report.skipped:
        return SKIPPED
    return None


def combine(previous: str | None, report: pytest.TestReport) -> str | None:
    """Return a test's result after one more phase: a bad result is never overwritten."""
    result = phase_result(report)
    if result is None:
        return previous
    if previous in BAD:
        return previous
    return result


def one_line(report: pytest.TestReport) -> str:
    """Return why a phase failed or skipped, in one redacted line."""
    lr = report.longrepr
    if lr is None:
        return ""
    if isinstance(lr, tuple) and len(lr) == 3:
        text = str(lr[2]).removeprefix("Skipped: ")
    else:
        crash = getattr(lr, "reprcrash", None)
        if crash is not None and getattr(crash, "message", None):
            text = str(crash.message)
        else:
            lines = str(lr).strip().splitlines()
            text = lines[-1] if lines else ""
    return redact(" ".join(text.split())[:MESSAGE_LIMIT])


def _remediation_line(report: pytest.TestReport, outcome: str | None) -> str:
    """Say why the engine failed a test, from its record rather than the exception's text.

    The exception reads `WouldFix: would fix: name: why`; beside the result it would say
    "would fix" three times.
    """
    for rem in getattr(report, "gpuhost_remediations", None) or []:
        if rem.get("outcome") == outcome and outcome in (WOULD_FIX, FAILED):
            why = rem.get("reason") or (rem.get("before") or {}).get("summary", "")
            return redact(" ".join(f"{rem.get('name')}: {why}".split())[:MESSAGE_LIMIT])
    return ""


# ---------------------------------------------------------------- the running side


def annotate(item: pytest.Item, report: pytest.TestReport) -> None:
    """Put the phase's target and check name on the report, and the JUnit properties on the item.

    JUnit XML writes the properties the item holds when its teardown report is made, so
    `gpuhost_outcome` and `gpuhost_check` set here reach CI too.
    """
    props: dict[str, Any] = dict(item.user_properties)
    target = target_name(item)
    report.gpuhost_target = target  # type: ignore[attr-defined]
    check = check_name(item.nodeid, str(props.get("gpuhost_host") or target), props.get("gpuhost_check"))
    report.gpuhost_check = check  # type: ignore[attr-defined]
    outcome = getattr(report, "gpuhost_outcome", None)
    if outcome is not None and (report.when == "call" or report.failed or report.skipped):
        kept = [p for p in item.user_properties if p[0] != "gpuhost_outcome"]
        item.user_properties[:] = [*kept, ("gpuhost_outcome", outcome)]
        if "gpuhost_check" not in props:
            item.user_properties.append(("gpuhost_check", check))


# ---------------------------------------------------------------- the controller side


@dataclass
class TestRecord:
    """Everything the outputs say about one test, folded from its phase reports."""

    __test__ = False  # not a test class, whatever pytest's collection thinks of the name

    nodeid: str
    target: str = ""
    check: str = ""
    #: pytest's outcome of the test: the first failed phase, else a skip, else the call's.
    outcome: str = PASSED
    #: The gpuhost outcome of the phase that decided `outcome`.
    gpuhost_outcome: str = PASSED
    #: The result every matrix shows (see RESULTS); None until a phase gives one.
    result: str | None = None
    #: The phase that gave `result`.
    result_phase: str = ""
    duration: float = 0.0
    message: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    remediations: list[dict[str, Any]] = field(default_factory=list)
    #: What a check said beyond pass or fail (`gpuhost_verdict`: summary, reasons, state).
    verdict: dict[str, Any] = field(default_factory=dict)
    round_trips: dict[str, int] = field(default_factory=dict)
    #: Why the target could not be reached ("" while it answered): the check did not run.
    unreachable: str = ""

    def observe(self, report: pytest.TestReport, known: Sequence[str]) -> None:
        """Fold one phase's report into the record."""
        props: dict[str, Any] = dict(report.user_properties or [])
        target = props.get("gpuhost_host") or getattr(report, "gpuhost_target", "")
        if not target and known:
            from pytest_gpuhost.run.scheduling import host_of_nodeid

            target = host_of_nodeid(report.nodeid, known) or ""
        self.target = str(target) or self.target
        self.check = check_name(
            report.nodeid, self.target, props.get("gpuhost_check") or getattr(report, "gpuhost_check", None)
        )
        self.duration = round(self.duration + report.duration, 6)
        ev = getattr(report, "gpuhost_evidence", None)
        if ev:
            self.evidence[report.when] = ev
        if getattr(report, "gpuhost_remediations", None):
            self.remediations = list(report.gpuhost_remediations)
        gpuhost_outcome = getattr(report, "gpuhost_outcome", None)
        if report.failed or (report.skipped and self.outcome == PASSED) or report.when == "call":
            if self.outcome != FAILED:
                self.outcome = report.outcome
                self.gpuhost_outcome = gpuhost_outcome or report.outcome
        if report.failed or report.skipped:
            self.message = _remediation_line(report, gpuhost_outcome) or one_line(report)
        down: Any = getattr(report, "gpuhost_unreachable", None)
        if report.failed and down:
            self.unreachable = redact(str(down))
        result = combine(self.result, report)
        if result != self.result:
            self.result, self.result_phase = result, report.when
        verdict = props.get("gpuhost_verdict")
        if isinstance(verdict, Mapping):
            self.verdict = dict(redact_obj(dict(verdict)))
        for key in ("gpuhost_round_trips", "gpuhost_conn_round_trips"):
            if isinstance(props.get(key), int):
                short = key.removeprefix("gpuhost_")
                self.round_trips[short] = max(self.round_trips.get(short, 0), props[key])

    @property
    def summary(self) -> str:
        """Return the one line a matrix cell shows: the check's own summary, else why it failed."""
        if self.result_phase == "call" and self.verdict.get("summary"):
            return str(self.verdict["summary"])
        if self.result_phase == "teardown":
            return "teardown: " + self.message
        return self.message

    def as_json(self) -> dict[str, Any]:
        """Return the entry of the JSON evidence file."""
        return {
            "nodeid": self.nodeid,
            "target": self.target,
            "check": self.check,
            "outcome": self.outcome,
            "gpuhost_outcome": self.gpuhost_outcome,
            "result": self.result or PASSED,
            "duration": self.duration,
            "evidence": self.evidence,
            "remediations": self.remediations,
            "message": self.message,
        } | ({"unreachable": self.unreachable} if self.unreachable else {})

    def as_cell(self) -> dict[str, Any]:
        """Return the cell of the fleet summary (see docs/fleet.md for the format)."""
        d: dict[str, Any] = {"outcome": self.result or PASSED, "summary": self.summary, "nodeid": self.nodeid}
        if self.result_phase == "call":
            if self.verdict.get("reasons"):
                d["reasons"] = list(self.verdict["reasons"])
            if self.verdict.get("state") is not None:
                d["state"] = self.verdict["state"]
        if self.unreachable:
            d["unreachable"] = self.unreachable
        d["duration"] = round(self.duration, 3)
        return d


class RunRecord:
    """The controller's record of the run: one TestRecord per test, in the order they reported."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.time()
        self.tests: dict[str, TestRecord] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # Imported here, not at the top: plugin.py imports this module (through evidence) before
        # pytest loads scheduling as a plugin, and a module imported first cannot be rewritten.
        from pytest_gpuhost.run.scheduling import TARGET_NAMES

        rec = self.tests.get(report.nodeid)
        if rec is None:
            rec = self.tests[report.nodeid] = TestRecord(report.nodeid)
        known: list[str] = self.config.stash.get(TARGET_NAMES, [])
        rec.observe(report, known)

    def decided(self) -> list[TestRecord]:
        """Return the tests that have a result (a passing setup alone gives none)."""
        return [t for t in self.tests.values() if t.result is not None]

    def targets(self) -> list[str]:
        """Return the targets tests ran against, in order of first report ("" for no target)."""
        return list(dict.fromkeys(t.target for t in self.decided()))

    def checks(self) -> list[str]:
        """Return the check names, in order of first report."""
        return list(dict.fromkeys(t.check for t in self.decided()))

    def answers(self) -> dict[str, dict[str, Any]]:
        """The answer each suite gave per target (the last one recorded for a target wins)."""
        out: dict[str, dict[str, Any]] = {}
        for t in self.tests.values():
            for phase in ("setup", "call", "teardown"):
                for a in (t.evidence.get(phase) or {}).get("answers") or []:
                    if isinstance(a, Mapping) and a.get("headline"):
                        out[str(a.get("target") or t.target)] = dict(a)
        return out

    def cells(self) -> dict[tuple[str, str], TestRecord]:
        """Return the (target, check) matrix; a later test with the same cell does not hide a bad one."""
        out: dict[tuple[str, str], TestRecord] = {}
        for t in self.decided():
            key = (t.target, t.check)
            if key not in out or out[key].result not in BAD:
                out[key] = t
        return out


record_key = pytest.StashKey[RunRecord]()


def install(config: pytest.Config) -> RunRecord | None:
    """Make and register the run's record on the controller (once); None in an xdist worker."""
    if hasattr(config, "workerinput"):
        return None
    if record_key not in config.stash:
        config.stash[record_key] = RunRecord(config)
        config.pluginmanager.register(config.stash[record_key], "gpuhost-record")
    return config.stash[record_key]

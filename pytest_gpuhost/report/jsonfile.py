"""The JSON evidence file `<report dir>/<name>.json`: every test's record, with its evidence."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.redact import redact_argv, redact_obj
from pytest_gpuhost.report import answer
from pytest_gpuhost.run.evidence import session_evidence
from pytest_gpuhost.run.record import RunRecord

__all__ = ["JsonWriter"]


class JsonWriter:
    """Write the run record, with each test's evidence, to a JSON file at the end of the session."""

    def __init__(self, path: Path, config: pytest.Config, run_record: RunRecord) -> None:
        self.path = path
        self.config = config
        self.record = run_record

    def document(self, exitstatus: int) -> dict[str, Any]:
        """Return the file's content: the run, each test's record (`TestRecord.as_json`), the session's evidence."""
        tests = [t.as_json() for t in self.record.tests.values()]
        counts: dict[str, int] = {}
        for t in tests:
            counts[t["gpuhost_outcome"]] = counts.get(t["gpuhost_outcome"], 0) + 1
        return {
            "answers": answer.answers(self.record),  # the verdict in words, first
            "name": self.path.stem,
            "started": self.record.started,
            "finished": time.time(),
            "args": redact_argv([str(a) for a in self.config.invocation_params.args]),
            "exitstatus": exitstatus,
            "check_only": bool(self.config.getoption("gpuhost_check_only", default=False)),
            "targets": sorted({t["target"] for t in tests if t["target"]}),
            "summary": counts,
            "tests": tests,
            "session": session_evidence().to_dict(),
        }

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        data = redact_obj(self.document(int(session.exitstatus)))  # the one pass, as every output
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        # One line: with `indent` the json module falls back to its pure-Python encoder, 7x slower;
        # at a fleet's size that is seconds at the end of every sweep (`jq .` reads it either way).
        tmp.write_text(json.dumps(data, default=str))
        tmp.replace(self.path)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.write_sep("-", f"gpuhost evidence: {self.path}")

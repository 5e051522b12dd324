"""Evidence is rendered as pytest-html extras only when an HTML report will be written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = """
def test_a(target, remediate):
    remediate(name="a", check=lambda: __import__("pytest_gpuhost.run.remediation").run.remediation.Check(True, "fine"))
"""
CONFTEST = """
import json, os
def pytest_runtest_logreport(report):
    names = [e.get("name", "") for e in getattr(report, "extras", [])]
    with open(os.environ["EXTRAS_LOG"], "a") as f:
        f.write(json.dumps([report.when, names]) + "\\n")
"""


def _extras(tmp: Path, *args: str) -> list[list]:
    (tmp / "test_x.py").write_text(SUITE)
    (tmp / "conftest.py").write_text(CONFTEST)
    log = tmp / "extras.jsonl"
    log.unlink(missing_ok=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            # one target runs in the controller unless told: the path under test crosses a worker
            "--gpuhost-scheduling=workers",
            "--host=local://",
            *args,
            "test_x.py",
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "EXTRAS_LOG": str(log)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("with_html", [False, True])
def test_extras_only_with_an_html_report(tmp_path: Path, with_html: bool) -> None:
    got = _extras(tmp_path, *([] if with_html else ["--report-dir=none"]))
    call = [names for when, names in got if when == "call"]  # the worker's report, then the controller's
    assert len(call) == 2
    assert all(any(n.startswith("gpuhost evidence") for n in names) is with_html for names in call), got
    assert (tmp_path / "reports").is_dir() is with_html

"""The tree stays ruff- and mypy-clean (the project's own rule; CI enforces it here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e .[dev])")
    return found


@pytest.mark.parametrize(
    "argv",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy"]],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_clean(argv: list[str]) -> None:
    proc = subprocess.run([_tool(argv[0]), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def test_extensionless_python_scripts_are_linted() -> None:
    """The lab's tools without a .py suffix are in ruff's default file search (pyproject extend-include)."""
    scripts = [
        p
        for d in ("gpulab/tools", "gpulab/hosttools")
        for p in sorted((ROOT / d).iterdir())
        if p.is_file() and not p.suffix and p.read_bytes().startswith(b"#!/usr/bin/python3")
    ]
    assert scripts
    proc = subprocess.run(
        [_tool("ruff"), "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    shown = proc.stdout
    missing = [str(p.relative_to(ROOT)) for p in scripts if str(p) not in shown]
    assert not missing, f"not linted by `ruff check .`: {missing}"


def test_no_import_cycles_or_layer_breaks() -> None:
    """scripts/check_imports.py: imports only go down the layers, no cycle (gpulab/ included), no lab import."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/check_imports.py")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-4000:]


# A tracker's numbers ("issue" or "task" and a number, a session's or a stop's number) mean nothing
# outside the tracker. An upstream reference names its repository first (NVIDIA/nccl issue 257).
_TASK_NUMBER = re.compile(r"\b(?:issue|task|session|stop)s? \d{1,2}\b", re.I)
_REPO_BEFORE = re.compile(r"[\w.-]+/[\w.-]+ $")
_OWN = Path(__file__).resolve()


def task_numbers(line: str) -> list[str]:
    """The tracker numbers in one line (an upstream repository's issue is not one)."""
    return [m.group(0) for m in _TASK_NUMBER.finditer(line) if not _REPO_BEFORE.search(line[: m.start()])]


def test_task_numbers_are_found_and_upstream_issues_are_not() -> None:
    assert task_numbers("see issue 12 for why") == ["issue 12"]
    assert task_numbers("as in session 4, and Stop 33") == ["session 4", "Stop 33"]
    assert task_numbers("zzc0721/torch-performance-test-data issue 77 says so") == []
    assert task_numbers("NVIDIA/nccl#257, tissue 5, upstream issue #446, pct stop 101") == []


def test_no_task_numbers_in_code_or_docs() -> None:
    """History is in the commits and the CHANGELOG; code and docs say what is true now."""
    paths = [ROOT / "README.md"]
    for root in (
        "pytest_gpuhost",
        "suites",
        "gpulab",
        "scripts",
        "benchmarks",
        "docs",
        "fixtures",
        "tests",
        "deploy",
    ):
        paths += sorted(p for p in (ROOT / root).rglob("*") if p.is_file() and p.resolve() != _OWN)
    found = []
    for path in paths:
        if path.suffix not in (".py", ".md", ".yaml", ".sh", ".txt", ".c", ""):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {t!r}" for t in task_numbers(line)]
    assert found == [], "\n".join(found)

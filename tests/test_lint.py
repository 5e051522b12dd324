"""The tree stays ruff- and mypy-clean (the project's own rule; CI enforces it here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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

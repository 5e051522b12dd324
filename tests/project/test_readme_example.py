"""The README's example test runs as written, and fails (not passes) on a host without nvidia-smi."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (code,) = [b for b in blocks if "def test_" in b]
    return code


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_readme_example_fails_where_nvidia_smi_is_missing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_example=_example())
    result = pytester.runpytest("--host=local://", "--report-dir=none", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*nvidia-smi gave rc *"])

"""Each named safety check is guarded: scripts/mutate.py breaks it in a copy and a test must fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_named_safety_check_has_a_test_that_fails_without_it() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mutate.py")], capture_output=True, text=True, timeout=1200
    )
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "survived" not in r.stdout and " killed" in r.stdout

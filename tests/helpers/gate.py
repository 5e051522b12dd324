"""A gate: a step of a run in another process waits there until the test lets it go.

A concurrency test that starts a second run "while the first one holds X" and finds out with a
clock asserts a race: on a loaded machine the first run may have let go of X already. With a gate
the first run says it reached the point (a file the test waits for) and then waits, bounded, for
the test to open the gate (another file), so the state the test needs is held for as long as it
needs it. `GATE_WAIT` is the waiting half, for a plugin or a script that runs in the other process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

# Source of the waiting half: `gate_wait(reached, opened, note)` in the other process.
GATE_WAIT = '''
def gate_wait(reached, opened, note="", limit=240.0):
    """Say the gate is reached, then wait (at most `limit` s) for the test to open it."""
    import os, time
    with open(reached, "w") as fh:
        fh.write(note)
    deadline = time.monotonic() + limit
    while not os.path.exists(opened):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test did not open the gate {opened} within {limit:g} s")
        time.sleep(0.05)
'''


class Gate:
    """The test's half: wait until the other process reached the gate, then open it."""

    def __init__(self, folder: Path) -> None:
        self.reached = folder / "gate.reached"
        self.opened = folder / "gate.open"

    def env(self) -> dict[str, str]:
        """Return the variables that tell the other process where the two files are."""
        return {"GPUHOST_TEST_GATE_REACHED": str(self.reached), "GPUHOST_TEST_GATE_OPEN": str(self.opened)}

    def wait_reached(self, timeout: float, alive: Callable[[], bool] = lambda: True) -> str:
        """Wait until the other process is at the gate; return its note. Fail when it stopped first."""
        deadline = time.monotonic() + timeout
        while not self.reached.exists():
            if not alive():
                raise AssertionError(f"the other process ended before it reached the gate ({self.reached})")
            if time.monotonic() > deadline:
                raise AssertionError(f"the other process did not reach the gate within {timeout:g} s")
            time.sleep(0.05)
        return self.reached.read_text()

    def open(self) -> None:
        """Let the other process go on."""
        self.opened.write_text("open")


def wait_blocked(state: str | Path, bdf: str, since: int = 0, timeout: float = 20) -> None:
    """Wait until the lab's sysfs recorded a write for `bdf` that blocks (after record `since`).

    The lab records "blocked" as the write starts waiting in the kernel model, so a test that
    waits for it knows the writer is held, where a sleep only hopes so.
    """
    import json

    path = Path(state) / "record.jsonl"
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines()[since:] if path.exists() else []
        if any(json.loads(x).get("value") == bdf and json.loads(x).get("result") == "blocked" for x in lines):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no blocked write of {bdf} recorded in {path} within {timeout:g} s")
        time.sleep(0.05)

"""A target that cannot be reached is said once per host, not once per check.

Every check of a host that does not answer fails with the same connect error. pytest would print
each as an error with its own header and short-summary line: a wall of identical failures for
one cause. The host's first phase that failed on an `Unreachable` is shown as any failure
(its one-line message, its hints); the later ones get the terminal category `unreachable`
instead (pytest's counts line says "1 error, 26 unreachable"; each phase stays failed, so the
exit status and the JUnit, JSON and fleet outcomes are unchanged). Each report carries
`gpuhost_unreachable`, the reason, which the run record keeps per check (the JSON evidence's
and the fleet summary's `unreachable`). From it the fleet summary's terminal lines and the
host's answer say one line per host: "gpu-07: unreachable: ssh: connect to host ... timed out;
27 checks not run" (report/summary.py, report/answer.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.errors import Unreachable
from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run.record import target_name

__all__ = [
    "CATEGORY",
    "NOT_RETRIED",
    "mark",
    "note",
    "reason_of",
    "teststatus",
]

_said = pytest.StashKey[str]()
_hosts_said = pytest.StashKey[set[str]]()

CATEGORY = "unreachable"
#: The tail a target's later connects add to its first connect error (run/targets_stash.py).
NOT_RETRIED = " (first connect of this run failed; not retried)"


def reason_of(exc: BaseException) -> str:
    """Why a target could not be reached, in one redacted line without the not-retried tail."""
    text = " ".join(str(exc).split()).replace(NOT_RETRIED.strip(), "").strip()
    return printable(redact(text))


def note(item: pytest.Item, exc: BaseException) -> None:
    """Say that `item` fails next because its target is unreachable (a fixture that fails it in words).

    A suite that turns the connection's error into its own one-line `pytest.fail` (no traceback
    per check) calls this first, so the phase is still known as unreachable.
    """
    if isinstance(exc, Unreachable):
        item.stash[_said] = reason_of(exc)


def mark(item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport) -> None:
    """Mark a phase that failed because its target could not be reached (and whether it was said)."""
    exc = call.excinfo.value if call.excinfo is not None else None
    said = item.stash.get(_said, "")
    if not (report.failed and (isinstance(exc, Unreachable) or said)):
        return
    report.gpuhost_unreachable = reason_of(exc) if isinstance(exc, Unreachable) else said  # type: ignore[attr-defined]
    # the host's first such phase is a failure like any (its message, its hints); the rest repeat it
    # (one process sees all of a host's tests: run/scheduling.py groups them per worker)
    hosts = item.config.stash.setdefault(_hosts_said, set())
    target = target_name(item) or item.nodeid
    report.gpuhost_unreachable_again = target in hosts  # type: ignore[attr-defined]
    hosts.add(target)


def teststatus(report: pytest.TestReport) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    """The terminal category of an unreachable phase: counted, not listed as an error."""
    again: Any = getattr(report, "gpuhost_unreachable_again", None)
    if report.failed and again:
        return CATEGORY, "U", ("UNREACHABLE", {"red": True, "bold": True})
    return None

"""Read the counts of a pytest run's final summary line, the way a test means them.

pytest's `RunResult.parseoutcomes` keeps one word per count, so the plugin's "2 would fix" reads
as "would"; and a summary compared verbatim breaks when the run adds "N warnings" (an in-process
`runpytest` in a session started by the `pytest` script warns that the already imported plugin
cannot be assert-rewritten). Warnings are not outcomes: they are left out here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_FINAL = re.compile(r"^=+ (?P<counts>.*?) in [0-9.]+s\b.*=+$")
_COUNT = re.compile(r"^(?P<n>\d+) (?P<what>[a-z][a-z ]*)$")


def outcome_counts(lines: Iterable[str]) -> dict[str, int]:
    """Return {outcome: count} from the last summary line ("1 failed, 2 would fix in 1.2s")."""
    final = next((m for line in reversed(list(lines)) if (m := _FINAL.match(line))), None)
    if final is None:
        raise AssertionError("no final summary line in the run's output")
    counts: dict[str, int] = {}
    for part in final["counts"].split(", "):
        m = _COUNT.match(part.strip())
        if m is None:
            raise AssertionError(f"unexpected count {part!r} in {final.group(0)!r}")
        what = m["what"]
        if what not in ("warning", "warnings"):
            counts[{"error": "errors"}.get(what, what)] = int(m["n"])
    return counts

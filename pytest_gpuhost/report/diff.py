"""Before/after states as a unified diff, as Ansible's `--check --diff` shows a changed file.

A state is whatever a check read (`Check.state`): often a mapping whose values are file
contents, unit settings or sysfs values. Each key that changed gets its own `--- before: KEY` /
`+++ after: KEY` section; text is diffed line by line (difflib), other values as indented JSON.
"""

from __future__ import annotations

import difflib
import html
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["render_diff", "state_diff"]

#: Context lines around each change, as `diff -u`.
CONTEXT = 3


def _lines(value: Any) -> list[str]:
    if isinstance(value, str):
        return value.splitlines()
    return json.dumps(value, indent=1, sort_keys=True, default=str).splitlines()


def _section(name: str, before: Any, after: Any) -> list[str]:
    return list(
        difflib.unified_diff(
            _lines(before), _lines(after), f"before: {name}", f"after: {name}", n=CONTEXT, lineterm=""
        )
    )


def state_diff(before: Any, after: Any) -> list[str]:
    """Return the unified diff of two states (empty when they are the same)."""
    if before == after:
        return []
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        out: list[str] = []
        for key in list(dict.fromkeys([*before, *after])):
            if before.get(key) != after.get(key):
                out += _section(str(key), before.get(key, ""), after.get(key, ""))
        return out
    return _section("state", before, after)


def render_diff(lines: list[str]) -> str:
    """Render diff lines as a `<pre>` with added and removed lines marked (escaped)."""
    if not lines:
        return ""
    out = []
    for line in lines:
        cls = ""
        if line.startswith(("+++", "---")):
            cls = "gh-file"
        elif line.startswith("@@"):
            cls = "gh-hunk"
        elif line.startswith("+"):
            cls = "gh-add"
        elif line.startswith("-"):
            cls = "gh-del"
        out.append(f'<span class="{cls}">{html.escape(line)}</span>' if cls else html.escape(line))
    return '<pre class="gh-diff">' + "\n".join(out) + "</pre>"

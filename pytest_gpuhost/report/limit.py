"""`--limit EXPR`: which targets a run keeps, by name or inventory group.

The pattern language (Ansible's `a:b`, `a,b`, `a:&b`, `a:!b`, `all`, globs, `~regex`,
subscripts, `@file`, and our `and`/`or`/`not`) lives with the inventory, in
`pytest_gpuhost.exec.inventory_pattern`; this module keeps the names the report layer used.
"""

from __future__ import annotations

from pytest_gpuhost.exec.inventory_pattern import HostPattern, PatternError, compile_pattern, spec_groups

__all__ = ["LimitError", "Matcher", "compile_limit", "spec_groups"]

#: A compiled pattern: `select(targets)`, or `match(name, groups) -> bool` for one host.
Matcher = HostPattern
#: A --limit pattern that does not parse or names nothing (a TargetError, so a GpuhostError).
LimitError = PatternError


def compile_limit(expr: str) -> HostPattern:
    """Compile a `--limit` pattern; raise LimitError naming the bad term."""
    return compile_pattern(expr)

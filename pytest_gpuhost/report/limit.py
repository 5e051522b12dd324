"""`--limit EXPR`: which targets a run keeps, by name or inventory group.

A word matches a host when it equals (or, with `*`/`?`/`[...]`, glob-matches) the host's name
or one of its groups (`spec.vars["groups"]`); words combine with `and`, `or`, `not` and
parentheses as in `-k`. Pure logic: the option and the hook that applies it are in `fleet.py`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import Any

from pytest_gpuhost.errors import GpuhostError

__all__ = ["LimitError", "Matcher", "compile_limit", "spec_groups"]

#: A compiled expression: `match(name, groups) -> bool`.
Matcher = Callable[[str, Sequence[str]], bool]


class LimitError(GpuhostError):
    """A --limit expression does not parse; the message points at the offending token."""


_TOKEN = re.compile(r"\s*(?:(\()|(\))|([^\s()]+))")


def compile_limit(expr: str) -> Matcher:
    """Compile a `--limit` expression into `match(name, groups) -> bool`."""
    tokens: list[str] = []
    pos = 0
    text = expr.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise LimitError(f"cannot read {text[pos:]!r}")
        tokens.append(m.group(1) or m.group(2) or m.group(3))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    if not tokens:
        raise LimitError("empty expression")
    i = 0

    def peek() -> str | None:
        return tokens[i] if i < len(tokens) else None

    def take() -> str:
        nonlocal i
        tok = tokens[i]
        i += 1
        return tok

    def parse_or() -> Matcher:
        left = parse_and()
        while peek() == "or":
            take()
            right = parse_and()
            left = (lambda a, b: lambda n, g: a(n, g) or b(n, g))(left, right)
        return left

    def parse_and() -> Matcher:
        left = parse_not()
        while peek() == "and":
            take()
            right = parse_not()
            left = (lambda a, b: lambda n, g: a(n, g) and b(n, g))(left, right)
        return left

    def parse_not() -> Matcher:
        if peek() == "not":
            take()
            inner = parse_not()
            return lambda n, g: not inner(n, g)
        return parse_primary()

    def parse_primary() -> Matcher:
        tok = peek()
        if tok is None:
            raise LimitError(f"expression ends early: {expr!r}")
        if tok == "(":
            take()
            inner = parse_or()
            if peek() != ")":
                raise LimitError(f"missing ')' in {expr!r}")
            take()
            return inner
        if tok in (")", "and", "or", "not"):
            raise LimitError(f"unexpected {tok!r} in {expr!r}")
        word = take()
        return lambda n, g: fnmatch.fnmatchcase(n, word) or any(fnmatch.fnmatchcase(x, word) for x in g)

    node = parse_or()
    if i != len(tokens):
        raise LimitError(f"unexpected {tokens[i]!r} in {expr!r}")
    return node


def spec_groups(spec: Any) -> list[str]:
    """Return a target spec's inventory groups as strings."""
    groups = (getattr(spec, "vars", None) or {}).get("groups") or []
    return [str(g) for g in groups] if isinstance(groups, list | tuple) else [str(groups)]

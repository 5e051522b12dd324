"""Host patterns for `--limit`: Ansible's syntax, and our `and`/`or`/`not` expressions.

Ansible's (https://docs.ansible.com/ansible/latest/inventory_guide/intro_patterns.html):
`a:b` or `a,b` (union), `a:&b` (also in b), `a:!b` (not in b), `all` or `*`, globs (`gpu-0*`),
regular expressions (`~gpu-0[1-3]`, matched from the start of the name, as Ansible does),
subscripts (`rack1[0]`, `rack1[0:2]` inclusive, `rack1[1:]`, `rack1[-1]`), `@FILE` (one pattern a
line). As in Ansible, the union is taken first, then the `&` terms, then the `!` terms, wherever
they are written. Each term names hosts or groups (a group selects all its hosts).

Ours, kept from before: words joined by `and`, `or`, `not` and parentheses, as in `-k`; each word
is itself an Ansible pattern (`rack1 and not gpu-0*`, `(rack1 or rack2) and ~gpu-0[1-3]`).

A term that matches no host or group is an error naming it (Ansible only warns; a typo in
`all:!prod` would otherwise run on prod), and so is a pattern that selects nothing.
A subscript whose base names nothing is read as a glob (`node0[12]` matches node01, node02).
"""

from __future__ import annotations

import difflib
import fnmatch
import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pytest_gpuhost.errors import TargetError

__all__ = ["HostPattern", "PatternError", "compile_pattern", "spec_groups"]

T = TypeVar("T")
_SUBSCRIPT = re.compile(r"^(.+)\[(?:(-?[0-9]+)|([0-9]+)([:-])([0-9]+)?)\]\Z")
_COLON_TERMS = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")
_KEYWORDS = ("and", "or", "not", "(", ")")


class PatternError(TargetError):
    """A host pattern does not parse, or names nothing; the message names the term."""


def spec_groups(spec: Any) -> list[str]:
    """Return a target spec's inventory groups as strings."""
    groups = (getattr(spec, "vars", None) or {}).get("groups") or []
    return [str(g) for g in groups] if isinstance(groups, list | tuple) else [str(groups)]


@dataclass(frozen=True)
class _Atom:
    """One term, without its `&`/`!`: all, a glob, a regex, or either with a subscript."""

    text: str
    test: Callable[[str], Any]
    subscript: tuple[int, int | None] | None = None
    base: Callable[[str], Any] | None = None  # the subscript's base, matched like `test`

    def matches(self, name: str, groups: Sequence[str], test: Callable[[str], Any] | None = None) -> bool:
        t = test or self.test
        return bool(t(name)) or any(t(g) for g in groups)


def _atom(text: str) -> _Atom:
    if not text:
        raise PatternError("an empty term (two separators in a row, or one at an end)")
    if text in ("all", "*"):
        return _Atom(text, lambda _: True)
    if text.startswith("~"):
        try:
            rx = re.compile(text[1:])
        except re.error as exc:
            raise PatternError(f"term {text!r}: bad regular expression ({exc})") from None
        return _Atom(text, rx.match)
    glob = re.compile(fnmatch.translate(text)).match
    m = _SUBSCRIPT.match(text)
    if m:
        base, single, start, _, end = m.groups()
        sub = (int(single), None) if single is not None else (int(start), int(end) if end else -1)
        return _Atom(text, glob, sub, re.compile(fnmatch.translate(base)).match)
    return _Atom(text, glob)


# A node: ("atom", _Atom) | ("ansible", plain, required, excluded) | ("or"|"and", a, b) | ("not", a)
Node = tuple[Any, ...]


def _terms(part: str) -> list[str]:
    bare = part.lstrip("&!")
    if bare.startswith("~"):
        return [part]
    try:
        ipaddress.ip_address(bare)
        return [part]
    except ValueError:
        return _COLON_TERMS.findall(part)


def _compound(text: str) -> Node:
    if any(c.isspace() for c in text.strip()):
        raise PatternError(
            f"{text.strip()!r}: terms are joined by ',' or ':' (or by and/or/not), not by spaces"
        )
    parts = text.split(",") if "," in text else [text]
    terms = [t for p in parts for t in ([p] if not p else _terms(p))]
    if not terms or any(not t or t in "&!" for t in terms):
        raise PatternError(f"{text!r} has an empty term (a separator at an end, or two in a row)")
    plain = [_atom(t) for t in terms if t[0] not in "&!"]
    required = [_atom(t[1:]) for t in terms if t[0] == "&"]
    excluded = [_atom(t[1:]) for t in terms if t[0] == "!"]
    if len(terms) == 1 and plain:
        return ("atom", plain[0])
    return ("ansible", plain, required, excluded)


def _tokens(text: str) -> list[str] | None:
    """Split an and/or/not expression into tokens; None when `text` is a plain Ansible pattern."""
    out: list[str] = []
    for word in text.split():
        while word.startswith("("):
            out.append("(")
            word = word[1:]
        closing = 0
        regex = word.lstrip("&!").startswith("~")
        while word.endswith(")") and (not regex or word.count(")") > word.count("(")):
            closing += 1
            word = word[:-1]
        if word:
            out.append(word)
        out.extend(")" * closing)
    return out if any(t in _KEYWORDS for t in out) else None


def _boolean(tokens: list[str], text: str) -> Node:
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expr() -> Node:
        node = conj()
        while peek() == "or":
            take()
            node = ("or", node, conj())
        return node

    def conj() -> Node:
        node = neg()
        while peek() == "and":
            take()
            node = ("and", node, neg())
        return node

    def neg() -> Node:
        if peek() == "not":
            take()
            return ("not", neg())
        tok = peek()
        if tok is None:
            raise PatternError(f"expression ends early: {text!r}")
        if tok == "(":
            take()
            node = expr()
            if peek() != ")":
                raise PatternError(f"missing ')' in {text!r}")
            take()
            return node
        if tok in _KEYWORDS:
            raise PatternError(f"unexpected {tok!r} in {text!r}")
        return _compound(take())

    node = expr()
    if pos != len(tokens):
        raise PatternError(f"unexpected {tokens[pos]!r} in {text!r}")
    return node


def _atoms(node: Node) -> Iterable[_Atom]:
    if node[0] == "atom":
        yield node[1]
    elif node[0] == "ansible":
        for group in node[1:]:
            yield from group
    else:
        for child in node[1:]:
            yield from _atoms(child)


class HostPattern:
    """A compiled pattern: `select(specs)` for a run's targets, or `(name, groups)` for one host."""

    def __init__(self, text: str) -> None:
        self.text = text
        body = text.strip()
        if body.startswith("@"):
            try:
                lines = Path(body[1:]).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise PatternError(
                    f"cannot read the host list {body[1:]!r}: {getattr(exc, 'strerror', exc)}"
                ) from None
            body = ",".join(x.strip() for x in lines if x.strip() and not x.lstrip().startswith("#"))
        if not body:
            raise PatternError("empty pattern")
        tokens = _tokens(body)
        self.tree: Node = _boolean(tokens, body) if tokens is not None else _compound(body)
        self.atoms = list(_atoms(self.tree))

    def _eval(self, node: Node, everyone: set[int], sets: dict[int, set[int]]) -> set[int]:
        kind = node[0]
        if kind == "atom":
            return sets[id(node[1])]
        if kind == "ansible":
            plain, required, excluded = node[1:]
            out = set().union(*(sets[id(a)] for a in plain)) if plain else set(everyone)
            for a in required:
                out &= sets[id(a)]
            for a in excluded:
                out -= sets[id(a)]
            return out
        if kind == "not":
            return everyone - self._eval(node[1], everyone, sets)
        left, right = self._eval(node[1], everyone, sets), self._eval(node[2], everyone, sets)
        return left | right if kind == "or" else left & right

    def __call__(self, name: str, groups: Sequence[str]) -> bool:
        """Return whether one host matches (no subscripts: they need the whole host list)."""
        sets = {}
        for a in self.atoms:
            if a.subscript is not None:
                raise PatternError(f"term {a.text!r}: a subscript needs the whole host list (use select)")
            sets[id(a)] = {0} if a.matches(name, groups) else set()
        return bool(self._eval(self.tree, {0}, sets))

    def select(self, specs: Iterable[T]) -> list[T]:
        """Return the specs the pattern selects, in their order; raise PatternError if any term names nothing."""
        items = list(specs)
        names = [str(getattr(s, "name", s)) for s in items]
        groups = [spec_groups(s) for s in items]
        everyone = set(range(len(items)))
        sets: dict[int, set[int]] = {}
        unmatched = []
        for a in self.atoms:
            found = {i for i in everyone if a.matches(names[i], groups[i])}
            if a.subscript is not None:
                base = sorted(i for i in everyone if a.matches(names[i], groups[i], a.base))
                if base:
                    found = self._subscript(a, base)
            sets[id(a)] = found
            if not found:
                unmatched.append(a.text)
        if unmatched:
            known = sorted(set(names) | {g for gs in groups for g in gs})
            hint = (
                difflib.get_close_matches(unmatched[0], known, n=1, cutoff=0.6) if len(known) < 20000 else []
            )
            mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            terms = ", ".join(repr(t) for t in unmatched)
            raise PatternError(
                f"{terms} match{'es' if len(unmatched) == 1 else ''} no host or group of the {len(items)} targets{mean}"
            )
        chosen = self._eval(self.tree, everyone, sets)
        if not chosen:
            raise PatternError(f"{self.text.strip()!r} selects none of the {len(items)} targets")
        return [items[i] for i in sorted(chosen)]

    @staticmethod
    def _subscript(a: _Atom, base: list[int]) -> set[int]:
        assert a.subscript is not None
        start, end = a.subscript
        if end is None:
            if not -len(base) <= start < len(base):
                raise PatternError(
                    f"term {a.text!r}: index {start} is outside the {len(base)} hosts it names"
                )
            return {base[start]}
        stop = len(base) if end == -1 else end + 1
        return set(base[start:stop])


def compile_pattern(text: str) -> HostPattern:
    """Compile a `--limit` pattern; raise PatternError (one line, naming the bad term) if it does not parse."""
    return HostPattern(text)

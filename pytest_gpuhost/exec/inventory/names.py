"""Inventory host names: Ansible's host ranges, `name:port`, and the check every name passes.

A host key may hold ranges as Ansible writes them: `node[0:99]`, `node[01:99:2]` (a leading zero
fixes the width; both ends then have it), `rack[a:f]`; several ranges in one key combine. The
number of hosts a key gives is computed before any is made and refused beyond `MAX_HOSTS`; the
names are then generated one at a time, so a key costs its own hosts and nothing more.

Names are hostile input (they become test ids, file names and HTML): every name must be a host
name (labels of letters, digits, `_` and `-`) or an IP address, the rule `ssh://` URLs follow, and
anything else (markup, spaces, control characters, a leading `-`) is refused with one line.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterator, Sequence

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.hostnames import valid_host_name

__all__ = ["MAX_HOSTS", "expand_host_key", "valid_host_name", "valid_group_name"]

#: The most hosts one inventory (and so one range) may hold: a typo such as `node[0:99999999]`
#: is refused at once instead of building a hundred million targets.
MAX_HOSTS = 100_000

_RANGE = re.compile(r"\[([^\[\]]*:[^\[\]]*)\]")
_GROUP = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
_IPV6_PORT = re.compile(r"^\[([0-9A-Fa-f:.]+)\](?::([0-9]+))?\Z")
_LETTERS = string.ascii_letters


def valid_group_name(name: str) -> bool:
    """Return whether `name` may name a group: letters, digits, `_`, `.`, `-`, not leading `-`/`.`."""
    return len(name) <= 255 and bool(_GROUP.match(name))


def _items(spec: str, where: str, key: str) -> Sequence[str]:
    """Return the lazily indexable items of one bracket `beg:end[:step]`."""
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise TargetError(f"{where}: host range {key!r}: write [begin:end] or [begin:end:step]")
    beg, end = parts[0] or "0", parts[1]
    step_text = parts[2] if len(parts) == 3 else "1"
    if not (step_text.isdigit() and 0 < len(step_text) < 10 and int(step_text) > 0):
        raise TargetError(f"{where}: host range {key!r}: the step must be a positive number")
    step = int(step_text)
    if len(beg) == 1 and len(end) == 1 and beg in _LETTERS and end in _LETTERS:
        lo, hi = _LETTERS.index(beg), _LETTERS.index(end)
        if lo > hi:
            raise TargetError(f"{where}: host range {key!r}: the begin {beg!r} comes after the end {end!r}")
        return _LETTERS[lo : hi + 1 : step]
    if (
        not (beg.isdigit() and end.isdigit() and beg.isascii() and end.isascii())
        or max(len(beg), len(end)) > 12
    ):
        raise TargetError(
            f"{where}: host range {key!r}: expected numbers of at most 12 digits or single letters, as in [01:99] or [a:f]"
        )
    width = 0
    if beg.startswith("0") and len(beg) > 1:
        if len(beg) != len(end):
            raise TargetError(
                f"{where}: host range {key!r}: a zero-padded begin needs an end of the same width"
            )
        width = len(beg)
    if int(beg) > int(end):
        raise TargetError(f"{where}: host range {key!r}: the begin {beg} is greater than the end {end}")
    return _Numbers(range(int(beg), int(end) + 1, step), width)


class _Numbers(Sequence[str]):
    """Zero-padded numbers of a range, made on demand (a range of 10**5 holds no strings)."""

    def __init__(self, numbers: range, width: int) -> None:
        self.numbers, self.width = numbers, width

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, index):  # type: ignore[no-untyped-def,override]
        return str(self.numbers[index]).zfill(self.width)

    def __iter__(self) -> Iterator[str]:
        width = self.width
        return (str(n).zfill(width) for n in self.numbers)


def _split_port(key: str) -> tuple[str, int | None]:
    """Split Ansible's `host:port` (and `[v6-address]:port`); ranges and bare IPv6 keep their colons."""
    m = _IPV6_PORT.match(key)
    if m:
        return m.group(1), int(m.group(2)) if m.group(2) else None
    head, sep, port = key.rpartition(":")
    if sep and port.isdigit() and ":" not in _RANGE.sub("", head) and "]" not in port:
        return head, int(port)
    return key, None


def expand_host_key(key: str, where: str) -> tuple[int, Iterator[str], int | None]:
    """Return (count, names, port) for an inventory host key; raise TargetError if it is bad.

    A key giving more than `MAX_HOSTS` names is refused before any is made; each name is
    checked with `valid_host_name` as it is made.
    """
    if len(key) > 1000:
        raise TargetError(f"{where}: host name {key[:40]!r}... is longer than 1000 characters")
    base, port = _split_port(key)
    if port is not None and not 0 < port < 65536:
        raise TargetError(f"{where}: host {key!r}: port {port} is not a number from 1 to 65535")
    pieces: list[Sequence[str]] = []
    pos = 0
    for m in _RANGE.finditer(base):
        pieces.append((base[pos : m.start()],))
        pieces.append(_items(m.group(1), where, key))
        pos = m.end()
    pieces.append((base[pos:],))
    count = 1
    for piece in pieces:
        count *= len(piece)
    if count > MAX_HOSTS:
        raise TargetError(
            f"{where}: host range {key!r} gives {count:,} hosts, over the limit of {MAX_HOSTS:,} hosts"
            " (split the fleet into several inventories)"
        )

    def combine(i: int, prefix: str) -> Iterator[str]:
        if i == len(pieces):
            yield prefix
            return
        for item in pieces[i]:
            yield from combine(i + 1, prefix + item)

    def names() -> Iterator[str]:
        for name in combine(0, ""):
            if not valid_host_name(name):
                raise TargetError(
                    f"{where}: host name {name!r} is not a host name or an IP address"
                    " (letters, digits, '-', '_' and '.'; markup and control characters are refused)"
                )
            yield name

    return count, names(), port

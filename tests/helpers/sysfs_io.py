"""Reading and writing sysfs files the way a shell does, for the lab's kernel tests."""

from __future__ import annotations

import os
from pathlib import Path


def sysw(p: str | Path, value: str) -> None:
    """Write like ``echo value > p``: one write(2), errors as OSError."""
    fd = os.open(p, os.O_WRONLY)
    try:
        os.write(fd, (value + "\n").encode())
    finally:
        os.close(fd)


def errno_of(p: str | Path, value: str) -> int:
    """The errno of ``echo value > p`` (0 when the write succeeds)."""
    try:
        sysw(p, value)
    except OSError as e:
        return e.errno or -1
    return 0


def rd(p: str | Path) -> str:
    """The file's text, stripped, as ``cat p`` shows it."""
    with open(p) as f:
        return f.read().strip()

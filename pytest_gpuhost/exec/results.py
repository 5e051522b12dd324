"""What commands and watched writes return: `CommandResult` (also the evidence record), `WriteResult`."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

__all__ = ["CommandResult", "WriteResult", "describe_write"]


@dataclass
class CommandResult:
    """What every command returns; also the evidence record."""

    target: str
    command: str
    rc: int
    stdout: str
    stderr: str
    start: float
    duration: float
    timed_out: bool = False

    def __post_init__(self) -> None:
        self._stdout_bytes: bytes | None = None
        self._stderr_bytes: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    @property
    def stdout_bytes(self) -> bytes:
        """The exact bytes printed (stdout is decoded with replacement characters)."""
        return self._stdout_bytes if self._stdout_bytes is not None else self.stdout.encode("utf-8")

    @property
    def stderr_bytes(self) -> bytes:
        return self._stderr_bytes if self._stderr_bytes is not None else self.stderr.encode("utf-8")

    def summary(self) -> str:
        """One line: the command and how it ended."""
        how = "timed out" if self.timed_out else f"exited {self.rc}"
        tail = (self.stderr.strip().splitlines() or [""])[-1]
        return f"`{self.command}` on {self.target} {how}" + (f": {tail}" if tail else "")


@dataclass
class WriteResult:
    """Outcome of a watched write (sysfs, FIFO, file)."""

    path: str
    ok: bool
    errno: int | None = None
    error: str | None = None
    timed_out: bool = False
    duration: float = 0.0

    def as_oserror(self) -> OSError:
        return OSError(self.errno or 0, self.error or "write failed", self.path)


def describe_write(path: str, data: str | bytes, mode: str) -> str:
    """Return how a write reads in evidence: `echo VALUE > PATH` for a short line, else its size."""
    op = ">>" if mode == "a" else ">"
    if isinstance(data, str) and len(data) <= 200 and "\n" not in data.rstrip("\n"):
        return f"echo {shlex.quote(data.rstrip(chr(10)))} {op} {shlex.quote(path)}"
    return f"write {len(data)} bytes {op} {shlex.quote(path)}"

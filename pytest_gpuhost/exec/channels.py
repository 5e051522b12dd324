"""Byte channels to programs on a target: the interface, and a local child process.

A `RawChannel` is one program running on a target: its stdin, its stdout, a stderr tail and its
exit status.  `ProcessChannel` is a child process of this one (local targets, `docker exec`, and
the OpenSSH client that carries bulk channels); the paramiko exec channel is in `ssh/paramiko_channel.py`.
"""

from __future__ import annotations

import fcntl
import os
import select
import shlex
import subprocess
import time
from collections import deque
from collections.abc import Mapping, Sequence

__all__ = ["ProcessChannel", "RawChannel"]

_STDERR_KEEP = 64 * 1024
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_BULK_PIPE = 1 << 20


class RawChannel:
    """A program running on a target: write its stdin, read its stdout, see its stderr tail.

    `recv` blocks at most `timeout` seconds and returns b"" at EOF; it raises `TimeoutError`
    when nothing arrived in time.  Stderr is drained as a side effect of reading stdout and kept
    (the last 64 KiB) for error messages, so a chatty program never blocks on a full pipe.
    """

    label: str = ""

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def close_stdin(self) -> None:
        raise NotImplementedError

    def recv(self, timeout: float | None) -> bytes:
        raise NotImplementedError

    def read_exact(self, n: int, timeout: float | None) -> bytes:
        """Read exactly `n` bytes of stdout (less only at EOF); each wait bounded by `timeout`."""
        buf = bytearray(self._pushback)
        self._pushback = b""
        while len(buf) < n:
            data = self.recv(timeout)
            if not data:
                break
            buf += data
        if len(buf) > n:
            self._pushback = bytes(buf[n:])
            del buf[n:]
        return bytes(buf)

    _pushback: bytes = b""
    _stderr: deque[bytes]
    _stderr_len: int

    def _keep_stderr(self, data: bytes) -> None:
        """Keep `data` in the stderr tail, dropping the oldest pieces beyond 64 KiB."""
        self._stderr.append(data)
        self._stderr_len += len(data)
        while self._stderr_len > _STDERR_KEEP and len(self._stderr) > 1:
            self._stderr_len -= len(self._stderr.popleft())

    def stderr_text(self) -> str:
        raise NotImplementedError

    def exit_status(self, timeout: float = 0.0) -> int | None:
        """Return the exit status, waiting up to `timeout` s; None while it still runs."""
        raise NotImplementedError

    def lost(self) -> bool:
        """Whether the channel ended without an exit status because the link to the target went."""
        return False

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> RawChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProcessChannel(RawChannel):
    """A local child process, in its own session so closing it can kill its whole group."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        label: str | None = None,
        bulk: bool = False,
    ) -> None:
        self.label = label or shlex.join(argv)
        full_env = None
        if env:
            full_env = dict(os.environ)
            full_env.update(env)
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self._in = self.proc.stdin.fileno()
        self._out = self.proc.stdout.fileno()
        self._err: int | None = self.proc.stderr.fileno()
        self._stderr: deque[bytes] = deque()
        self._stderr_len = 0
        self._eof = False
        self._read_size = 65536
        if bulk:
            try:  # fewer, larger reads; the kernel may refuse a size above pipe-max-size
                fcntl.fcntl(self._out, _F_SETPIPE_SZ, _BULK_PIPE)
                self._read_size = _BULK_PIPE
            except OSError:
                pass

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._in, view)
                view = view[n:]
        except BrokenPipeError:
            pass  # the reader sees EOF and reports the death with the exit status

    def close_stdin(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def recv(self, timeout: float | None) -> bytes:
        if self._pushback:
            data, self._pushback = self._pushback, b""
            return data
        if self._eof:
            return b""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            fds = [self._out] if self._err is None else [self._out, self._err]
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(fds, [], [], wait)
            if not ready:
                raise TimeoutError("no data within %.1fs" % (timeout or 0))
            if self._err is not None and self._err in ready:
                chunk = os.read(self._err, 65536)
                if chunk:
                    self._keep_stderr(chunk)
                else:
                    self._err = None
            if self._out in ready:
                data = os.read(self._out, self._read_size)
                if not data:
                    self._eof = True
                return data

    def stderr_text(self) -> str:
        if self._err is not None:
            while select.select([self._err], [], [], 0)[0]:
                chunk = os.read(self._err, 65536)
                if not chunk:
                    self._err = None
                    break
                self._keep_stderr(chunk)
        return b"".join(self._stderr).decode("utf-8", "replace")

    def exit_status(self, timeout: float = 0.0) -> int | None:
        try:
            return self.proc.wait(timeout=timeout) if timeout > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        self.close_stdin()
        if self.exit_status(1.0) is None:
            try:
                os.killpg(self.proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            self.exit_status(1.0)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()

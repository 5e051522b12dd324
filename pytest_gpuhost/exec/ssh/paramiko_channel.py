"""One exec channel on a paramiko SSH transport, as a `RawChannel` (ssh/paramiko.py opens them)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from pytest_gpuhost.exec.channels import RawChannel

if TYPE_CHECKING:
    import paramiko

__all__ = ["SSHChannel"]


class SSHChannel(RawChannel):
    """One exec channel on an SSH transport."""

    def __init__(self, chan: paramiko.Channel, label: str) -> None:
        self.chan = chan
        self.label = label
        self._stderr: deque[bytes] = deque()
        self._stderr_len = 0

    def send(self, data: bytes) -> None:
        try:
            self.chan.sendall(data)
        except OSError:
            pass  # closed: the reader sees EOF

    def close_stdin(self) -> None:
        try:
            self.chan.shutdown_write()
        except (OSError, EOFError):
            pass

    def _drain_stderr(self) -> None:
        while self.chan.recv_stderr_ready():
            chunk = self.chan.recv_stderr(65536)
            if not chunk:
                break
            self._keep_stderr(chunk)

    def recv(self, timeout: float | None) -> bytes:
        if self._pushback:
            data, self._pushback = self._pushback, b""
            return data
        self.chan.settimeout(timeout)
        try:
            data = self.chan.recv(65536)
        except TimeoutError as exc:  # socket.timeout is TimeoutError
            self._drain_stderr()
            raise TimeoutError("no data within %.1fs" % (timeout or 0)) from exc
        self._drain_stderr()
        return data

    def stderr_text(self) -> str:
        self._drain_stderr()
        return b"".join(self._stderr).decode("utf-8", "replace")

    def exit_status(self, timeout: float = 0.0) -> int | None:
        if self.chan.status_event.wait(timeout) if timeout > 0 else self.chan.exit_status_ready():
            return self.chan.recv_exit_status()
        return None

    def lost(self) -> bool:
        # paramiko leaves -1 when the channel closed without an exit status (a program killed
        # by a signal also sends none): only a transport that is gone means the link went.
        transport = self.chan.get_transport()
        return self.chan.exit_status == -1 and (transport is None or not transport.is_active())

    def close(self) -> None:
        self.close_stdin()
        self.chan.close()

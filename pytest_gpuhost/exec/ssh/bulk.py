"""Bulk channels of a paramiko transport under the OpenSSH client, with a fallback to paramiko.

Targets are reached through the OpenSSH client wherever `ssh` exists (ssh/openssh.py, where bulk
channels ride the ControlMaster); this module serves a paramiko `SSHTransport` built by hand on
a machine that has `ssh` (benchmarks, tests).  A program that moves many megabytes (the backup stream) runs under the OpenSSH client when `ssh`
is installed, with the same identity, the same known_hosts file under StrictHostKeyChecking=yes,
and no user config: OpenSSH's C transport moved 839 MB in about 2 s here (AES-GCM), where
paramiko took about 7 s.  A bulk channel on which the client cannot log in (ssh exits 255 before
the program printed a byte) is replaced, transparently, by a paramiko channel that gets the same
stdin; the paramiko transport (ssh/paramiko.py) then keeps later bulk channels on paramiko and says why.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from pytest_gpuhost.exec.channels import ProcessChannel, RawChannel

__all__ = ["OpenSSHChannel", "openssh_argv"]

# AES-GCM first: with AES-NI it costs both ends about half of chacha20-poly1305's CPU (measured on
# this 2-core machine: 839 MB in 1.9 s vs 3.1 s).  The server picks the first one it also offers.
_BULK_CIPHERS = (
    "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr,aes256-ctr"
)


def openssh_argv(
    host: str,
    port: int,
    user: str,
    *,
    known_hosts: Path,
    identity: str | None,
    connect_timeout: float,
    password: str | None = None,
    command: str | None = None,
) -> list[str] | None:
    """The `ssh` argv reaching `host` as paramiko does, or None where that cannot be built."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return None
    if password is not None and not identity:
        return None  # BatchMode cannot type a password
    argv = [
        ssh,
        "-F", "/dev/null",  # no user config: the same host, port and key paramiko used
        "-T",
        "-x",
        "-a",
        "-p", str(port),
        "-l", user,
        "-c", _BULK_CIPHERS,
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "UpdateHostKeys=no",
        "-o", f"ConnectTimeout={max(1, int(connect_timeout))}",
        "-o", "ServerAliveInterval=15",
        "-o", "ServerAliveCountMax=4",
        "-o", "LogLevel=ERROR",
    ]  # fmt: skip
    if identity:
        argv += ["-i", identity, "-o", "IdentitiesOnly=yes"]
    argv += [host, "--"]
    if command is not None:
        argv.append(command)
    return argv


class OpenSSHChannel(RawChannel):
    """A bulk program under the OpenSSH client that falls back to paramiko if ssh cannot log in.

    Until the program's first byte arrives, what was sent is kept; if ssh then exits 255 with
    nothing printed, `reopen(argv)` starts the program again on a paramiko channel, that input is
    replayed, and `failed(why)` is told.  The reader takes the lock only to fall back (when ssh
    has exited, so a send in progress fails at once), never on the normal path: a sender blocked
    on a full pipe cannot stall it.
    """

    def __init__(
        self,
        argv: Sequence[str],
        chan: ProcessChannel,
        *,
        reopen: Callable[[Sequence[str]], RawChannel],
        failed: Callable[[str], None],
    ) -> None:
        self.argv = list(argv)
        self.label = chan.label
        self.chan: RawChannel = chan
        self._reopen = reopen
        self._failed = failed
        self._sent: list[bytes] = []
        self._spoke = False
        self._stdin_closed = False
        self._lock = threading.Lock()

    def send(self, data: bytes) -> None:
        with self._lock:
            if not self._spoke:
                self._sent.append(bytes(data))
            self.chan.send(data)

    def close_stdin(self) -> None:
        with self._lock:
            self._stdin_closed = True
            self.chan.close_stdin()

    def recv(self, timeout: float | None) -> bytes:
        if self._pushback:
            data, self._pushback = self._pushback, b""
            return data
        data = self.chan.recv(timeout)
        if data:
            if not self._spoke:
                self._spoke = True
                self._sent = []
            return data
        if self._spoke or not isinstance(self.chan, ProcessChannel) or self.chan.exit_status(5.0) != 255:
            return data
        why = " ".join(self.chan.stderr_text().split())[-300:] or "no message"
        self._failed(f"ssh client exited 255: {why}")
        with self._lock:
            self.chan.close()
            self.chan = self._reopen(self.argv)
            self.label = self.chan.label
            for piece in self._sent:
                self.chan.send(piece)
            if self._stdin_closed:
                self.chan.close_stdin()
        return self.recv(timeout)

    def stderr_text(self) -> str:
        return self.chan.stderr_text()

    def exit_status(self, timeout: float = 0.0) -> int | None:
        return self.chan.exit_status(timeout)

    def lost(self) -> bool:
        return self.chan.lost()

    def close(self) -> None:
        self.chan.close()

"""The master's login on a TCP socket of ours: `TCP_NODELAY` from the first byte.

OpenSSH's ssh sets `TCP_NODELAY` only after authentication (packet.c,
`ssh_packet_set_interactive`).  Before that, ssh writes NEWKEYS and SERVICE_REQUEST as two small
segments: Nagle's algorithm holds the second until the first is acknowledged, and the server
delays that acknowledgement (Linux: at least 40 ms, `TCP_DELACK_MIN`).  Measured here: one 43 ms
stall in every login (docs/SSH.md).

So where ssh would connect on its own (no `ProxyCommand`, no `ProxyJump`, no `CheckHostIP`, no
hostname canonicalisation, no `BindInterface`: `direct_refusal` says which), we connect the socket
as ssh would (ssh_config's `HostName`, `Port`, `AddressFamily`, `BindAddress`,
`ConnectionAttempts`, `ConnectTimeout`, `TCPKeepAlive`, as `ssh -G` resolved them), set
`TCP_NODELAY`, and hand it to the master as its standard input and output with `ProxyCommand=-`
(sshconnect.c `ssh_connect`: "-" means the connection is on stdin/stdout; present by OpenSSH
6.5, and since 8.0 (commit 8e7bac35, 2019-02-27) dup()ed, so the master's later redirection of
its stdio to /dev/null leaves the connection alone).  The master is `ssh -M -S SOCKET -N -o
ControlPersist=...`: with ControlPersist it forks into the background once authenticated (ssh.c
`ssh_session2` -> `fork_postauth`, after `muxserver_listen`), so its first process's exit is the
login's end: status 0 with the control socket listening, or 255 with ssh's words on stderr.  We
wait for that exit on a pidfd (no polling).

One more wait is removed at that moment.  After USERAUTH_SUCCESS, sshd sends a `hostkeys-00`
global request (sshd.c `notify_hostkeys`); with Nagle on its side it holds that packet until our
acknowledgement of USERAUTH_SUCCESS, which our kernel delays, and the session channel's
CHANNEL_OPEN_CONFIRMATION then queues behind it: a second ~40 ms stall (paramiko pays it too).
Setting `TCP_QUICKACK` on our copy of the socket when the login is seen sends the pending
acknowledgement at once (tcp(7); net/ipv4/tcp.c `__tcp_sock_set_quickack`), and our copy is then
closed: the master owns the connection.
"""

from __future__ import annotations

import os
import re
import select
import socket
import subprocess
import time
from collections.abc import Mapping

from pytest_gpuhost.errors import ConnectError

__all__ = ["MIN_VERSION", "DirectLogin", "direct_refusal", "openssh_version", "tcp_connect"]

# ProxyCommand=- with its stdin/stdout dup()ed: OpenSSH 8.0 (see above).
MIN_VERSION = (8, 0)

_FAMILIES = {"any": socket.AF_UNSPEC, "inet": socket.AF_INET, "inet6": socket.AF_INET6}


def openssh_version(text: str) -> tuple[int, int] | None:
    """(major, minor) from `ssh -V` output ("OpenSSH_9.2p1 Debian-2+deb12u10, OpenSSL ..."), else None."""
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _set(effective: Mapping[str, str], key: str) -> str:
    """A setting from `ssh -G`, "" where unset or `none`."""
    value = effective.get(key, "")
    return "" if value.lower() == "none" else value


def direct_refusal(effective: Mapping[str, str], version: tuple[int, int] | None) -> str | None:
    """Why ssh must make this connection itself (None: we may connect the socket for it)."""
    if version is None or version < MIN_VERSION:
        return "OpenSSH older than 8.0 (or not OpenSSH)"
    for key in ("proxycommand", "proxyjump", "bindinterface"):
        if _set(effective, key):
            return f"{key} is set"
    if effective.get("checkhostip", "no") != "no":
        return "CheckHostIP needs ssh's own connection"
    if effective.get("canonicalizehostname", "false") not in ("false", "no"):
        return "CanonicalizeHostname is on"
    if effective.get("addressfamily", "any") not in _FAMILIES:
        return "unknown AddressFamily"
    return None


def tcp_connect(effective: Mapping[str, str], timeout: float, where: str, deadline: float) -> socket.socket:
    """Connect as ssh would (sshconnect.c `ssh_connect_direct`); raise ConnectError (one line).

    Every address `getaddrinfo` gives is tried in order within `timeout` each, the whole list
    `ConnectionAttempts` times a second apart, as ssh does; unlike ssh, nothing runs past
    `deadline` (time.monotonic()): the login's bound covers every address and attempt.
    """
    host = effective.get("hostname", "")
    port = int(effective.get("port", "22"))
    family = _FAMILIES[effective.get("addressfamily", "any")]
    bind = _set(effective, "bindaddress")
    attempts = max(1, int(effective.get("connectionattempts", "1") or 1))
    try:
        addrs = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0, socket.AI_NUMERICSERV)
    except socket.gaierror as exc:
        raise ConnectError(f"cannot resolve {host} for {where}: {exc.strerror}") from exc
    last = ": no address"
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))  # as ssh does between attempts
        for fam, kind, proto, _, addr in addrs:
            left = min(timeout, deadline - time.monotonic())
            if left <= 0:
                break
            sock = socket.socket(fam, kind, proto)
            try:
                if bind:
                    sock.bind((bind, 0))
                sock.settimeout(left)
                sock.connect(addr)
            except TimeoutError:
                sock.close()
                last = f"within {timeout:g}s: timed out"
                continue
            except OSError as exc:
                sock.close()
                last = f": {exc.strerror or exc}"
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if effective.get("tcpkeepalive", "yes") == "yes":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            return sock
    raise ConnectError(f"cannot reach {where}{'' if last.startswith(':') else ' '}{last}")


class DirectLogin:
    """A master logging in on our socket; `wait` returns once it is in the background, or raises."""

    def __init__(self, argv: list[str], sock: socket.socket, err_path: str) -> None:
        self.sock = sock
        self.err_path = err_path
        with open(err_path, "wb") as err:  # a file: a master older than 8.5 keeps its stderr
            self.proc = subprocess.Popen(argv, stdin=sock.fileno(), stdout=sock.fileno(), stderr=err)

    def wait(self, timeout: float) -> int | None:
        """The first process's exit status within `timeout` (None: still logging in)."""
        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # no pidfd (Linux < 5.3): Popen's own wait
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        try:
            if not select.select([pidfd], [], [], max(0.0, timeout))[0]:
                return None
        finally:
            os.close(pidfd)
        return self.proc.wait()

    def logged_in(self) -> None:
        """The login is done: acknowledge what the server sent at once, then let go of the socket."""
        quickack = getattr(socket, "TCP_QUICKACK", None)
        try:
            if quickack is not None:
                self.sock.setsockopt(socket.IPPROTO_TCP, quickack, 1)
        except OSError:
            pass  # an optimisation only
        self.sock.close()

    def stderr_text(self) -> str:
        try:
            with open(self.err_path, "rb") as f:
                return f.read()[-4096:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

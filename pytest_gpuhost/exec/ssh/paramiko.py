"""SSH with paramiko, the fallback where no OpenSSH client exists: the transport and its launcher.

Where `ssh` is installed, targets.py uses the OpenSSH client instead (ssh/openssh.py).  This
transport reads ssh_config through ssh/config.py (`HostName`, `User`, `Port`, `IdentityFile`,
`ProxyJump`, `UserKnownHostsFile`), takes keys from ssh-agent (a passphrase-protected identity is
used through the agent key that matches its `.pub`), and logs nothing through paramiko's own
loggers: a hung server is one `ConnectError` line, not paramiko's traceback per attempt.

`SSHLauncher` starts programs over one paramiko `Transport` per target, one exec channel
(ssh/paramiko_channel.py) per program, so an agent and a bulk tar stream share the connection.  For a
transport built by hand on a machine that has `ssh`, `open_bulk` runs a program under the
OpenSSH client instead where it can (openssh.py says why and how it falls back); the
reason bulk channels stay on paramiko, once decided, is kept in `SSHTransport.bulk_fallback`.

Host keys are checked against known_hosts by hostkeys.py, not by paramiko's policies.  Every
failure to connect, authenticate or open a channel raises `ConnectError` (an `Unreachable`).
"""

from __future__ import annotations

import errno
import getpass
import logging
import os
import shlex
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpuhost.errors import ConnectError
from pytest_gpuhost.exec.channels import ProcessChannel, RawChannel
from pytest_gpuhost.exec.launch import Launcher
from pytest_gpuhost.exec.ssh.bulk import OpenSSHChannel, openssh_argv
from pytest_gpuhost.exec.ssh.config import Hop, resolve
from pytest_gpuhost.exec.ssh.hostkeys import (
    HOST_KEY_POLICIES,
    host_key_name,
    known_hosts,
    prefer_known_types,
    verify_host_key,
)
from pytest_gpuhost.exec.ssh.paramiko_channel import SSHChannel

if TYPE_CHECKING:
    import paramiko
else:

    class _LazyParamiko:
        """paramiko, imported on first use: it (and invoke, which it pulls in) costs a process
        ~0.12 s, and an xdist controller or a local:// run never opens an SSH connection."""

        def __getattr__(self, name: str) -> Any:
            import paramiko as module

            globals()["paramiko"] = module
            return getattr(module, name)

    paramiko = _LazyParamiko()

__all__ = ["HOST_KEY_POLICIES", "SSHChannel", "SSHLauncher", "SSHTransport"]

# paramiko logs every failed handshake with its traceback (about 30 lines, once per attempt) at
# ERROR; our ConnectError already says what failed in one line.  Lower this logger's level to see them.
PARAMIKO_LOG = "pytest_gpuhost.paramiko"
logging.getLogger(PARAMIKO_LOG).setLevel(logging.CRITICAL)


class SSHTransport:
    """One authenticated paramiko Transport to a host, verified against known_hosts."""

    def __init__(
        self,
        host: str,
        port: int | None = None,
        user: str | None = None,
        *,
        identity: str | os.PathLike[str] | None = None,
        known_hosts: str | os.PathLike[str] | None = None,
        host_key_policy: str = "strict",
        connect_timeout: float,
        password: str | None = None,
        ssh_config: str | os.PathLike[str] | None = None,
        jumps: Sequence[Hop] | None = None,
    ) -> None:
        """`host` may be an ssh_config alias; an explicit `port` or `user` wins over the config.

        `jumps` replaces the config's ProxyJump (the hops of a jump do not follow their own).
        `connect_timeout` has no default here: the one default is `TargetOptions.connect_timeout`.
        """
        if host_key_policy not in HOST_KEY_POLICIES:
            raise ConnectError(
                f"unknown host key policy {host_key_policy!r}: use one of {', '.join(HOST_KEY_POLICIES)}"
            )
        found = resolve(host, port, user, ssh_config)
        self.alias = host
        self.host = found.hostname
        self.port = found.port
        self.user = found.user or getpass.getuser()
        self.identity = os.path.expanduser(str(identity)) if identity else None
        self.config_identities = found.identities
        self.known_hosts = Path(known_hosts or found.known_hosts or "~/.ssh/known_hosts").expanduser()
        self.policy = host_key_policy
        self.connect_timeout = float(connect_timeout)
        self.password = password
        self.ssh_config = ssh_config
        self.jumps = list(found.jumps if jumps is None else jumps)
        self.hops: list[SSHTransport] = []  # the jump transports, first hop first
        self.transport: paramiko.Transport | None = None
        self._lock = threading.Lock()
        self._openssh_ok: bool | None = None  # None: not known yet; False: bulk stays on paramiko
        self.bulk_fallback = ""  # why bulk channels use paramiko, once that is decided

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    # -- connect

    def _keys(self) -> list[paramiko.PKey]:
        """The identity's key (else the config's, else the default files) and the agent's keys.

        A passphrase-protected file cannot be typed into here: it is used through the agent key
        whose public half matches its `.pub`, and a default file that is protected is skipped.
        """
        explicit = (
            [self.identity] if self.identity else [p for p in self.config_identities if os.path.exists(p)]
        )
        paths = explicit or [
            str(Path.home() / ".ssh" / n)
            for n in ("id_ed25519", "id_ecdsa", "id_rsa")
            if (Path.home() / ".ssh" / n).exists()
        ]
        try:
            agent_keys = list(paramiko.Agent().get_keys())
        except (paramiko.SSHException, OSError):
            agent_keys = []
        keys: list[paramiko.PKey] = []
        for path in paths:
            try:
                keys.append(paramiko.PKey.from_path(path))
                continue
            except FileNotFoundError as exc:
                raise ConnectError(f"SSH identity file {path} not found") from exc
            except (paramiko.PasswordRequiredException, TypeError):
                pass  # protected by a passphrase (TypeError: cryptography's word for a PEM file)
            except (paramiko.SSHException, OSError, ValueError) as exc:
                raise ConnectError(f"cannot load SSH identity {path}: {_one_line(exc)}") from exc
            held = _agent_key_for(path, agent_keys)
            if held is not None:
                keys.append(held)
            elif self.identity:
                raise ConnectError(
                    f"SSH identity {path} is passphrase-protected and ssh-agent does not hold it: "
                    f"load it with ssh-add {path}"
                )
        if not self.identity:
            keys.extend(k for k in agent_keys if all(k.asbytes() != have.asbytes() for have in keys))
        return keys

    def connect(self) -> paramiko.Transport:
        """Open (or reopen) the transport; raise ConnectError with one line on failure."""
        with self._lock:
            if self.transport is not None and self.transport.is_active():
                return self.transport
            self._close_locked()
            self.transport = self._connect()
            return self.transport

    def _connect(self) -> paramiko.Transport:
        t0 = time.monotonic()
        timeout = self.connect_timeout
        sock = self._jump_socket() if self.jumps else self._socket_for()
        transport = paramiko.Transport(sock)
        transport.set_log_channel(PARAMIKO_LOG)
        ok = False
        try:
            left = max(0.5, timeout - (time.monotonic() - t0))
            transport.banner_timeout = left
            transport.handshake_timeout = left
            transport.auth_timeout = left
            name = host_key_name(self.host, self.port)
            entries = known_hosts(self.known_hosts, name)
            if entries.keys:
                opts = transport.get_security_options()
                opts.key_types = prefer_known_types(opts.key_types, entries.keys)
            try:
                transport.start_client(timeout=left)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if not transport.remote_version:  # TCP accepted (a middlebox, a dying host), no SSH banner
                    raise ConnectError(
                        f"cannot reach {self.host}:{self.port} within {timeout:g}s: no SSH server answered"
                    ) from exc
                raise ConnectError(
                    f"SSH handshake with {self.host}:{self.port} failed: {_one_line(exc)}"
                ) from exc
            if not (transport.is_active() and transport.initial_kex_done):  # start_client's timeout ran out
                what = "handshake did not finish" if transport.remote_version else "no SSH server answered"
                raise ConnectError(f"cannot reach {self.host}:{self.port} within {timeout:g}s: {what}")
            key = transport.get_remote_server_key()
            verify_host_key(self.known_hosts, self.policy, name, key, entries)
            self._authenticate(transport)
            transport.set_keepalive(30)
            ok = True
            return transport
        finally:
            if not ok:
                transport.close()

    def _tcp_socket(self) -> socket.socket:
        timeout = self.connect_timeout
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except TimeoutError as exc:
            raise ConnectError(
                f"cannot reach {self.host}:{self.port} within {timeout:g}s: timed out"
            ) from exc
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ConnectError(f"cannot reach {self.host}:{self.port}: {reason}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _jump_socket(self) -> paramiko.Channel:
        """Reach the host through the ProxyJump hops, each an SSH transport of its own."""
        if not self.hops:
            for hop in self.jumps:
                t = SSHTransport(
                    hop.host,
                    hop.port,
                    hop.user,
                    host_key_policy=self.policy,
                    connect_timeout=self.connect_timeout,
                    ssh_config=self.ssh_config,
                    jumps=(),
                )
                t._via = self.hops[-1] if self.hops else None
                self.hops.append(t)
        return self.hops[-1]._forward(self.host, self.port)

    _via: SSHTransport | None = None

    def _socket_for(self) -> socket.socket | paramiko.Channel:
        return self._via._forward(self.host, self.port) if self._via is not None else self._tcp_socket()

    def _forward(self, host: str, port: int) -> paramiko.Channel:
        """Open a direct-tcpip channel from this (jump) host to `host:port`."""
        transport = self.connect()
        try:
            return transport.open_channel(
                "direct-tcpip", (host, port), ("127.0.0.1", 0), timeout=self.connect_timeout
            )
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectError(
                f"jump host {self.where} cannot open a connection to {host}:{port}: {_one_line(exc)}"
            ) from exc

    def _authenticate(self, transport: paramiko.Transport) -> None:
        errors = []
        for key in self._keys():
            try:
                transport.auth_publickey(self.user, key)
                if transport.is_authenticated():
                    return
            except paramiko.AuthenticationException as exc:
                errors.append(_one_line(exc))
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ConnectError(f"SSH authentication as {self.where} failed: {_one_line(exc)}") from exc
        if self.password is not None:
            try:
                transport.auth_password(self.user, self.password)
                if transport.is_authenticated():
                    return
            except paramiko.AuthenticationException as exc:
                errors.append(_one_line(exc))
        tried = self.identity or "the configured or default keys and the agent"
        raise ConnectError(f"SSH authentication as {self.where} failed with {tried}: permission denied")

    def open(self, argv: Sequence[str]) -> SSHChannel:
        command = shlex.join(argv)
        for attempt in (1, 2):
            transport = self.connect()
            try:
                chan = transport.open_session(timeout=self.connect_timeout)
                chan.exec_command(command)
                return SSHChannel(chan, command)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if attempt == 2 or transport.is_active():
                    raise ConnectError(
                        f"cannot open an SSH channel to {self.where}: {_one_line(exc)}"
                    ) from exc
        raise AssertionError("unreachable")

    # -- bulk channels under the OpenSSH client

    def openssh_argv(self, command: str | None = None) -> list[str] | None:
        """The `ssh` argv reaching this host as paramiko does, or None where that cannot be built."""
        if self.jumps or self._via is not None:
            return None  # the bulk argv has no user config, hence no ProxyJump
        return openssh_argv(
            self.host,
            self.port,
            self.user,
            known_hosts=self.known_hosts,
            identity=self.identity,
            connect_timeout=self.connect_timeout,
            password=self.password,
            command=command,
        )

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        """Start `argv` under the OpenSSH client, else (or if it cannot log in) on a paramiko channel."""
        command = shlex.join(argv)
        ssh = self.openssh_argv(command) if self._openssh_ok is not False else None
        if ssh is None:
            if self._openssh_ok is None:
                self._openssh_ok = False
                self.bulk_fallback = "no OpenSSH client (ssh) on PATH"
            return self.open(argv)
        try:
            chan = ProcessChannel(ssh, label=f"ssh {self.where} {command}", bulk=True)
        except OSError as exc:
            self._openssh_failed(f"cannot start ssh: {_one_line(exc)}")
            return self.open(argv)
        return OpenSSHChannel(argv, chan, reopen=self.open, failed=self._openssh_failed)

    def _openssh_failed(self, why: str) -> None:
        self._openssh_ok = False
        self.bulk_fallback = why

    def _close_locked(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        for hop in reversed(self.hops):
            hop.close()
        self.hops = []

    def close(self) -> None:
        with self._lock:
            self._close_locked()


def _agent_key_for(path: str, agent_keys: Sequence[paramiko.PKey]) -> paramiko.PKey | None:
    """Return the agent key whose public half is `path`.pub, or None (no .pub, or not loaded)."""
    try:
        fields = Path(path + ".pub").read_text(encoding="ascii", errors="replace").split()
    except OSError:
        return None
    blob = fields[1] if len(fields) > 1 else ""
    return next((k for k in agent_keys if k.get_base64() == blob), None)


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.errno and not str(exc):
        text = errno.errorcode.get(exc.errno, text)
    return " ".join(text.split())


class SSHLauncher(Launcher):
    """Run programs over one SSH transport, one exec channel each."""

    def __init__(self, transport: SSHTransport) -> None:
        self.transport = transport
        self.client = "paramiko"
        self.description = f"ssh {transport.where} (paramiko)"

    def open(self, argv: Sequence[str]) -> RawChannel:
        return self.transport.open(argv)

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        return self.transport.open_bulk(argv)

    def close(self) -> None:
        self.transport.close()

"""Byte channels to targets: local processes, SSH exec channels, and command prefixes.

A `Launcher` starts a program on a target and returns a `RawChannel` (stdin, stdout, a stderr
tail, exit status).  `LocalLauncher` runs it here, `SSHLauncher` on one paramiko `Transport` per
target (one exec channel per program, so an agent and a bulk tar stream share the connection),
and `PrefixLauncher` wraps another launcher's argv (`sudo -n`, `docker exec -i NAME`,
`pct exec ID --`, `lxc-attach -n NAME --`).

`Launcher.open_bulk` is for programs that move many megabytes (the backup stream).  Over SSH it
runs the program under the OpenSSH client when `ssh` is installed, with the same identity, the
same known_hosts file under StrictHostKeyChecking=yes, and no user config: OpenSSH's C transport
moved 839 MB in about 2 s here (AES-GCM), where paramiko took about 7 s.  A bulk channel on which
the client cannot log in (ssh exits 255 before the program printed a byte) is replaced,
transparently, by a paramiko channel that gets the same stdin; later bulk channels of that
transport stay on paramiko, and the reason is kept in `SSHTransport.bulk_fallback`.

Host keys are checked by this module, not by paramiko's policies, so that a changed key can be
reported with the file and line it contradicts; a changed key is refused under every policy.
"""

from __future__ import annotations

import errno
import fcntl
import getpass
import os
import select
import shlex
import shutil
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpuhost.errors import ConnectError

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

__all__ = [
    "HOST_KEY_POLICIES",
    "Launcher",
    "LocalLauncher",
    "PrefixLauncher",
    "ProcessChannel",
    "RawChannel",
    "SSHChannel",
    "SSHLauncher",
    "SSHTransport",
]

HOST_KEY_POLICIES = ("strict", "accept-new")
_STDERR_KEEP = 64 * 1024
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_BULK_PIPE = 1 << 20
# AES-GCM first: with AES-NI it costs both ends about half of chacha20-poly1305's CPU (measured on
# this 2-core machine: 839 MB in 1.9 s vs 3.1 s).  The server picks the first one it also offers.
_BULK_CIPHERS = (
    "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr,aes256-ctr"
)


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

    def close(self) -> None:
        self.close_stdin()
        self.chan.close()


class Launcher:
    """Starts programs on one target; see the module docstring."""

    description: str = ""

    def open(self, argv: Sequence[str]) -> RawChannel:
        raise NotImplementedError

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        """Like `open`, for a program that moves bulk bytes (see the module docstring)."""
        return self.open(argv)

    def close(self) -> None:
        """Release what the launcher holds (an SSH transport); channels must be closed first."""


class LocalLauncher(Launcher):
    """Run programs on this machine; `env` is overlaid on the environment (e.g. PATH, for tests)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(env) if env else None
        self.description = "local"

    def open(self, argv: Sequence[str]) -> RawChannel:
        return ProcessChannel(argv, self.env)

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        return ProcessChannel(argv, self.env, bulk=True)


class PrefixLauncher(Launcher):
    """Run programs through another launcher behind a fixed argv prefix (sudo, docker exec, ...)."""

    def __init__(self, base: Launcher, prefix: Sequence[str], description: str = "") -> None:
        self.base = base
        self.prefix = list(prefix)
        self.description = description or shlex.join(self.prefix)

    def open(self, argv: Sequence[str]) -> RawChannel:
        return self.base.open(self.prefix + list(argv))

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        return self.base.open_bulk(self.prefix + list(argv))


def _host_key_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _matches(patterns: list[str], name: str) -> bool:
    for pattern in patterns:
        if pattern.startswith("|1|"):
            if paramiko.HostKeys.hash_host(name, pattern) == pattern:
                return True
        elif pattern == name:
            return True
    return False


class SSHTransport:
    """One authenticated paramiko Transport to a host, verified against known_hosts."""

    def __init__(
        self,
        host: str,
        port: int = 22,
        user: str | None = None,
        *,
        identity: str | os.PathLike[str] | None = None,
        known_hosts: str | os.PathLike[str] | None = None,
        host_key_policy: str = "strict",
        connect_timeout: float = 10.0,
        password: str | None = None,
    ) -> None:
        if host_key_policy not in HOST_KEY_POLICIES:
            raise ConnectError(
                f"unknown host key policy {host_key_policy!r}: use one of {', '.join(HOST_KEY_POLICIES)}"
            )
        self.host = host
        self.port = int(port)
        self.user = user or getpass.getuser()
        self.identity = os.path.expanduser(str(identity)) if identity else None
        self.known_hosts = (
            Path(known_hosts).expanduser() if known_hosts else Path.home() / ".ssh" / "known_hosts"
        )
        self.policy = host_key_policy
        self.connect_timeout = float(connect_timeout)
        self.password = password
        self.transport: paramiko.Transport | None = None
        self._lock = threading.Lock()
        self._openssh_ok: bool | None = None  # None: not known yet; False: bulk stays on paramiko
        self.bulk_fallback = ""  # why bulk channels use paramiko, once that is decided

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    # -- host keys

    def _known_entries(self, name: str) -> list[tuple[int, paramiko.PKey]]:
        try:
            text = self.known_hosts.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ConnectError(f"cannot read known hosts file {self.known_hosts}: {exc.strerror}") from exc
        found = []
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#") or line.startswith("@"):
                continue
            fields = line.split()
            if len(fields) < 3 or not _matches(fields[0].split(","), name):
                continue
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields[:3]), lineno)
            except (paramiko.hostkeys.InvalidHostKey, ValueError):
                continue
            if entry is not None and entry.key is not None:
                found.append((lineno, entry.key))
        return found

    def _verify_host_key(self, key: paramiko.PKey, entries: list[tuple[int, paramiko.PKey]]) -> None:
        name = _host_key_name(self.host, self.port)
        same_type = [(n, k) for n, k in entries if k.get_name() == key.get_name()]
        for _n, known in same_type:
            if known.asbytes() == key.asbytes():
                return
        if same_type:
            lineno = same_type[0][0]
            raise ConnectError(
                f"host key for {name} does not match {self.known_hosts} line {lineno}: refusing "
                f"(offered {key.get_name()} {key.fingerprint})"
            )
        if self.policy != "accept-new":
            raise ConnectError(
                f"host key for {name} is not in {self.known_hosts} ({key.get_name()} {key.fingerprint}): "
                "refusing under the strict policy; add it with ssh-keyscan or use --host-key-policy=accept-new"
            )
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        line = f"{name} {key.get_name()} {key.get_base64()}\n"
        fd = os.open(self.known_hosts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode("ascii"))
        finally:
            os.close(fd)

    # -- connect

    def _keys(self) -> list[paramiko.PKey]:
        paths = [self.identity] if self.identity else []
        if not self.identity:
            ssh_dir = Path.home() / ".ssh"
            paths = [str(ssh_dir / n) for n in ("id_ed25519", "id_ecdsa", "id_rsa") if (ssh_dir / n).exists()]
        keys: list[paramiko.PKey] = []
        for path in paths:
            try:
                keys.append(paramiko.PKey.from_path(path))
            except FileNotFoundError as exc:
                raise ConnectError(f"SSH identity file {path} not found") from exc
            except (paramiko.SSHException, OSError, ValueError) as exc:
                raise ConnectError(f"cannot load SSH identity {path}: {exc}") from exc
        if not self.identity:
            try:
                keys.extend(paramiko.Agent().get_keys())
            except (paramiko.SSHException, OSError):
                pass
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
        transport = paramiko.Transport(sock)
        ok = False
        try:
            left = max(0.5, timeout - (time.monotonic() - t0))
            transport.banner_timeout = left
            transport.handshake_timeout = left
            transport.auth_timeout = left
            name = _host_key_name(self.host, self.port)
            entries = self._known_entries(name)
            if entries:
                # Ask for the key type we already know, as OpenSSH does; otherwise a host with
                # several keys could offer another type and look "unknown".
                opts = transport.get_security_options()
                known_types = [k.get_name() for _, k in entries]
                preferred = [
                    t for t in opts.key_types if any(t == kt or _rsa_alias(t, kt) for kt in known_types)
                ]
                opts.key_types = preferred + [t for t in opts.key_types if t not in preferred]
            try:
                transport.start_client(timeout=left)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if "banner" in str(exc):  # TCP accepted (a middlebox, a dying host) but no SSH server spoke
                    raise ConnectError(
                        f"cannot reach {self.host}:{self.port} within {timeout:g}s: no SSH server answered"
                    ) from exc
                raise ConnectError(
                    f"SSH handshake with {self.host}:{self.port} failed: {_one_line(exc)}"
                ) from exc
            key = transport.get_remote_server_key()
            self._verify_host_key(key, entries)
            self._authenticate(transport)
            transport.set_keepalive(30)
            ok = True
            return transport
        finally:
            if not ok:
                transport.close()

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
        tried = self.identity or "the default keys and agent"
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
        ssh = shutil.which("ssh")
        if ssh is None:
            return None
        if self.password is not None and not self.identity:
            return None  # BatchMode cannot type a password
        argv = [
            ssh,
            "-F", "/dev/null",  # no user config: the same host, port and key paramiko used
            "-T",
            "-x",
            "-a",
            "-p", str(self.port),
            "-l", self.user,
            "-c", _BULK_CIPHERS,
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "UpdateHostKeys=no",
            "-o", f"ConnectTimeout={max(1, int(self.connect_timeout))}",
            "-o", "ServerAliveInterval=15",
            "-o", "ServerAliveCountMax=4",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip
        if self.identity:
            argv += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        argv += [self.host, "--"]
        if command is not None:
            argv.append(command)
        return argv

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
            self._openssh_ok = False
            self.bulk_fallback = f"cannot start ssh: {_one_line(exc)}"
            return self.open(argv)
        return _OpenSSHChannel(self, argv, chan)

    def _openssh_failed(self, why: str) -> None:
        self._openssh_ok = False
        self.bulk_fallback = why

    def _close_locked(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()


def _rsa_alias(offered: str, known: str) -> bool:
    return known == "ssh-rsa" and offered in ("rsa-sha2-512", "rsa-sha2-256")


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.errno and not str(exc):
        text = errno.errorcode.get(exc.errno, text)
    return " ".join(text.split())


class _OpenSSHChannel(RawChannel):
    """A bulk program under the OpenSSH client that falls back to paramiko if ssh cannot log in.

    Until the program's first byte arrives, what was sent is kept; if ssh then exits 255 with
    nothing printed, the program is started again on a paramiko channel and that input replayed.
    The reader takes the lock only to fall back (when ssh has exited, so a send in progress fails
    at once), never on the normal path: a sender blocked on a full pipe cannot stall it.
    """

    def __init__(self, transport: SSHTransport, argv: Sequence[str], chan: ProcessChannel) -> None:
        self.transport = transport
        self.argv = list(argv)
        self.label = chan.label
        self.chan: RawChannel = chan
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
        self.transport._openssh_failed(f"ssh client exited 255: {why}")
        with self._lock:
            self.chan.close()
            self.chan = self.transport.open(self.argv)
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

    def close(self) -> None:
        self.chan.close()


class SSHLauncher(Launcher):
    """Run programs over one SSH transport, one exec channel each."""

    def __init__(self, transport: SSHTransport) -> None:
        self.transport = transport
        self.description = f"ssh {transport.where}"

    def open(self, argv: Sequence[str]) -> RawChannel:
        return self.transport.open(argv)

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        return self.transport.open_bulk(argv)

    def close(self) -> None:
        self.transport.close()

"""SSH through the system's OpenSSH client: one multiplexing master per target, a client per channel.

As Ansible and testinfra's ssh backend do, `ssh` itself reads ssh_config (`-F` from
`--ssh-config`, else the user's `~/.ssh/config` and `/etc/ssh/ssh_config`): `Host` aliases,
`User`, `Port`, `IdentityFile`, `ProxyJump`, ssh-agent keys (passphrase-protected ones included),
host certificates (`@cert-authority`) and `@revoked` keys in known_hosts.

`OpenSSHTransport` logs in once: a ControlMaster whose socket sits in a private temporary
directory of ours (0700), with `ControlPersist` short so a master orphaned by a killed run goes away
on its own.  Two ways to log in:

- direct, wherever ssh would connect on its own (ssh/direct.py): we connect the TCP socket
  with `TCP_NODELAY` and the master (`ssh -o ProxyCommand=- -M -S SOCKET -N`) logs in on it and
  backgrounds itself; the first channel is then an ordinary client.  This takes two ~40 ms
  Nagle/delayed-ACK stalls out of every login (docs/SSH.md).
- carrier, where ssh must connect itself (`ProxyJump`, `ProxyCommand`, `CheckHostIP`, ...): the
  first channel carries the login: one `ssh -M -S SOCKET -o ControlPersist=60 HOST -- COMMAND`
  logs in, forks the master into the background and runs COMMAND as the master's first client
  (ssh.c `control_persist_detach`); nothing waits for the login apart from the channel's own
  first reply.

Every later channel (the fallback's commands, bulk streams, containers) is `ssh -S SOCKET` started
as a child process: it hands its pipes to the master, so it pays no login.  `close` asks the master
to exit and removes the directory.

Our options are passed on the command line, so they win over ssh_config as `-o` does:
`BatchMode=yes` (nothing prompts), `StrictHostKeyChecking=yes` (`accept-new` only with
`--host-key-policy=accept-new`), `UpdateHostKeys=no`, `ClearAllForwardings=yes` (forwards from
the config would collide between parallel masters), `RemoteCommand=none` and
`PermitLocalCommand=no` (we run our own programs), `ConnectTimeout`.  OpenSSH 7.6 or later
(`accept-new`, `RemoteCommand`); an older client fails at `ssh -G`, in one line.  `--known-hosts FILE`
means exactly the keys in FILE (`UserKnownHostsFile=FILE`, `GlobalKnownHostsFile=/dev/null`);
without it ssh uses its own files, as plain `ssh` does.  `--ssh-identity` is `-i` with
`IdentitiesOnly=yes` (an agent key matching its `.pub` is used for a protected file).  As with
`ssh -o`, these apply to the target; a ProxyJump host takes its settings from ssh_config.

Over 400 lines because the channel that logs in (`MuxChannel` with `login=True`: its reads and
writes bounded by the login's deadline) and the transport that starts it are one contract.
Measurements of the connect time, both ways: docs/SSH.md.
"""

from __future__ import annotations

import math
import os
import re
import select
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence

from pytest_gpuhost.errors import ConnectError
from pytest_gpuhost.exec.channels import ProcessChannel, RawChannel
from pytest_gpuhost.exec.launch import Launcher
from pytest_gpuhost.exec.ssh.client_facts import (
    PREFERENCES,
    client_facts,
    config_end,
    config_start,
    parse_effective,
)
from pytest_gpuhost.exec.ssh.direct import DirectLogin, direct_refusal, tcp_connect

__all__ = ["CONTROL_PERSIST", "MuxChannel", "OpenSSHLauncher", "OpenSSHTransport", "ssh_client"]

# Seconds a master with no channel open stays up: long enough to bridge the gaps between a
# fallback target's commands, short enough that a master orphaned by a killed run leaves soon.
CONTROL_PERSIST = 60


def ssh_client() -> str | None:
    """Return the OpenSSH client's path, or None where there is none (paramiko is used then)."""
    return shutil.which("ssh")


class OpenSSHTransport:
    """One target reached with the OpenSSH client, multiplexed over one ControlMaster."""

    client = "openssh"

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
        ssh_config: str | os.PathLike[str] | None = None,
        ssh: str | None = None,
    ) -> None:
        """`host` may be an ssh_config alias; `port` and `user` (None: from the config) win over it.

        `connect_timeout` has no default here: the one default is `TargetOptions.connect_timeout`.
        """
        found = ssh or ssh_client()
        if found is None:
            raise ConnectError("no OpenSSH client (ssh) on PATH")
        self.ssh = found
        self.alias = host
        self.policy = host_key_policy
        self.connect_timeout = float(connect_timeout)
        self._opts = [self.ssh]
        if ssh_config:
            config = os.path.expanduser(str(ssh_config))
            if not os.path.isfile(config):
                raise ConnectError(f"ssh config file {config} not found")
            self._opts += ["-F", config]
        if port:
            self._opts += ["-p", str(int(port))]
        if user:
            self._opts += ["-l", user]
        strict = "accept-new" if host_key_policy == "accept-new" else "yes"
        self._opts += [
            "-o", "BatchMode=yes",
            "-o", f"StrictHostKeyChecking={strict}",
            "-o", "UpdateHostKeys=no",
            "-o", "ClearAllForwardings=yes",
            "-o", "RemoteCommand=none",
            "-o", "PermitLocalCommand=no",
            "-o", f"ConnectTimeout={max(1, math.ceil(self.connect_timeout))}",
            "-o", "ServerAliveInterval=15",
            "-o", "ServerAliveCountMax=4",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip
        if known_hosts:
            kh = os.path.expanduser(str(known_hosts))
            self._opts += ["-o", f"UserKnownHostsFile={_quote(kh)}", "-o", "GlobalKnownHostsFile=/dev/null"]
        if identity:
            self._opts += ["-i", os.path.expanduser(str(identity)), "-o", "IdentitiesOnly=yes"]
        resolving = self._resolve_start()
        facts = client_facts(self.ssh)  # cached per process; else its runs overlap ours
        self.effective = self._config(resolving)
        self.host = self.effective.get("hostname", host)
        self.port = int(self.effective.get("port", port or 22))
        self.user = self.effective.get("user", user or "")
        self.jump = self.effective.get("proxyjump", "")
        for name, default in facts.defaults.items():
            if self.effective.get(name) == default:
                key, value = PREFERENCES[name]
                self._opts += ["-o", f"{key}={value}"]
        # None: the master logs in on a socket of ours (ssh/direct.py); else why ssh connects
        self.direct_refusal = direct_refusal(self.effective, facts.version)
        self.local_address: tuple[str, int] | None = None  # (address, port) of our socket, once direct
        self._dir: str | None = None
        self._lock = threading.Lock()
        self._carrier: MuxChannel | None = None  # the channel whose ssh is logging in

    @property
    def where(self) -> str:
        via = f" via {self.jump}" if self.jump and self.jump != "none" else ""
        return f"{self.user}@{self.host}:{self.port}{via}"

    def _resolve_start(self) -> subprocess.Popen[str]:
        try:
            return config_start([*self._opts, "-G", self.alias])
        except OSError as exc:
            raise ConnectError(f"cannot run {self.ssh} -G {self.alias}: {exc}") from exc

    def _config(self, proc: subprocess.Popen[str]) -> dict[str, str]:
        """What ssh makes of our options and the config for this host (`ssh -G`)."""
        out = config_end(proc)
        if out is None:
            raise ConnectError(f"cannot run {self.ssh} -G {self.alias}: no answer within 10 s")
        if out[0] != 0:
            raise ConnectError(f"ssh cannot use its configuration for {self.alias}: {_tail(out[2])}")
        return parse_effective(out[1])

    # -- the master

    @property
    def control_path(self) -> str | None:
        return None if self._dir is None else os.path.join(self._dir, "m")

    def alive(self) -> bool:
        """Whether the master answers on its socket (it removes the socket when it exits)."""
        path = self.control_path
        if path is None:
            return False
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(path)
            except OSError:
                return False
        return True

    def connect(self) -> None:
        """Log in now unless a master runs (a carrier running `true`); raise ConnectError (one line)."""
        with self.open(["true"]) as chan:
            while chan.recv(self.login_limit):
                pass

    def _master_up_locked(self) -> bool:
        """Whether a master answers; a login in progress (another thread's carrier) is waited for.

        Polled (2 ms) because nothing signals a socket's creation cheaply; only threads that open
        a channel while another one's login runs ever wait here.
        """
        carrier = self._carrier
        while not self.alive():
            if carrier is None or not carrier.logging_in():
                return False
            time.sleep(0.002)
        return True

    @property
    def login_limit(self) -> float:
        """Seconds a login may take: ssh's ConnectTimeout covers TCP and the banner, 2 s the rest."""
        return self.connect_timeout + 2.0

    def login_timeout(self) -> ConnectError:
        return ConnectError(
            f"cannot reach {self.where} within {self.connect_timeout:g}s: no SSH login completed"
        )

    def login_failed(self, rc: int | None, why: str) -> ConnectError:
        return ConnectError(f"ssh to {self.where} failed (exit status {rc}): {why or 'no message'}")

    def _stop_locked(self) -> None:
        path, where = self.control_path, self._dir
        if path is None or where is None:
            return
        if os.path.exists(path):
            try:
                subprocess.run(
                    [*self._opts, "-S", path.replace("%", "%%"), "-O", "exit", self.alias],
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=5,
                )
            except (OSError, subprocess.TimeoutExpired):
                pass  # ControlPersist ends it once its channels are gone
        shutil.rmtree(where, ignore_errors=True)
        self._dir = None
        self._carrier = None

    @property
    def transport(self) -> _MasterLink:
        """The link itself, as paramiko's transport is one: `close()` cuts it under every channel."""
        return _MasterLink(self)

    # -- channels

    def argv(self, command: str) -> list[str]:
        """The argv of a client that runs `command` on the master's connection."""
        path = self.control_path or "none"
        return [
            *self._opts,
            "-S",
            path.replace("%", "%%"),
            "-o",
            "ControlMaster=no",
            "-T",
            self.alias,
            "--",
            command,
        ]

    def carrier_argv(self, path: str, command: str) -> list[str]:
        """The argv of a client that logs in, leaves the master behind and runs `command` on it."""
        return [
            *self._opts,
            "-M", "-S", path.replace("%", "%%"),
            "-o", f"ControlPersist={CONTROL_PERSIST}",
            "-T",
            self.alias,
            "--",
            command,
        ]  # fmt: skip

    def master_argv(self, path: str) -> list[str]:
        """The argv of a master that logs in on its stdin/stdout (our socket) and backgrounds."""
        return [
            *self._opts,
            "-o", "ProxyCommand=-",
            "-M", "-S", path.replace("%", "%%"),
            "-o", f"ControlPersist={CONTROL_PERSIST}",
            "-N",
            self.alias,
        ]  # fmt: skip

    def _login_direct_locked(self, path: str) -> None:
        """Log in on a socket of ours (ssh/direct.py); return once the master listens, or raise."""
        assert self._dir is not None
        deadline = time.monotonic() + self.login_limit
        sock = None
        try:
            sock = tcp_connect(self.effective, self.connect_timeout, self.where, deadline)
            login = DirectLogin(self.master_argv(path), sock, os.path.join(self._dir, "login.err"))
        except BaseException:
            if sock is not None:
                sock.close()
            self._stop_locked()
            raise
        rc = login.wait(deadline - time.monotonic())
        if rc is None:
            login.kill()  # not logged in by the deadline (a master forked just now still answers)
        if (rc == 0 or rc is None) and self.alive():
            self.local_address = sock.getsockname()[:2]  # the master's end of the link is ours
            login.logged_in()
            return
        login.kill()
        why = _tail(login.stderr_text())
        self._stop_locked()
        if rc is None:
            raise ConnectError(str(self.login_timeout()) + (f" ({why})" if why else ""))
        raise self.login_failed(rc, why)

    def open(self, argv: Sequence[str], *, bulk: bool = False) -> MuxChannel:
        """A channel running `argv`; without a master, one logs in first.

        Direct (`direct_refusal` is None): the master logs in here and a login that fails raises
        ConnectError from here.  Carrier: this channel's ssh logs in and leaves the master, and a
        login that fails raises ConnectError from the channel's first `recv` or `send`, as
        `connect()` would have from here.
        """
        command = shlex.join(argv)
        label = f"ssh {self.where} {command}"
        try:
            with self._lock:
                if not self._master_up_locked():
                    self._stop_locked()
                    base = "/tmp" if len(tempfile.gettempdir()) > 60 else None  # a socket path: ~100 bytes
                    self._dir = tempfile.mkdtemp(prefix="gpuhost-ssh-", dir=base)
                    path = os.path.join(self._dir, "m")
                    if self.direct_refusal is None:
                        self._login_direct_locked(path)
                    else:
                        chan = MuxChannel(
                            self, self.carrier_argv(path, command), label=label, bulk=bulk, login=True
                        )
                        self._carrier = chan
                        return chan
            return MuxChannel(self, self.argv(command), label=label, bulk=bulk)
        except OSError as exc:
            raise ConnectError(f"cannot start {self.ssh}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._stop_locked()


class _MasterLink:
    """The master as a link: `close()` asks it to exit, ending every channel on it."""

    def __init__(self, owner: OpenSSHTransport) -> None:
        self._owner = owner

    def is_active(self) -> bool:
        return self._owner.alive()

    def close(self) -> None:
        path = self._owner.control_path
        if path is not None:
            subprocess.run(
                [*self._owner._opts, "-S", path.replace("%", "%%"), "-O", "exit", self._owner.alias],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=5,
            )


class MuxChannel(ProcessChannel):
    """A program on the target, run by an `ssh` client on the master's connection.

    With `login=True` this client is the one logging in (the master's first client).  Until the
    login is seen (the program's first byte, or the master's socket answering), `recv` and `send`
    wait at most until the login's deadline, and a client that ends without leaving a master
    raises ConnectError with ssh's last words; a login not done by the deadline is killed.
    """

    def __init__(
        self, owner: OpenSSHTransport, argv: Sequence[str], *, label: str, bulk: bool, login: bool = False
    ) -> None:
        self._owner = owner
        self._login_by = time.monotonic() + owner.login_limit if login else None
        super().__init__(argv, label=label, bulk=bulk)

    def logging_in(self) -> bool:
        """Whether this client's login may still be under way (not seen done, not failed, in time)."""
        return self._login_by is not None and time.monotonic() < self._login_by and self.exit_status() is None

    def _login_check(self) -> None:
        """Called when the client ended or the deadline passed: done if a master answers, else raise."""
        if self._owner.alive():
            self._login_by = None
            return
        rc = self.exit_status(0.5)
        if rc is None:  # the deadline passed and no master: the login hangs
            super().close()
            raise self._owner.login_timeout()
        if 0 <= rc < 255:  # the program's own status: ssh(1) exits 255 for its own errors
            self._login_by = None
            return
        why = _tail(self.stderr_text())
        super().close()
        raise self._owner.login_failed(rc, why)

    def recv(self, timeout: float | None) -> bytes:
        if self._login_by is None:
            return super().recv(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            login_by = self._login_by
            if login_by is None:
                return super().recv(None if end is None else max(0.0, end - time.monotonic()))
            wait = login_by - time.monotonic()
            if end is not None:
                wait = min(wait, end - time.monotonic())
            try:
                data = super().recv(max(0.0, wait))
            except TimeoutError:
                if end is not None and time.monotonic() >= end:
                    raise
                self._login_check()  # the login's deadline: a master, or ConnectError
                continue
            if data:
                self._login_by = None  # the program runs: the login is done
            else:
                self._login_check()  # ended with nothing printed: a master, or ConnectError
            return data

    def send(self, data: bytes) -> None:
        if self._login_by is None:
            return super().send(data)
        # ssh reads our stdin only once the session runs: never block past the login's deadline
        view = memoryview(data)
        os.set_blocking(self._in, False)
        try:
            while view and self._login_by is not None:
                try:
                    view = view[os.write(self._in, view) :]
                    continue
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    return  # the reader sees EOF and reports the death
                left = self._login_by - time.monotonic()
                if not select.select([], [self._in], [], max(0.0, left))[1]:
                    self._login_check()
        finally:
            os.set_blocking(self._in, True)
        if view:
            super().send(bytes(view))
        return None

    def lost(self) -> bool:
        # ssh exits 255 when the link fails, and also for a program killed by a signal (no exit
        # status is sent then): only a master that is gone means the link went.
        return self.exit_status() == 255 and not self._owner.alive()


class OpenSSHLauncher(Launcher):
    """Run programs over one OpenSSH ControlMaster, one `ssh` client each (bulk ones too)."""

    client = "openssh"

    def __init__(self, transport: OpenSSHTransport) -> None:
        self.transport = transport
        how = (
            "login on a TCP_NODELAY socket of ours"
            if transport.direct_refusal is None
            else f"ssh connects itself: {transport.direct_refusal}"
        )
        self.description = f"ssh {transport.where} (OpenSSH client; {how})"

    def open(self, argv: Sequence[str]) -> RawChannel:
        return self.transport.open(argv)

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        return self.transport.open(argv, bulk=True)

    def close(self) -> None:
        self.transport.close()


def _quote(path: str) -> str:
    """Quote a file name for an ssh `-o` value (it splits on spaces)."""
    return '"' + path + '"' if re.search(r"\s", path) else path


def _tail(text: str) -> str:
    """The last non-empty lines of ssh's stderr, as one line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[-3:])[-400:]

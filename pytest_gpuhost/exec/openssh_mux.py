"""SSH through the system's OpenSSH client: one multiplexing master per target, a client per channel.

As Ansible and testinfra's ssh backend do, `ssh` itself reads ssh_config (`-F` from
`--ssh-config`, else the user's `~/.ssh/config` and `/etc/ssh/ssh_config`): `Host` aliases,
`User`, `Port`, `IdentityFile`, `ProxyJump`, ssh-agent keys (passphrase-protected ones included),
host certificates (`@cert-authority`) and `@revoked` keys in known_hosts.

`OpenSSHTransport` logs in once: a ControlMaster (`ssh -M -f -N`) whose socket sits in a private
temporary directory of ours (0700), with `ControlPersist` short so a master orphaned by a killed
run goes away on its own.  Every channel (the agent, the fallback's commands, bulk streams,
containers) is `ssh -S SOCKET` started as a child process: it hands its pipes to the master, so it
pays no login.  `close` asks the master to exit and removes the directory.

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
"""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from functools import lru_cache

from pytest_gpuhost.errors import ConnectError
from pytest_gpuhost.exec.channels import ProcessChannel, RawChannel
from pytest_gpuhost.exec.launch import Launcher

__all__ = ["CONTROL_PERSIST", "MuxChannel", "OpenSSHLauncher", "OpenSSHTransport", "ssh_client"]

# Seconds a master with no channel open stays up: long enough to bridge the gaps between a
# fallback target's commands, short enough that a master orphaned by a killed run leaves soon.
CONTROL_PERSIST = 60

# Preferences put first where ssh_config leaves the setting at ssh's default (an operator's own
# setting is kept).  AES-GCM: with AES-NI it costs both ends about half of chacha20-poly1305's CPU
# (839 MB in 1.9 s vs 3.1 s on this 2-core machine).  curve25519: the key exchange paramiko used;
# ssh's default sntrup761 hybrid cost the client 0.13 s of CPU per login here against 0.02 s
# (median of 5), a master 0.45 s against 0.16 s of wall time.  Set KexAlgorithms in ssh_config to
# keep the post-quantum exchange first.
_PREFERENCES = {
    "ciphers": ("Ciphers", "^aes128-gcm@openssh.com,aes256-gcm@openssh.com"),
    "kexalgorithms": ("KexAlgorithms", "^curve25519-sha256,curve25519-sha256@libssh.org"),
}


def ssh_client() -> str | None:
    """Return the OpenSSH client's path, or None where there is none (paramiko is used then)."""
    return shutil.which("ssh")


@lru_cache(maxsize=8)
def _defaults(ssh: str) -> dict[str, str]:
    """ssh's defaults for the settings we prefer, or {} when it cannot prepend (`^`, OpenSSH 8.9+)."""
    prepend = [a for key, value in _PREFERENCES.values() for a in ("-o", f"{key}={value}")]
    try:
        runs = [
            subprocess.run(
                [ssh, "-G", "-F", "/dev/null", *extra, "gpuhost.invalid"],
                capture_output=True,
                text=True,
                timeout=10,
                stdin=subprocess.DEVNULL,
            )
            for extra in (prepend, [])
        ]
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if any(r.returncode != 0 for r in runs):
        return {}
    found = _effective(runs[1].stdout)
    return {k: found[k] for k in _PREFERENCES if k in found}


def _effective(text: str) -> dict[str, str]:
    """Parse `ssh -G` output (one `keyword value` per line; the first of a repeated keyword)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        found.setdefault(key, value)
    return found


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
        self.effective = self._config()
        self.host = self.effective.get("hostname", host)
        self.port = int(self.effective.get("port", port or 22))
        self.user = self.effective.get("user", user or "")
        self.jump = self.effective.get("proxyjump", "")
        for name, default in _defaults(self.ssh).items():
            if self.effective.get(name) == default:
                key, value = _PREFERENCES[name]
                self._opts += ["-o", f"{key}={value}"]
        self._dir: str | None = None
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        via = f" via {self.jump}" if self.jump and self.jump != "none" else ""
        return f"{self.user}@{self.host}:{self.port}{via}"

    def _config(self) -> dict[str, str]:
        """What ssh makes of our options and the config for this host (`ssh -G`)."""
        try:
            out = subprocess.run(
                [*self._opts, "-G", self.alias],
                capture_output=True,
                text=True,
                timeout=10,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ConnectError(f"cannot run {self.ssh} -G {self.alias}: {exc}") from exc
        if out.returncode != 0:
            raise ConnectError(f"ssh cannot use its configuration for {self.alias}: {_tail(out.stderr)}")
        return _effective(out.stdout)

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
        """Start the master unless it runs; raise ConnectError (one line) when ssh cannot log in."""
        with self._lock:
            if not self.alive():
                self._stop_locked()
                self._start_locked()

    def _start_locked(self) -> None:
        base = "/tmp" if len(tempfile.gettempdir()) > 60 else None  # a socket path has ~100 bytes
        self._dir = tempfile.mkdtemp(prefix="gpuhost-ssh-", dir=base)
        path = self.control_path
        assert path is not None
        argv = [
            *self._opts,
            "-M", "-S", path.replace("%", "%%"),
            "-o", f"ControlPersist={CONTROL_PERSIST}",
            "-f", "-N", "-T",
            self.alias,
        ]  # fmt: skip
        log = os.path.join(self._dir, "master.log")
        with open(log, "wb") as err:
            # stderr to a file: the backgrounded master keeps it open, a pipe would never reach EOF
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
            )
        limit = (
            self.connect_timeout + 2.0
        )  # ssh's ConnectTimeout covers TCP and the banner; this covers the rest
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            self._stop_locked()
            raise ConnectError(
                f"cannot reach {self.where} within {self.connect_timeout:g}s: no SSH login completed"
            ) from None
        if rc != 0 or not self.alive():
            with open(log, encoding="utf-8", errors="replace") as f:
                why = _tail(f.read())
            self._stop_locked()
            raise ConnectError(f"ssh to {self.where} failed (exit status {rc}): {why or 'no message'}")

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

    def open(self, argv: Sequence[str], *, bulk: bool = False) -> MuxChannel:
        import shlex

        self.connect()
        command = shlex.join(argv)
        try:
            return MuxChannel(self, self.argv(command), label=f"ssh {self.where} {command}", bulk=bulk)
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
    """A program on the target, run by an `ssh` client on the master's connection."""

    def __init__(self, owner: OpenSSHTransport, argv: Sequence[str], *, label: str, bulk: bool) -> None:
        super().__init__(argv, label=label, bulk=bulk)
        self._owner = owner

    def lost(self) -> bool:
        # ssh exits 255 when the link fails, and also for a program killed by a signal (no exit
        # status is sent then): only a master that is gone means the link went.
        return self.exit_status() == 255 and not self._owner.alive()


class OpenSSHLauncher(Launcher):
    """Run programs over one OpenSSH ControlMaster, one `ssh` client each (bulk ones too)."""

    client = "openssh"

    def __init__(self, transport: OpenSSHTransport) -> None:
        self.transport = transport
        self.description = f"ssh {transport.where} (OpenSSH client)"

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

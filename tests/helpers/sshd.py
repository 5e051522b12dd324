"""Session fixture `sshd`: OpenSSH's sshd on loopback with its own host key, client key, known_hosts.

The daemon listens on two free ports of 127.0.0.1: `.port` is an ordinary login; on
`.nopython_port` every command runs with a PATH that holds a few tools but no python3 (a
`Match LocalPort` block with `ForceCommand`), for the fallback tests.  `start_sshd(...)` starts
another daemon (a different host key), e.g. to see a changed key refused, a bastion for ProxyJump
(`log_level="INFO"` to see its logins in `.log`), or one whose host key is certified by a CA
(`host_ca=`).  `ssh_agent(dir)` runs an ssh-agent and `add_key` loads a passphrase-protected key
into it through SSH_ASKPASS.  Daemons and agents are stopped by their PID.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
_TOOLS = (
    "sh",
    "cat",
    "echo",
    "printf",
    "sleep",
    "timeout",
    "env",
    "true",
    "false",
    "touch",
    "ls",
    "stat",
    "readlink",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keygen(path: Path, kind: str = "ed25519", passphrase: str = "") -> str:
    """Create a key pair (no passphrase unless given); return the public key line."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", kind, "-N", passphrase, "-C", "gpuhost-test", "-f", str(path)],
        check=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    return (path.with_name(path.name + ".pub")).read_text().strip()


@dataclass
class Sshd:
    """A running sshd and what a client needs to reach it."""

    host: str
    port: int
    user: str
    identity: str
    known_hosts: str
    host_key_line: str  # "ssh-ed25519 AAAA..." (no host name)
    nopython_port: int
    pid: int
    workdir: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    @property
    def url(self) -> str:
        return f"ssh://{self.user}@{self.host}:{self.port}"

    @property
    def nopython_url(self) -> str:
        return f"ssh://{self.user}@{self.host}:{self.nopython_port}"

    def known_hosts_line(self, port: int | None = None) -> str:
        return f"[{self.host}]:{port or self.port} {self.host_key_line}\n"

    @property
    def log(self) -> str:
        """What the daemon logged so far (at its log level)."""
        return (self.workdir / "sshd.log").read_text(errors="replace")

    def authorize(self, pubkey_line: str) -> None:
        """Let a further client key log in (sshd reads the file at each login)."""
        with open(self.workdir / "authorized_keys", "a") as f:
            f.write(pubkey_line.strip() + "\n")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(5)


def start_sshd(
    workdir: Path,
    client_pubkey: str | None = None,
    identity: Path | None = None,
    *,
    host_ca: Path | None = None,
    log_level: str = "ERROR",
) -> Sshd:
    """Start sshd in `workdir` with a fresh host key; reuse a client key if given.

    With `host_ca` (a CA private key), the host key is certified for 127.0.0.1 (`ssh-keygen -s
    CA -h`) and sshd presents the certificate.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd insists on its privsep directory
    except PermissionError:
        pytest.skip("sshd needs /run/sshd, which only root can create here")
    host_key = workdir / "ssh_host_ed25519_key"
    host_pub = keygen(host_key)
    cert_lines = []
    if host_ca is not None:
        subprocess.run(
            ["ssh-keygen", "-q", "-s", str(host_ca), "-I", "gpuhost-test-host", "-h", "-n", "127.0.0.1",
             "-V", "-5m:+1d", str(host_key) + ".pub"],
            check=True, timeout=30, stdin=subprocess.DEVNULL, capture_output=True,
        )  # fmt: skip
        cert_lines = [f"HostCertificate {host_key}-cert.pub"]
    if identity is None:
        identity = workdir / "id_ed25519"
        client_pubkey = keygen(identity)
    assert client_pubkey
    (workdir / "authorized_keys").write_text(client_pubkey + "\n")
    nopy = workdir / "nopython-bin"
    nopy.mkdir(exist_ok=True)
    for tool in _TOOLS:
        found = shutil.which(tool)
        if found and not (nopy / tool).exists():
            os.symlink(found, nopy / tool)
    port, nopython_port = free_port(), free_port()
    config = workdir / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                f"Port {nopython_port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {host_key}",
                *cert_lines,
                f"PidFile {workdir / 'sshd.pid'}",
                f"AuthorizedKeysFile {workdir / 'authorized_keys'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "UseDNS no",
                "MaxSessions 50",
                "MaxStartups 100:30:200",
                f"LogLevel {log_level}",
                "Subsystem sftp internal-sftp",
                f"Match LocalPort {nopython_port}",
                f'    ForceCommand PATH={nopy}; export PATH; eval "$SSH_ORIGINAL_COMMAND"',
                "",
            ]
        )
    )
    subprocess.run([SSHD, "-t", "-f", str(config)], check=True, timeout=30)
    with open(workdir / "sshd.log", "ab") as log:
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd did not start: {(workdir / 'sshd.log').read_text()[-500:]}"
                ) from None
            time.sleep(0.05)
    known = workdir / "known_hosts"
    sshd = Sshd(
        host="127.0.0.1",
        port=port,
        user=getpass.getuser(),
        identity=str(identity),
        known_hosts=str(known),
        host_key_line=" ".join(host_pub.split()[:2]),
        nopython_port=nopython_port,
        pid=proc.pid,
        workdir=workdir,
        proc=proc,
    )
    known.write_text(sshd.known_hosts_line() + sshd.known_hosts_line(nopython_port))
    return sshd


@contextmanager
def ssh_agent(workdir: Path) -> Iterator[str]:
    """Run an ssh-agent on a socket in `workdir`; yield the socket path (SSH_AUTH_SOCK)."""
    sock = workdir / "agent.sock"
    proc = subprocess.Popen(
        ["ssh-agent", "-D", "-a", str(sock)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ssh-agent did not start")
            time.sleep(0.02)
        yield str(sock)
    finally:
        proc.terminate()
        proc.wait(5)


def add_key(agent_sock: str, key: Path, passphrase: str) -> None:
    """Load a passphrase-protected key into the agent, the passphrase typed by SSH_ASKPASS."""
    askpass = key.with_name(key.name + ".askpass")
    askpass.write_text("#!/bin/sh\necho '" + passphrase + "'\n")  # a test passphrase, no quotes in it
    askpass.chmod(0o700)
    env = {**os.environ, "SSH_AUTH_SOCK": agent_sock, "SSH_ASKPASS": str(askpass)}
    env.update(SSH_ASKPASS_REQUIRE="force", DISPLAY=env.get("DISPLAY", ":0"))
    subprocess.run(
        ["ssh-add", str(key)], env=env, check=True, timeout=30, stdin=subprocess.DEVNULL, capture_output=True
    )


@pytest.fixture(params=("openssh", "paramiko"))
def ssh_client_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Which SSH client targets are reached with: "paramiko" hides `ssh` from PATH (the fallback).

    The ssh-keygen/ssh-agent/ssh-add that tests run stay reachable; SSH_AUTH_SOCK is unset.
    """
    if request.param == "paramiko":
        bindir = tmp_path / "no-ssh-here"
        bindir.mkdir()
        for tool in ("ssh-keygen", "ssh-agent", "ssh-add"):
            found = shutil.which(tool)
            assert found, tool
            os.symlink(found, bindir / tool)
        monkeypatch.setenv("PATH", str(bindir))
    elif shutil.which("ssh") is None:
        pytest.skip("no OpenSSH client (ssh) installed")
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return str(request.param)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """OpenSSH's sshd on 127.0.0.1 (free ports), its host key already in `.known_hosts`."""
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
        pytest.skip("OpenSSH server (sshd, ssh-keygen) is not installed")
    daemon = start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield daemon
    finally:
        daemon.stop()

"""Session fixture `sshd`: OpenSSH's sshd on loopback with its own host key, client key, known_hosts.

The daemon listens on two free ports of 127.0.0.1: `.port` is an ordinary login; on
`.nopython_port` every command runs with a PATH that holds a few tools but no python3 (a
`Match LocalPort` block with `ForceCommand`), for the fallback tests.  `start_sshd(...)` starts
another daemon (a different host key), e.g. to see a changed key refused.  Daemons are stopped
by their PID.
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


def keygen(path: Path, kind: str = "ed25519") -> str:
    """Create a key pair without passphrase; return the public key line."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "gpuhost-test", "-f", str(path)],
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

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(5)


def start_sshd(workdir: Path, client_pubkey: str | None = None, identity: Path | None = None) -> Sshd:
    """Start sshd in `workdir` with a fresh host key; reuse a client key if given."""
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd insists on its privsep directory
    except PermissionError:
        pytest.skip("sshd needs /run/sshd, which only root can create here")
    host_key = workdir / "ssh_host_ed25519_key"
    host_pub = keygen(host_key)
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
                "LogLevel ERROR",
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

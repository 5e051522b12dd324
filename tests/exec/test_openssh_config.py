"""SSH as operators use it, against real sshd processes on loopback, with and without `ssh`.

Each case runs twice: through the system's OpenSSH client (a ControlMaster per target), and
through the paramiko fallback, with a PATH that holds no `ssh` (as on a machine without the
client).  Cases: an ssh_config `Host` alias, a ProxyJump bastion, a passphrase-protected key
served by ssh-agent, a `@cert-authority` host certificate (the fallback refuses it in one line,
as it cannot verify certificates), a `@revoked` key (refused by both), and a hung server (one
line within the connect timeout).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from pytest_gpuhost.errors import ConnectError
from pytest_gpuhost.exec.launch import PrefixLauncher
from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url
from tests.helpers.sshd import add_key, keygen, ssh_agent, start_sshd


@pytest.fixture
def client(ssh_client_kind: str) -> str:
    return ssh_client_kind


def _pub(sshd) -> str:
    return Path(sshd.identity + ".pub").read_text().strip()


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and len(msg) < 600, msg
    return msg


def _config(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_ssh_config_alias(client, sshd, tmp_path):
    """`Host` alias with HostName, Port, User, IdentityFile, UserKnownHostsFile from the config.

    The config's RemoteCommand and RequestTTY would break our programs: ours win over them.  A
    port written in the URL wins over the config's, as `ssh -p` does.
    """
    cfg = _config(
        tmp_path / "ssh_config",
        f"Host gpu-alias gpu-misported\n  HostName {sshd.host}\n  User {sshd.user}\n"
        f"  IdentityFile {sshd.identity}\n  UserKnownHostsFile {sshd.known_hosts}\n"
        "  RemoteCommand echo hijacked\n  RequestTTY yes\n"
        f"Host gpu-alias\n  Port {sshd.port}\n"
        "Host gpu-misported\n  Port 1\n",
    )
    spec = parse_host_url("ssh://gpu-alias")
    with open_connection(spec, TargetOptions(ssh_config=cfg, connect_timeout=5)) as c:
        assert c.launcher.client == client
        assert c.run(["echo", "$SSH_CONNECTION"]).stdout == "$SSH_CONNECTION\n"
        assert c.run("echo $SSH_CONNECTION").stdout.split()[3] == str(sshd.port)
        assert f"{sshd.user}@{sshd.host}:{sshd.port}" in c.launcher.description
    with open_connection(
        parse_host_url(f"ssh://gpu-misported:{sshd.port}"), TargetOptions(ssh_config=cfg)
    ) as c:
        assert c.run(["echo", "explicit port"]).stdout == "explicit port\n"
    with pytest.raises(ConnectError, match="ssh config file .* not found"):
        open_connection(spec, TargetOptions(ssh_config=str(tmp_path / "missing"), connect_timeout=5))


def test_proxyjump_through_a_bastion(client, sshd, tmp_path):
    bastion = start_sshd(
        tmp_path / "bastion", identity=Path(sshd.identity), client_pubkey=_pub(sshd), log_level="INFO"
    )
    try:
        kh = tmp_path / "known_hosts"
        kh.write_text(sshd.known_hosts_line() + bastion.known_hosts_line())
        common = f"  User {sshd.user}\n  IdentityFile {sshd.identity}\n  UserKnownHostsFile {kh}\n"
        cfg = _config(
            tmp_path / "ssh_config",
            f"Host bastion\n  HostName {bastion.host}\n  Port {bastion.port}\n{common}"
            "  StrictHostKeyChecking yes\n  BatchMode yes\n"
            f"Host gpu-behind\n  HostName {sshd.host}\n  Port {sshd.port}\n  ProxyJump bastion\n{common}",
        )
        assert "Accepted publickey" not in bastion.log
        with open_connection(parse_host_url("ssh://gpu-behind"), TargetOptions(ssh_config=cfg)) as c:
            assert c.launcher.client == client
            assert c.run(["echo", "behind"]).stdout == "behind\n"
            assert c.run("echo $SSH_CONNECTION").stdout.split()[3] == str(sshd.port)
            assert bastion.log.count("Accepted publickey") == 1  # the login went through the bastion
        bastion.stop()
        with pytest.raises(ConnectError) as info:
            open_connection(
                parse_host_url("ssh://gpu-behind"), TargetOptions(ssh_config=cfg, connect_timeout=3)
            )
        _one_line(info.value)
    finally:
        bastion.stop()


def test_passphrase_key_served_by_ssh_agent(client, sshd, tmp_path, monkeypatch):
    key = tmp_path / "id_locked"
    sshd.authorize(keygen(key, passphrase="correct horse"))
    opts = TargetOptions(identity=str(key), known_hosts=sshd.known_hosts, connect_timeout=5)
    with pytest.raises(ConnectError) as info:  # not in any agent: refused in one line, no TypeError
        open_connection(parse_host_url(sshd.url), opts)
    _one_line(info.value)
    with ssh_agent(tmp_path) as sock:
        add_key(sock, key, "correct horse")
        monkeypatch.setenv("SSH_AUTH_SOCK", sock)
        with open_connection(parse_host_url(sshd.url), opts) as c:
            assert c.launcher.client == client
            assert c.run(["echo", "unlocked"]).stdout == "unlocked\n"


def test_cert_authority_host_certificate(client, sshd, tmp_path):
    ca = tmp_path / "host_ca"
    ca_pub = keygen(ca)
    other = start_sshd(
        tmp_path / "certified", identity=Path(sshd.identity), client_pubkey=_pub(sshd), host_ca=ca
    )
    try:
        kh = tmp_path / "known_hosts"
        kh.write_text(f"# fleet CA\n@cert-authority 127.0.0.* {' '.join(ca_pub.split()[:2])}\n")
        opts = TargetOptions(identity=sshd.identity, known_hosts=str(kh), connect_timeout=5)
        if client == "openssh":
            with open_connection(parse_host_url(other.url), opts) as c:
                assert c.run(["echo", "certified"]).stdout == "certified\n"
        else:
            with pytest.raises(ConnectError) as info:
                open_connection(parse_host_url(other.url), opts)
            assert _one_line(info.value).startswith(
                f"host [127.0.0.1]:{other.port} is vouched for by @cert-authority in {kh} line 2, "
                "which the paramiko fallback cannot verify"
            )
        # A CA that did not sign the key: refused under the strict policy.  Under accept-new,
        # ssh takes the plain key as a new one (and records it); the fallback refuses still.
        wrong = tmp_path / "wrong_known_hosts"
        wrong.write_text(f"@cert-authority * {sshd.host_key_line}\n")
        for policy in ("strict", "accept-new"):
            options = TargetOptions(identity=sshd.identity, known_hosts=str(wrong), host_key_policy=policy)
            if client == "openssh" and policy == "accept-new":
                with open_connection(parse_host_url(other.url), options) as c:
                    assert c.run(["true"]).ok
                assert wrong.read_text().count("\n") == 2
                continue
            with pytest.raises(ConnectError) as info:
                open_connection(parse_host_url(other.url), options)
            _one_line(info.value)
    finally:
        other.stop()


def test_revoked_host_key_refused(client, sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(sshd.known_hosts_line() + f"@revoked * {sshd.host_key_line}\n")
    for policy in ("strict", "accept-new"):
        opts = TargetOptions(identity=sshd.identity, known_hosts=str(kh), host_key_policy=policy)
        with pytest.raises(ConnectError) as info:
            open_connection(parse_host_url(sshd.url), opts)
        msg = _one_line(info.value)
        if client == "paramiko":
            assert msg.startswith(f"host key for [127.0.0.1]:{sshd.port} is marked @revoked in {kh} line 2")
        else:
            assert "revoked" in msg.lower()  # ssh's own words, passed on
    assert kh.read_text().count("\n") == 2  # accept-new wrote nothing


def test_hung_server_is_one_line_within_the_connect_timeout(client, tmp_path, caplog):
    """TCP accepted (the kernel's backlog), no SSH banner ever: one line, within the timeout."""
    caplog.set_level(logging.DEBUG)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        port = hung.getsockname()[1]
        opts = TargetOptions(connect_timeout=1, known_hosts=str(tmp_path / "kh"))
        t0 = time.monotonic()
        with pytest.raises(ConnectError) as info:
            open_connection(parse_host_url(f"ssh://root@127.0.0.1:{port}"), opts)
        assert time.monotonic() - t0 < 4
    msg = _one_line(info.value)
    assert f"127.0.0.1:{port}" in msg or f"127.0.0.1 port {port}" in msg
    noisy = [r for r in caplog.records if r.name.startswith(("paramiko", "pytest_gpuhost"))]
    assert [r.getMessage() for r in noisy if r.levelno >= logging.WARNING] == []


def test_master_is_shared_and_closed(sshd, tmp_path):
    """Later channels (bulk, a container by the same login) use the master: no new login."""
    opts = TargetOptions(identity=sshd.identity, known_hosts=sshd.known_hosts)
    c = open_connection(parse_host_url(sshd.url), opts)
    transport = c.launcher.transport
    try:
        assert c.launcher.client == "openssh"
        sock = transport.control_path
        assert sock and os.stat(os.path.dirname(sock)).st_mode & 0o777 == 0o700
        agent_conn = c.run("echo $SSH_CONNECTION").stdout.split()[1]
        with c.open_channel(["sh", "-c", 'echo "$SSH_CONNECTION"']) as ch:
            bulk_conn = ch.read_exact(200, 10).decode().split()[1]
        assert bulk_conn == agent_conn  # the same TCP connection: the master's
        inner = PrefixLauncher(c.launcher, ["env", "IN_CONTAINER=1"], "a container through the host")
        assert inner.client == "openssh"
        with inner.open(["sh", "-c", 'echo "$IN_CONTAINER $SSH_CONNECTION"']) as ch:
            flag, _, conn_port, *_ = ch.read_exact(200, 10).decode().split()
        assert (flag, conn_port) == ("1", agent_conn)
    finally:
        c.close()
    assert not os.path.exists(os.path.dirname(sock)) and not transport.alive()


def test_operators_algorithms_are_left_alone(tmp_path):
    """curve25519/AES-GCM go first only where ssh_config leaves ssh's defaults."""
    if shutil.which("ssh") is None:
        pytest.skip("no OpenSSH client (ssh) installed")
    from pytest_gpuhost.exec.ssh.openssh import OpenSSHTransport

    cfg = _config(tmp_path / "ssh_config", "Host pq\n  KexAlgorithms sntrup761x25519-sha512@openssh.com\n")
    mine = OpenSSHTransport("pq", ssh_config=cfg, connect_timeout=10)
    other = OpenSSHTransport("elsewhere", ssh_config=cfg, connect_timeout=10)
    assert not any(o.startswith("KexAlgorithms=") for o in mine._opts)
    assert any(o.startswith("Ciphers=^aes128-gcm") for o in mine._opts)
    assert any(o.startswith("KexAlgorithms=^curve25519-sha256") for o in other._opts)

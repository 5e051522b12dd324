"""SSH targets against OpenSSH's sshd on loopback: host keys, auth, reachability, agent, fallback.

Tests taking `ssh_client_kind` run twice: through the OpenSSH client, and through paramiko with
no `ssh` on PATH.  The OpenSSH client's refusals carry ssh's own words after ours.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from pytest_gpuhost.errors import AgentError, ConnectError
from pytest_gpuhost.exec.connect import connect
from pytest_gpuhost.exec.ssh.paramiko import SSHLauncher, SSHTransport
from pytest_gpuhost.exec.targets import TargetOptions, TargetPool, open_connection, parse_host_url
from tests.helpers.sshd import keygen, start_sshd


def opts(sshd, **kw) -> TargetOptions:
    base = {"identity": sshd.identity, "known_hosts": sshd.known_hosts, "connect_timeout": 5.0}
    base.update(kw)
    return TargetOptions(**base)


@pytest.fixture(scope="module")
def conn(sshd):
    c = open_connection(parse_host_url(sshd.url), opts(sshd))
    yield c
    c.close()


def test_agent_over_one_channel(conn, sshd):
    assert conn.mode == "agent" and conn.name == "127.0.0.1"
    r = conn.run(["echo", "$(id)", "a'b"])
    assert r.stdout == "$(id) a'b\n"
    t0 = time.monotonic()
    for _ in range(50):
        conn.run(["true"])
    per_cmd = (time.monotonic() - t0) / 50
    assert per_cmd < 0.05  # a channel per command costs ~150 ms; one agent a few ms
    got = conn.read_files(["/proc/version", "/etc/hostname", "/nonexistent"])
    assert "Linux" in str(got["/proc/version"]) and isinstance(got["/nonexistent"], OSError)


def test_timeout_enforced_on_target(conn):
    t0 = time.monotonic()
    r = conn.run("echo partial; sleep 100", timeout=1)
    assert r.timed_out and r.rc == -9 and r.stdout == "partial\n"
    assert time.monotonic() - t0 < 3
    assert conn.run(["echo", "next"]).stdout == "next\n"


def test_blocked_write_over_ssh(conn, tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    wr = conn.write_file(str(fifo), "identity", timeout=0.5)
    assert wr.timed_out
    assert conn.run(["true"]).ok


def test_raw_channel_beside_agent(conn):
    with conn.open_channel(["sh", "-c", "head -c 100000 /dev/zero | cat"]) as ch:
        assert ch.read_exact(100000, 10) == b"\0" * 100000
        assert ch.exit_status(5) == 0
    assert conn.run(["true"]).ok


_REFUSED = {
    "unknown": {
        "paramiko": r"not in .*known_hosts.*refusing under the strict policy",
        "openssh": r"^ssh to root@127\.0\.0\.1:\d+ failed \(exit status 255\): .*No ED25519 host key is known",
    },
    "auth": {
        "paramiko": r"SSH authentication as root@127\.0\.0\.1:\d+ failed .*permission denied",
        "openssh": r"^ssh to root@127\.0\.0\.1:\d+ failed \(exit status 255\): .*Permission denied \(publickey\)",
    },
    "refused": {
        "paramiko": "cannot reach 127.0.0.1:[0-9]+: Connection refused",
        "openssh": "cannot reach root@127.0.0.1:[0-9]+: Connection refused",
    },
}


def test_unknown_host_key_refused_by_default(sshd, tmp_path, ssh_client_kind):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(ConnectError, match=_REFUSED["unknown"][ssh_client_kind]) as info:
        open_connection(parse_host_url(sshd.url), opts(sshd, known_hosts=str(empty)))
    assert "\n" not in str(info.value)
    assert empty.read_text() == ""


def test_accept_new_records_key_then_strict_accepts(sshd, tmp_path, ssh_client_kind):
    kh = tmp_path / "sub" / "known_hosts"
    kh.parent.mkdir()
    c = open_connection(
        parse_host_url(sshd.url), opts(sshd, known_hosts=str(kh), host_key_policy="accept-new")
    )
    c.close()
    if ssh_client_kind == "paramiko":
        assert kh.read_text() == sshd.known_hosts_line()
    else:  # ssh writes the line itself, hashed where ssh_config says HashKnownHosts (Debian's does)
        line = kh.read_text()
        assert line.count("\n") == 1 and line.rstrip().endswith(sshd.host_key_line)
    c = open_connection(parse_host_url(sshd.url), opts(sshd, known_hosts=str(kh)))
    assert c.run(["true"]).ok
    c.close()


def test_hashed_known_hosts_entry_accepted(sshd, tmp_path):
    import paramiko

    name = f"[{sshd.host}]:{sshd.port}"
    kh = tmp_path / "known_hosts"
    kh.write_text(paramiko.HostKeys.hash_host(name) + " " + sshd.host_key_line + "\n")
    c = open_connection(parse_host_url(sshd.url), opts(sshd, known_hosts=str(kh)))
    assert c.run(["true"]).ok
    c.close()


def test_changed_host_key_refused_under_every_policy(sshd, tmp_path, ssh_client_kind):
    other = start_sshd(tmp_path / "other", identity=Path(sshd.identity), client_pubkey=_pub(sshd))
    try:
        kh = tmp_path / "known_hosts"
        # line 3 claims the other daemon's address has the first daemon's key
        kh.write_text(
            "# fleet keys\n127.0.0.9 " + sshd.host_key_line + "\n" + sshd.known_hosts_line(other.port)
        )
        for policy in ("strict", "accept-new"):
            with pytest.raises(ConnectError) as exc:
                open_connection(
                    parse_host_url(other.url), opts(sshd, known_hosts=str(kh), host_key_policy=policy)
                )
            msg = str(exc.value)
            if ssh_client_kind == "paramiko":
                assert msg.startswith(
                    f"host key for [127.0.0.1]:{other.port} does not match {kh} line 3: refusing"
                )
            else:
                assert msg.startswith(f"ssh to root@127.0.0.1:{other.port} failed (exit status 255): ")
                assert f"Host key for [127.0.0.1]:{other.port} has changed" in msg
            assert "\n" not in msg
        assert kh.read_text().count("\n") == 3
    finally:
        other.stop()


def _pub(sshd) -> str:
    return Path(sshd.identity + ".pub").read_text().strip()


def test_authentication_failure(sshd, tmp_path, ssh_client_kind):
    wrong = tmp_path / "wrong_key"
    keygen(wrong)
    with pytest.raises(ConnectError, match=_REFUSED["auth"][ssh_client_kind]):
        open_connection(parse_host_url(sshd.url), opts(sshd, identity=str(wrong)))
    if ssh_client_kind == "paramiko":  # ssh warns about a missing -i file and goes on with the agent
        with pytest.raises(ConnectError, match="identity file .* not found"):
            open_connection(parse_host_url(sshd.url), opts(sshd, identity=str(tmp_path / "missing")))


@pytest.fixture
def black_hole():
    """Yield a lab-range address that answers nothing: a veth whose far end sits down in our own netns.

    Traffic to it never leaves this machine (the route points into the veth, whose peer is down).
    """
    if os.geteuid() != 0:
        pytest.skip("needs root for a network namespace")
    ns, veth = f"gh-bh{os.getpid() % 10000}", f"ghbh{os.getpid() % 10000}"
    sh = ["ip", "netns", "add", ns], ["ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p"]
    for argv in sh:
        subprocess.run(argv, check=True, capture_output=True)
    try:
        for argv in (
            ["ip", "link", "set", veth + "p", "netns", ns],
            ["ip", "addr", "add", "198.18.254.1/30", "dev", veth],
            ["ip", "link", "set", veth, "up"],
        ):
            subprocess.run(argv, check=True, capture_output=True)
        yield "198.18.254.2"
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_unreachable_within_connect_timeout(tmp_path, black_hole, ssh_client_kind):
    t0 = time.monotonic()
    where = {
        "paramiko": r"cannot reach 198\.18\.254\.2:22",
        "openssh": r"cannot reach root@198\.18\.254\.2:22 within 1s: timed out",
    }
    with pytest.raises(ConnectError, match=where[ssh_client_kind]):
        open_connection(
            parse_host_url(f"ssh://root@{black_hole}"),
            TargetOptions(connect_timeout=1.0, known_hosts=str(tmp_path / "kh")),
        )
    assert time.monotonic() - t0 < 2.5


def test_refused_port(sshd, tmp_path, ssh_client_kind):
    from tests.helpers.sshd import free_port

    with pytest.raises(ConnectError, match=_REFUSED["refused"][ssh_client_kind]):
        open_connection(parse_host_url(f"ssh://root@127.0.0.1:{free_port()}"), opts(sshd))


def test_fallback_over_ssh_without_python(sshd):
    c = open_connection(parse_host_url(sshd.nopython_url), opts(sshd))
    try:
        assert c.mode == "fallback"
        r = c.run(["printf", "%s", "$(echo no)"])
        assert r.stdout == "$(echo no)"
        t0 = time.monotonic()
        r = c.run("echo part; sleep 100", timeout=1)
        assert r.timed_out and r.stdout == "part\n" and time.monotonic() - t0 < 3.5
        assert "Linux" in str(c.read_files(["/proc/version"])["/proc/version"])
    finally:
        c.close()


def test_agent_death_over_ssh_reconnects(sshd):
    c = open_connection(parse_host_url(sshd.url), opts(sshd))
    try:
        first = c.hello["pid"]
        with pytest.raises(AgentError, match="died"):
            c.run("kill -9 $PPID")
        assert c.run(["echo", "again"]).stdout == "again\n"
        assert c.hello["pid"] != first
    finally:
        c.close()


def test_container_by_own_ssh_and_pool(sshd):
    pool = TargetPool(opts(sshd))
    spec = parse_host_url(sshd.url)
    try:
        host = pool.get(spec)
        assert pool.get(spec) is host
        inner = pool.container(spec, _container(sshd))
        assert inner is not None and inner is not host
        assert inner.run(["echo", "in"]).stdout == "in\n"
        assert pool.container(spec, _container(sshd)) is inner
    finally:
        pool.close_all()
    with pytest.raises(AgentError, match="closed"):
        host.run(["true"])


def test_pool_tells_apart_two_daemons_on_one_address(sshd, tmp_path):
    other = start_sshd(tmp_path / "other", identity=Path(sshd.identity), client_pubkey=_pub(sshd))
    pool = TargetPool(opts(sshd, host_key_policy="accept-new", known_hosts=str(tmp_path / "kh")))
    try:
        a = pool.get(parse_host_url(sshd.url))
        b = pool.get(parse_host_url(other.url))
        assert a is not b and a.name == b.name == "127.0.0.1"
    finally:
        pool.close_all()
        other.stop()


def _container(sshd):
    from pytest_gpuhost.exec.targets import parse_container

    return parse_container(sshd.url)


def _ssh_client_port(text: str) -> str:
    return text.split()[1]  # SSH_CLIENT is "client-address client-port server-port"


def test_bulk_channel_runs_under_the_openssh_client(conn):
    """Bulk bytes travel on the OpenSSH master's connection (C crypto), beside the agent's channel."""
    assert conn.launcher.client == "openssh"
    agent_port = _ssh_client_port(conn.run("echo $SSH_CLIENT").stdout)
    with conn.open_channel(["sh", "-c", 'echo "$SSH_CLIENT"; head -c 3000000 /dev/zero']) as ch:
        first = b""
        while not first.endswith(b"\n"):
            first += ch.read_exact(1, 10)
        assert ch.read_exact(3_000_000, 10) == b"\0" * 3_000_000
        assert ch.exit_status(5) == 0
    assert _ssh_client_port(first.decode()) == agent_port  # one login: the master's


def _paramiko(sshd) -> SSHLauncher:
    """A paramiko launcher, as the fallback builds it, whose bulk channels try `ssh` first."""
    return SSHLauncher(
        SSHTransport(
            sshd.host, sshd.port, identity=sshd.identity, known_hosts=sshd.known_hosts, connect_timeout=10
        )
    )


def test_paramiko_bulk_channel_runs_under_the_openssh_client(sshd):
    """A paramiko transport built by hand still sends bulk bytes through `ssh` on a login of its own."""
    c = connect("t", _paramiko(sshd))
    try:
        agent_port = _ssh_client_port(c.run("echo $SSH_CLIENT").stdout)
        with c.open_channel(["sh", "-c", 'echo "$SSH_CLIENT"']) as ch:
            bulk_port = _ssh_client_port(ch.read_exact(100, 10).decode())
        assert bulk_port != agent_port
        assert c.launcher.transport.bulk_fallback == ""
    finally:
        c.close()


def test_bulk_channel_falls_back_to_paramiko_when_ssh_cannot_log_in(sshd, tmp_path, monkeypatch):
    """An ssh client that exits 255 before the program spoke: same program, same stdin, on paramiko."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(
        f"#!/bin/sh\necho x >> {calls}\ncat >/dev/null\n"
        "echo 'ssh: connect to host 127.0.0.1: Connection refused' >&2\nexit 255\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    c = connect("t", _paramiko(sshd))
    try:
        for round_ in (1, 2):
            with c.open_channel(["sh", "-c", "cat; echo done >&2"]) as ch:
                ch.send(b"payload %d" % round_)
                ch.close_stdin()
                assert ch.read_exact(9, 10) == b"payload %d" % round_
                assert ch.read_exact(1, 10) == b""
                assert ch.exit_status(5) == 0 and "done" in ch.stderr_text()
        why = c.launcher.transport.bulk_fallback
        assert why.startswith("ssh client exited 255") and "Connection refused" in why
        assert calls.read_text().count("x") == 1  # the second channel went straight to paramiko
    finally:
        c.close()


def test_bulk_channel_without_an_ssh_client(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh here; the remote side keeps its own PATH
    c = open_connection(parse_host_url(sshd.url), opts(sshd))
    try:
        with c.open_channel(["sh", "-c", "head -c 5 /dev/zero"]) as ch:
            assert ch.read_exact(5, 10) == b"\0" * 5
        assert c.launcher.transport.bulk_fallback == "no OpenSSH client (ssh) on PATH"
    finally:
        c.close()

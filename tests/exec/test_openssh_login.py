"""The OpenSSH transport's login, both ways it is made.

- direct: the master logs in on a TCP socket of ours (`TCP_NODELAY` from the first byte,
  `ProxyCommand=-`; exec/ssh/direct.py), wherever ssh would connect on its own;
- carrier: where ssh must connect itself (`ProxyJump`, `ProxyCommand`, `CheckHostIP`, ...), the
  first channel's `ssh` logs in and runs its program (here: `CheckHostIP yes` in an ssh_config).

Against real sshd processes on loopback: the agent's channel and later channels share the one
login; threads opening channels while a login runs wait for it instead of starting a second; a
login that fails or hangs is a ConnectError of one line (from `open`, or from the channel's `recv`
or `send`), as `connect()` gives; ssh_config's `BindAddress` and `AddressFamily` hold when we make
the connection.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from pytest_gpuhost.errors import ConnectError

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client (ssh) installed")


@pytest.fixture(params=["direct", "carrier"])
def way(request, tmp_path) -> str | None:
    """The login path: None (direct) or an ssh_config that makes ssh connect itself."""
    if request.param == "direct":
        return None
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n    CheckHostIP yes\n")
    return str(config)


def _transport(sshd, config=None, **kw):
    from pytest_gpuhost.exec.ssh.openssh import OpenSSHTransport

    base = {"identity": sshd.identity, "known_hosts": sshd.known_hosts, "connect_timeout": 5.0}
    t = OpenSSHTransport(sshd.host, sshd.port, sshd.user, ssh_config=config, **{**base, **kw})
    assert (t.direct_refusal is None) == (config is None), t.direct_refusal
    return t


def _logins(sshd) -> int:
    return sshd.log.count("Accepted publickey")


@pytest.fixture
def logged(tmp_path, sshd):
    """An sshd that logs each login (INFO), with the session sshd's client key."""
    from tests.helpers.sshd import start_sshd

    pub = Path(sshd.identity + ".pub").read_text().strip()
    d = start_sshd(tmp_path / "logged", client_pubkey=pub, identity=Path(sshd.identity), log_level="INFO")
    try:
        yield d
    finally:
        d.stop()


def test_first_channel_logs_in_and_later_ones_share_it(logged, way):
    t = _transport(logged, way)
    try:
        with t.open(["sh", "-c", 'echo "$SSH_CONNECTION"']) as first:
            client_addr, first_conn = first.read_exact(200, 10).decode().split()[:2]
            assert first.exit_status(5) == 0
        if way is None:  # the master logged in on the TCP socket we connected (TCP_NODELAY set)
            assert t.local_address == (client_addr, int(first_conn))
        else:
            assert t.local_address is None
        assert t.alive()  # ControlPersist: the master outlives its first client
        with t.open(["sh", "-c", 'echo "$SSH_CONNECTION"']) as later:
            assert later.read_exact(200, 10).decode().split()[1] == first_conn
        assert _logins(logged) == 1
    finally:
        t.close()
    assert not t.alive()
    from pytest_gpuhost.exec.ssh.openssh import OpenSSHLauncher

    how = OpenSSHLauncher(t).description  # the evidence's "via": which login, and why
    assert how.endswith(
        "login on a TCP_NODELAY socket of ours)" if way is None else "CheckHostIP needs ssh's own connection)"
    )


def test_threads_opening_during_the_login_share_it(logged, way):
    t = _transport(logged, way)
    seen: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def one() -> None:
        try:
            start.wait()
            with t.open(["sh", "-c", 'echo "$SSH_CONNECTION"']) as ch:
                seen.append(ch.read_exact(200, 10).decode().split()[1])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert errors == [] and len(seen) == 4 and len(set(seen)) == 1
        assert _logins(logged) == 1
    finally:
        t.close()


def test_a_failed_login_is_a_connect_error_of_one_line(sshd, tmp_path, way):
    from tests.helpers.sshd import keygen

    keygen(tmp_path / "stranger")
    t = _transport(sshd, way, identity=str(tmp_path / "stranger"))
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectError) as info:
            ch = t.open(["cat"])  # direct: the login is over before open returns
            ch.send(b"x" * (1 << 20))  # more than a pipe holds: ssh never reads it
            ch.recv(30)
        assert time.monotonic() - t0 < 10
        msg = str(info.value)
        assert "\n" not in msg and f"{sshd.host}:{sshd.port}" in msg
        assert "exit status 255" in msg and "Permission denied" in msg
        assert not t.alive()
    finally:
        t.close()


def test_a_login_that_hangs_after_the_banner_is_cut_at_its_deadline(tmp_path, way):
    """A server that sends its banner and then nothing: ssh would wait on; we stop at the deadline."""
    from pytest_gpuhost.exec.ssh.openssh import OpenSSHTransport

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        held: list[socket.socket] = []

        def serve() -> None:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)
            conn.sendall(b"SSH-2.0-OpenSSH_9.2p1 stalled\r\n")

        threading.Thread(target=serve, daemon=True).start()
        t = OpenSSHTransport(
            "127.0.0.1", port, "root", known_hosts=str(tmp_path / "kh"), connect_timeout=1.0, ssh_config=way
        )
        try:
            t0 = time.monotonic()
            with pytest.raises(ConnectError, match=r"within 1s: no SSH login completed"):
                ch = t.open(["true"])
                ch.recv(60)
            assert time.monotonic() - t0 < 6
            if way is not None:
                assert ch.exit_status(2) is not None  # the client was killed
            left = [ln for ln in _ssh_cmdlines() if ln.split(" ")[0].endswith("ssh") and f" -p {port} " in ln]
            assert left == []
        finally:
            t.close()
            for c in held:
                c.close()
    assert t.control_path is None  # its directory was removed


def _ssh_cmdlines() -> list[str]:
    """The command lines of every process running now (to see no login was left behind)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


def test_direct_connection_honours_bind_address_and_address_family(logged, tmp_path):
    """Where we connect for ssh, ssh_config's BindAddress and AddressFamily still hold."""
    config = tmp_path / "bind_config"
    config.write_text("Host *\n    BindAddress 127.0.0.2\n")
    from pytest_gpuhost.exec.ssh.openssh import OpenSSHTransport

    base = {"identity": logged.identity, "known_hosts": logged.known_hosts, "connect_timeout": 5.0}
    t = OpenSSHTransport(logged.host, logged.port, logged.user, ssh_config=str(config), **base)
    assert t.direct_refusal is None
    try:
        with t.open(["sh", "-c", 'echo "$SSH_CONNECTION"']) as ch:
            assert ch.read_exact(200, 10).decode().split()[0] == "127.0.0.2"
    finally:
        t.close()
    config.write_text("Host *\n    AddressFamily inet6\n")
    t = OpenSSHTransport(logged.host, logged.port, logged.user, ssh_config=str(config), **base)
    try:
        with pytest.raises(ConnectError) as info:
            t.open(["true"])
        assert "\n" not in str(info.value) and "127.0.0.1" in str(info.value)
    finally:
        t.close()


def test_direct_connection_refused_is_one_line(tmp_path):
    from pytest_gpuhost.exec.ssh.openssh import OpenSSHTransport
    from tests.helpers.sshd import free_port

    port = free_port()
    t = OpenSSHTransport("127.0.0.1", port, "root", known_hosts=str(tmp_path / "kh"), connect_timeout=2.0)
    assert t.direct_refusal is None
    try:
        with pytest.raises(ConnectError, match=rf"^cannot reach root@127.0.0.1:{port}: Connection refused$"):
            t.open(["true"])
    finally:
        t.close()
    assert t.control_path is None


@pytest.mark.parametrize(
    ("config", "version", "why"),
    [
        ({}, (9, 2), None),
        ({}, (7, 9), "OpenSSH older than 8.0"),
        ({}, None, "OpenSSH older than 8.0"),
        ({"proxyjump": "bastion"}, (9, 2), "proxyjump is set"),
        ({"proxyjump": "none"}, (9, 2), None),
        ({"proxycommand": "nc %h %p"}, (9, 2), "proxycommand is set"),
        ({"checkhostip": "yes"}, (9, 2), "CheckHostIP"),
        ({"canonicalizehostname": "always"}, (9, 2), "CanonicalizeHostname"),
        ({"bindinterface": "eth0"}, (9, 2), "bindinterface is set"),
    ],
)
def test_when_ssh_connects_itself(config, version, why):
    from pytest_gpuhost.exec.ssh.direct import direct_refusal

    got = direct_refusal({"hostname": "h", "port": "22", **config}, version)
    assert (got is None) if why is None else (why in (got or ""))


def test_openssh_version_parsing():
    from pytest_gpuhost.exec.ssh.direct import openssh_version

    assert openssh_version("OpenSSH_9.2p1 Debian-2+deb12u10, OpenSSL 3.0.19 27 Jan 2026") == (9, 2)
    assert openssh_version("OpenSSH_for_Windows_8.1p1, LibreSSL 3.0.2") is None
    assert openssh_version("Dropbear v2022.83") is None

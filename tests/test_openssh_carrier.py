"""The OpenSSH transport's first channel carries the login (one `ssh` process logs in and runs it).

Against real sshd processes on loopback: the agent's channel and later channels share the one
login; threads opening channels while a login runs wait for it instead of starting a second; a
login that fails or hangs is a ConnectError of one line from the channel (from `recv` and from
`send`), as `connect()` gives.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from pytest_gpuhost.errors import ConnectError

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client (ssh) installed")


def _transport(sshd, **kw):
    from pytest_gpuhost.exec.openssh_mux import OpenSSHTransport

    base = {"identity": sshd.identity, "known_hosts": sshd.known_hosts, "connect_timeout": 5.0}
    return OpenSSHTransport(sshd.host, sshd.port, sshd.user, **{**base, **kw})


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


def test_first_channel_logs_in_and_later_ones_share_it(logged):
    t = _transport(logged)
    try:
        with t.open(["sh", "-c", 'echo "$SSH_CONNECTION"']) as first:
            first_conn = first.read_exact(200, 10).decode().split()[1]
            assert first.exit_status(5) == 0
        assert t.alive()  # ControlPersist: the master outlives its first client
        with t.open(["sh", "-c", 'echo "$SSH_CONNECTION"']) as later:
            assert later.read_exact(200, 10).decode().split()[1] == first_conn
        assert _logins(logged) == 1
    finally:
        t.close()
    assert not t.alive()


def test_threads_opening_during_the_login_share_it(logged):
    t = _transport(logged)
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


def test_a_failed_login_is_a_connect_error_from_the_channel(sshd, tmp_path):
    from tests.helpers.sshd import keygen

    keygen(tmp_path / "stranger")
    t = _transport(sshd, identity=str(tmp_path / "stranger"))
    try:
        ch = t.open(["cat"])
        t0 = time.monotonic()
        with pytest.raises(ConnectError) as info:
            ch.send(b"x" * (1 << 20))  # more than a pipe holds: ssh never reads it
            ch.recv(30)
        assert time.monotonic() - t0 < 10
        msg = str(info.value)
        assert "\n" not in msg and f"{sshd.host}:{sshd.port}" in msg
        assert "exit status 255" in msg and "Permission denied" in msg
        assert not t.alive()
    finally:
        t.close()


def test_a_login_that_hangs_after_the_banner_is_cut_at_its_deadline(tmp_path):
    """A server that sends its banner and then nothing: ssh would wait on; we stop at the deadline."""
    from pytest_gpuhost.exec.openssh_mux import OpenSSHTransport

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
        t = OpenSSHTransport("127.0.0.1", port, "root", known_hosts=str(tmp_path / "kh"), connect_timeout=1.0)
        try:
            ch = t.open(["true"])
            t0 = time.monotonic()
            with pytest.raises(ConnectError, match=r"within 1s: no SSH login completed"):
                ch.recv(60)
            assert time.monotonic() - t0 < 6
            assert ch.exit_status(2) is not None  # the client was killed
        finally:
            t.close()
            for c in held:
                c.close()
    assert t.control_path is None  # its directory was removed

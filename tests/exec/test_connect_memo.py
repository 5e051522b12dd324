"""A failed connect is remembered for the run: the target's later tests fail at once, same reason.

The target is a TCP listener on loopback that accepts and never speaks SSH (a hung sshd): each
connect attempt waits `--connect-timeout`. The listener counts the connections it accepted, so the
test counts connect attempts instead of timing them.
"""

from __future__ import annotations

import socket
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest

TESTS = """
def test_one(target):
    target.conn.run(["true"])

def test_two(target):
    target.conn.run(["true"])

def test_three(host):
    host.run("true")
"""


@pytest.fixture
def hung_sshd() -> Iterator[tuple[int, list[socket.socket]]]:
    srv = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)  # held open, never answered

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    t.join(5)
    for c in accepted:
        c.close()
    srv.close()


def test_failed_connect_is_not_retried_by_later_tests(
    pytester: pytest.Pytester, hung_sshd: tuple[int, list[socket.socket]]
) -> None:
    port, accepted = hung_sshd
    pytester.makepyfile(test_hosts=TESTS)
    r = pytester.runpytest_subprocess(
        f"--host=ssh://root@127.0.0.1:{port}", "--connect-timeout=2", "--report-dir=none",
        "-p", "no:cacheprovider", "-rf",
    )  # fmt: skip
    # the first test says the host's error; the two after it count as unreachable (run/unreachable.py)
    r.assert_outcomes(failed=1)
    assert r.parseoutcomes().get("unreachable") == 2, r.outlines[-5:]
    out = "\n".join(r.outlines)
    assert len(accepted) == 1, (len(accepted), out[-3000:])
    reasons = [ln for ln in r.outlines if ln.startswith("ConnectError: ")]
    (first,) = reasons  # the one attempt (test_one's)
    assert "timed out" in first and "not retried" not in first, first
    # the later tests did not try again: their reports (the JUnit file) say so
    junit = pytester.path / "junit.xml"
    r = pytester.runpytest_subprocess(
        f"--host=ssh://root@127.0.0.1:{port}", "--connect-timeout=2", "--report-dir=none",
        "-p", "no:cacheprovider", f"--junitxml={junit}",
    )  # fmt: skip
    assert len(accepted) == 2, len(accepted)  # one more run, one more attempt
    messages = [e.get("message", "") for e in ET.parse(junit).iter() if e.tag in ("failure", "error")]
    assert len(messages) == 3 and sum("not retried" in m for m in messages) == 2, messages

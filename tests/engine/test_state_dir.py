"""The plugin's state on a target lives under the agent's state directory, so tests stay hermetic."""

from __future__ import annotations

import pytest

from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.journal import BASE, Journal


@pytest.fixture
def local(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUHOST_STATE_DIR", str(tmp_path / "state"))
    conn = open_connection(parse_host_url("local://"))
    yield conn
    conn.close()


def test_journal_and_lock_live_under_the_agents_state_dir(local, tmp_path) -> None:
    j = Journal(local, "p2p")
    assert j.path == f"{tmp_path}/state/journal/p2p.json"
    assert j.lock_path == f"{tmp_path}/state/lock/p2p"
    j.acquire(wait=1)
    j.step("unbind 0000:17:00.0 nvidia")
    assert Journal(local, "p2p").read()["steps"][0]["step"] == "unbind 0000:17:00.0 nvidia"
    j.release()
    assert (tmp_path / "state/journal/p2p.json").is_file()


def test_an_explicit_base_wins_and_the_default_is_var_lib_gpuhost(local, tmp_path) -> None:
    assert Journal(local, "x", base=str(tmp_path / "b")).path == f"{tmp_path}/b/journal/x.json"

    class NoHello:
        name = "t"

    assert Journal(NoHello(), "x").path == f"{BASE}/journal/x.json"

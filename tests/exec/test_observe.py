"""Command observers: process-wide ones in exec/observe.py and a connection's own `on_command`."""

from __future__ import annotations

import pytest

from pytest_gpuhost.errors import AgentError
from pytest_gpuhost.exec import observe
from pytest_gpuhost.exec.results import CommandResult
from pytest_gpuhost.exec.targets import open_connection, parse_host_url


def test_process_wide_observer_hears_redacted_commands_and_writes(tmp_path):
    seen: list[tuple[str, CommandResult]] = []

    def listen(target: str, result: CommandResult) -> None:
        seen.append((target, result))

    observe.add_command_observer(listen)
    observe.add_command_observer(listen)  # once only
    try:
        with open_connection(parse_host_url("local://")) as c:
            c.run(["echo", "password=hunter22"])
            c.run(["true"], env={"API_TOKEN": "s3cr3t-value"})
            c.write_file(str(tmp_path / "v"), "1\n", timeout=5)
    finally:
        observe.remove_command_observer(listen)
    mine = [r for t, r in seen if t == "local"]
    assert len(mine) == 3
    assert "hunter22" not in mine[0].command and "hunter22" not in mine[0].stdout
    assert "s3cr3t-value" not in mine[1].command and mine[1].command.endswith(" true")
    assert mine[2].command == f"echo 1 > {tmp_path / 'v'}" and mine[2].rc == 0
    assert listen not in observe.command_observers()
    with open_connection(parse_host_url("local://")) as c:
        c.run(["true"])
    assert len([r for t, r in seen if t == "local"]) == 3  # removed: hears nothing more


def test_outputs_are_clipped_for_observers():
    big = CommandResult("t", "cmd", 0, "a" * (observe.OBSERVED_OUTPUT + 10), "", 0.0, 0.0)
    red = observe.redacted(big)
    assert red.stdout.startswith("a" * 100) and red.stdout.endswith("[10 more characters not recorded]")


def test_container_shares_the_hosts_observers(tmp_path):
    import sys

    bindir = tmp_path / "bin"
    bindir.mkdir()
    pct = bindir / "pct"
    pct.write_text('#!/bin/sh\nshift 3\nexec "$@"\n')
    pct.chmod(0o755)
    (bindir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python3").chmod(0o755)
    seen: list[str] = []
    with open_connection(parse_host_url(f"local://?path={bindir}:/usr/bin:/bin")) as host:
        host.on_command.append(lambda target, res: seen.append(f"{target}: {res.command}"))
        inner = host.container("pct:101")
        inner.run(["echo", "in"])
    assert seen == ["local/101: echo in"]
    with pytest.raises(AgentError, match="closed"):  # closed with its host
        inner.run(["true"])

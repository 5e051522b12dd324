"""The one place that picks a connection's kind: start the agent, else fall back.

`connect` starts the agent through the launcher; when the target has no interpreter (the
program is not found here, or the target's shell answers 126/127) it returns a
`FallbackConnection` on the same launcher instead, unless the fallback is disabled.
"""

from __future__ import annotations

from pytest_gpuhost.errors import AgentError
from pytest_gpuhost.exec.agent_session import AgentConnection, NoPython
from pytest_gpuhost.exec.connection import Connection, ConnectionOptions
from pytest_gpuhost.exec.fallback import FallbackConnection
from pytest_gpuhost.exec.launch import Launcher

__all__ = ["connect"]


def connect(name: str, launcher: Launcher, opts: ConnectionOptions | None = None) -> Connection:
    """Return a connection to the target behind `launcher`, its agent started (or the fallback).

    Whatever fails, the launcher is closed before the error is raised.
    """
    opts = opts or ConnectionOptions()
    agent = AgentConnection(name, launcher, opts)
    try:
        return agent.connect()
    except NoPython as exc:
        if opts.allow_fallback:
            return FallbackConnection(name, launcher, opts)
        launcher.close()
        raise AgentError(f"no {opts.python} on {name} and the fallback is disabled") from exc
    except BaseException:
        agent.close()
        raise

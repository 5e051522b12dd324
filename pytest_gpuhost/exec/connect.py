"""The one place that picks a connection's kind: start the agent, else fall back.

`connect` starts the agent through the launcher; when the target has no usable interpreter
(pythons.py: none of the candidates is CPython >= 3.6 with the modules the agent needs) it
returns a `FallbackConnection` on the same launcher instead, unless the fallback is disabled.
The fallback keeps the one line that says why (`no_python`): the target still answers
commands and file reads (what `host.run` and `host.file` need), and every operation that needs
the agent is refused with that line.  A suite's first step that needs the agent fails with it,
and the run's evidence shows the connection's mode.
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
            fallback = FallbackConnection(name, launcher, opts)
            fallback.no_python = str(exc)
            return fallback
        launcher.close()
        raise AgentError(f"{exc}; the fallback is disabled") from None
    except BaseException:
        agent.close()
        raise

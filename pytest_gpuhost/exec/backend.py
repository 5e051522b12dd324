"""The testinfra backend behind our `host` objects: every command goes through a Connection.

So `host.run`, `host.file(...)`, `host.service(...)`, `host.process` keep testinfra's API but get
the agent's speed, a timeout enforced on the target, and evidence for every command.
`host.run(cmd, *args, timeout=S)` takes a timeout (seconds); without one the connection's
command timeout applies.  A timed-out command returns rc -9 and `result.timed_out` is True.
"""

from __future__ import annotations

from typing import Any

import testinfra.backend.base
import testinfra.host

from pytest_gpuhost.exec.connection import Connection

__all__ = ["GpuhostBackend", "make_host"]


class GpuhostBackend(testinfra.backend.base.BaseBackend):
    """A testinfra backend that runs commands through a `Connection`."""

    NAME = "gpuhost"

    def __init__(
        self,
        connection: Connection,
        *,
        sudo: bool = False,
        sudo_user: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.conn = connection
        super().__init__(connection.name, sudo=sudo, sudo_user=sudo_user, **kwargs)
        # testinfra would probe the target's locale with two extra commands; the agent speaks UTF-8.
        self._encoding = "utf-8"

    @classmethod
    def get_connection_type(cls) -> str:
        return cls.NAME

    def get_pytest_id(self) -> str:
        return self.conn.name

    def run(self, command: str, *args: str, **kwargs: Any) -> testinfra.backend.base.CommandResult:
        """Run `command % quoted(args)` on the target; `timeout=` and `stdin=` are honoured."""
        cmd = self.get_command(command, *args)
        res = self.conn.run(
            cmd, timeout=kwargs.get("timeout"), stdin=kwargs.get("stdin"), env=kwargs.get("env")
        )
        out = self.result(res.rc, self.encode(cmd), res.stdout_bytes, res.stderr_bytes)
        out.timed_out = res.timed_out  # type: ignore[attr-defined]
        out.duration = res.duration  # type: ignore[attr-defined]
        return out


def make_host(
    connection: Connection, *, sudo: bool = False, sudo_user: str | None = None
) -> testinfra.host.Host:
    """Return a testinfra `Host` whose backend is ours; `host.gpuhost_conn` is the Connection."""
    backend = GpuhostBackend(connection, sudo=sudo, sudo_user=sudo_user)
    host = testinfra.host.Host(backend)
    backend.set_host(host)
    host.gpuhost_conn = connection  # type: ignore[attr-defined]
    return host

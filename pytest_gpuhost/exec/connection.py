"""One connection per target: the protocol every caller uses, and what its two kinds share.

`Connection` is what callers hold (type hints, `isinstance`): `run`, `call`, `batch`, `facts`,
`read_files`, `write_file`, `stream`, `open_channel`, `container`, `close`, plus `name`, `mode`,
`round_trips`, `hello` and the `on_command` observers.  It has two implementations:

- `AgentConnection` (agent_session.py, mode "agent"): one agent started through the target's
  `Launcher` (the first usable Python found by `sh -c PROBE_SH`: pythons.py; program sent on
  stdin); requests are one JSON line each
  way over that single channel, so a command costs a round trip, not a new SSH channel;
- `FallbackConnection` (fallback.py, mode "fallback"), for targets without a usable Python: one channel
  per command wrapped in `timeout -s KILL N`, files read by `cat`, file ops by POSIX tools.

`connect.connect()` is the one place that picks: it starts the agent, and where the interpreter
is missing (exit status 126/127, or not found locally) returns the fallback instead.

Reachability is told by type: when the connection to the target is gone or cannot be made
(the agent died, its channel closed, no reply within the reply timeout, SSH refused) the error
is an `errors.Unreachable` (`AgentLost` or `ConnectError`); any other `GpuhostError` means an
operation failed on a target that still answers.  Every command and watched write is told to
the observers (observe.py, and the connection's own `on_command`) already redacted.
"""

from __future__ import annotations

import abc
import shlex
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_gpuhost.errors import AgentError, CommandTimeout, GpuhostError
from pytest_gpuhost.exec.channels import RawChannel
from pytest_gpuhost.exec.launch import Launcher
from pytest_gpuhost.exec.observe import CommandObserver, notify
from pytest_gpuhost.exec.results import CommandResult, WriteResult, describe_write

__all__ = [
    "REPLY_MARGIN",
    "CommandResult",
    "Connection",
    "ConnectionOptions",
    "ContainerOpener",
    "RawChannel",
    "WriteResult",
]

#: Extra seconds a reply may take beyond the operation's own timeout (kill grace, transfer).
REPLY_MARGIN = 15.0

#: Opens a connection into a container through (or beside) a host connection; targets.py has it.
ContainerOpener = Callable[["Connection", Any], "Connection"]


@dataclass
class ConnectionOptions:
    """What a connection was opened with; containers opened through it inherit it."""

    command_timeout: float = 60.0
    #: The interpreter the operator named (`?python=`); "" finds one (exec/pythons.py).
    python: str = ""
    allow_fallback: bool = True
    connect_timeout: float = 10.0


TIMINGS_KEPT = 64  # a health run makes 2-4 requests per host; a backup's thousands are not kept


class Connection(abc.ABC):
    """One per target; see the module docstring for the two kinds and docs/INTERNALS.md section 1."""

    #: "agent" or "fallback": which implementation answers.
    mode: str = ""

    def __init__(
        self, name: str, launcher: Launcher, opts: ConnectionOptions, hello: Mapping[str, Any] | None = None
    ) -> None:
        self.name = name
        self.launcher = launcher
        self.opts = opts
        self.round_trips = 0
        self.hello: dict[str, Any] = dict(hello or {})
        #: Called as `observer(target, result)` for this connection's commands (redacted).
        self.on_command: list[CommandObserver] = []
        #: An object whose `hook.pytest_gpuhost_command(target=, result=)` is called for every
        #: command (the plugin sets its pytest config here); duck-typed, never imported.
        self.config: Any = None
        #: Set by targets.py: how `container()` opens a connection into a container.
        self.container_opener: ContainerOpener | None = None
        self.children: list[Connection] = []
        #: Why the agent could not start (one line; set on a fallback connection), else "".
        self.no_python = ""
        #: (what, wall-clock start, end) of the agent's start ("start") and of each request (its op),
        #: the first `TIMINGS_KEPT` only: a hidden record for benchmarks (bench_health.py's phases).
        self.timings: list[tuple[str, float, float]] = []
        self._closed = False

    def _timed(self, what: str, started: float) -> None:
        """Record that `what` ran from `started` (time.time()) to now, while the record has room."""
        if len(self.timings) < TIMINGS_KEPT:
            self.timings.append((what, started, time.time()))

    @property
    def python(self) -> str:
        """The interpreter the agent runs under on the target (a path), "" without an agent.

        Code that runs a Python program of its own on the target (a health probe of a service,
        the backup's bulk sender) runs it with this one: the node's `python3` may be missing,
        too old, or without the modules the program needs.
        """
        return str(self.hello.get("executable") or "")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} via {self.launcher.description} mode={self.mode}>"

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise AgentError(f"connection to {self.name} is closed")

    # ------------------------------------------------------------ what each kind implements

    @abc.abstractmethod
    def connect(self) -> Connection:
        """Make sure the target answers now (otherwise the first request does); return self."""

    @abc.abstractmethod
    def _call(self, op: str, params: dict[str, Any], reply_timeout: float) -> dict[str, Any]:
        """Run one op and return the agent-style reply `{"ok": ..., "result"|"error"...}`."""

    @abc.abstractmethod
    def _run(
        self, params: dict[str, Any], shown: str, timeout: float, on_output: Callable[[str, str], None] | None
    ) -> CommandResult:
        """Run the command described by the agent's `run` params; `shown` is how it reads."""

    @abc.abstractmethod
    def _write(self, path: str, data: str | bytes, timeout: float, mode: str) -> WriteResult:
        """Write `data` to `path` under a watchdog of `timeout` seconds."""

    @abc.abstractmethod
    def read_files(self, paths: Sequence[str], *, max_bytes: int | None = None) -> dict[str, str | OSError]:
        """Read many files; each value is its text or the OSError it gave."""

    @abc.abstractmethod
    def stream(self, op: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Yield the chunks of a streaming op as they arrive, then `{"done": True, "result": ...}`."""

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """Stop what this kind runs on the target (the agent); the launcher is closed after."""

    # ------------------------------------------------------------ shared API

    def call(self, op: str, *, reply_timeout: float | None = None, **params: Any) -> Any:
        """Run a raw agent op and return its result; raise AgentError (with errno) on failure.

        `reply_timeout` bounds the wait for the reply (default: the op's own `timeout`, or the
        command timeout, plus a margin); quick bookkeeping ops pass a short one so that a cut link
        is noticed in seconds.  A reply that does not come in time raises `AgentLost`.
        """
        self._check_open()
        reply = self._call(op, params, float(reply_timeout or self._op_timeout(params)))
        if not reply.get("ok"):
            err = AgentError(f"{op} on {self.name}: {reply.get('error')}")
            err.errno = reply.get("errno")  # type: ignore[attr-defined]
            raise err
        return reply.get("result")

    def _op_timeout(self, params: Mapping[str, Any]) -> float:
        t = params.get("timeout")
        return (float(t) if t is not None else self.opts.command_timeout) + REPLY_MARGIN

    def batch(self, requests: list[dict[str, Any]]) -> list[Any]:
        """Run several ops in one round trip; each item is a result or an AgentError instance."""
        budget = sum(self._op_timeout(r) - REPLY_MARGIN for r in requests) + REPLY_MARGIN
        replies = self.call("batch", requests=requests, reply_timeout=budget)
        out: list[Any] = []
        for req, rep in zip(requests, replies, strict=False):
            if rep.get("ok"):
                out.append(rep.get("result"))
            else:
                err = AgentError(f"{req.get('op')} on {self.name}: {rep.get('error')}")
                err.errno = rep.get("errno")  # type: ignore[attr-defined]
                out.append(err)
        return out

    def facts(self, *names: str, **params: Any) -> dict[str, Any]:
        """Gather registered facts in one round trip (all of them when no name is given)."""
        return dict(self.call("facts", names=list(names), params=params))

    def run(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = False,
        cwd: str | None = None,
        on_output: Callable[[str, str], None] | None = None,
    ) -> CommandResult:
        """Run a command on the target: a list is an argv (never parsed by a shell), a str is shell.

        The timeout (default: the connection's command timeout) is enforced on the target: the
        whole process group gets SIGTERM then SIGKILL, and the result says `timed_out` and
        keeps what was printed.  `check=True` raises CommandTimeout / GpuhostError instead.
        """
        t = float(timeout if timeout is not None else self.opts.command_timeout)
        if isinstance(command, str):
            params: dict[str, Any] = {"shell": command}
            shown = command
        else:
            argv = [str(a) for a in command]
            params = {"argv": argv}
            shown = shlex.join(argv)
        params["timeout"] = t
        if stdin is not None:
            if isinstance(stdin, bytes):
                import base64

                params["stdin_b64"] = base64.b64encode(stdin).decode("ascii")
            else:
                params["stdin"] = stdin
        if env:
            params["env"] = dict(env)
        if cwd:
            params["cwd"] = cwd
        self._check_open()
        result = self._run(params, shown, t, on_output)
        self._record(result, env)
        if check:
            if result.timed_out:
                raise CommandTimeout(result.summary())
            if result.rc != 0:
                raise GpuhostError(result.summary())
        return result

    def write_file(
        self, path: str, data: str | bytes, *, timeout: float | None = None, mode: str = "w"
    ) -> WriteResult:
        """Write under a watchdog on the target: a write blocked in the kernel comes back `timed_out`."""
        t = float(timeout if timeout is not None else self.opts.command_timeout)
        start = time.time()
        self._check_open()
        wr = self._write(path, data, t, mode)
        rc = 0 if wr.ok else (-9 if wr.timed_out else (wr.errno or 1))
        err = "" if wr.ok else (wr.error or "")
        shown = describe_write(path, data, mode)
        self._record(CommandResult(self.name, shown, rc, "", err, start, wr.duration, wr.timed_out), None)
        return wr

    def open_channel(self, argv: Sequence[str]) -> RawChannel:
        """Start `argv` on the target on a channel of its own, for bulk bytes (tar, hashing).

        Over SSH this is an OpenSSH client process where one can log in (see openssh.py)."""
        self._check_open()
        return self.launcher.open_bulk([str(a) for a in argv])

    def container(self, spec: Any) -> Connection:
        """Open a connection to a container through this one (or by its own SSH for ssh://).

        `spec` is a `targets.ContainerSpec` or its text (`pct:101`); it is closed with this one.
        """
        self._check_open()
        if self.container_opener is None:
            raise AgentError(
                f"{self.name} was not opened by targets.open_connection: it cannot open containers"
            )
        conn = self.container_opener(self, spec)
        conn.on_command = self.on_command  # the same observers see the container's commands
        conn.config = self.config
        self.children.append(conn)
        return conn

    def close(self) -> None:
        """Stop the agent, close containers opened through this connection, then the transport."""
        if self._closed:
            return
        self._closed = True
        for child in self.children:
            child.close()
        self._shutdown()
        self.launcher.close()

    # ------------------------------------------------------------ observers

    def _record(self, result: CommandResult, env: Mapping[str, str] | None) -> None:
        extra = list(self.on_command)
        hook = getattr(getattr(self.config, "hook", None), "pytest_gpuhost_command", None)
        if hook is not None:
            extra.append(lambda target, res: hook(target=target, result=res))
        notify(self.name, result, env, extra)

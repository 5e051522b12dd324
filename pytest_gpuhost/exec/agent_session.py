"""The agent connection: one agent per target, one JSON line per request and per reply.

The agent is started through the target's launcher (`sh -c PROBE_SH ...`, which `exec`s the
first usable interpreter with `-S -u -c PRELUDE+BOOTSTRAP`: pythons.py; the program is sent on
stdin) and answers `hello` first.  If it dies, the request in flight raises `AgentLost`;
the next request starts a new agent (reconnecting SSH if needed) once, and raises `AgentLost`
if that fails too.  A reply that does not come within the reply timeout stops the agent and
raises `AgentLost` as well: in every case the connection, not the operation, is what failed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

from pytest_gpuhost.errors import AgentError, AgentLost, ConnectError
from pytest_gpuhost.exec.agent import BOOTSTRAP, PYTHON_FLAGS, agent_payload
from pytest_gpuhost.exec.channels import RawChannel
from pytest_gpuhost.exec.connection import REPLY_MARGIN, Connection, ConnectionOptions
from pytest_gpuhost.exec.launch import Launcher
from pytest_gpuhost.exec.pythons import PRELUDE, needs_text, no_python_line, start_argv
from pytest_gpuhost.exec.results import CommandResult, WriteResult

__all__ = ["AgentConnection", "AgentSession", "NoPython"]

#: Exit codes of an agent start that ran no agent: the probe found no usable Python (127), or
#: the shell could not run what it was given.
_NO_PYTHON = (126, 127)


class NoPython(AgentError):
    """The target has no usable interpreter to start the agent with (the fallback may apply).

    The message is the one line for the operator: what was found, and what the agent needs.
    """


def last_line(text: str) -> str:
    """Return the last non-blank line of `text`, at most 300 characters."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


class AgentSession:
    """The agent on one channel: send a JSON line, read JSON lines until the reply."""

    def __init__(self, chan: RawChannel, name: str) -> None:
        self.chan = chan
        self.name = name
        self.buf = b""
        self.dead = False
        self.hello: dict[str, Any] = {}

    def _line(self, timeout: float) -> bytes:
        # Only new data is searched and joined once: a reply of many megabytes stays linear.
        nl = self.buf.find(b"\n")
        if nl >= 0:
            line, self.buf = self.buf[:nl], self.buf[nl + 1 :]
            return line
        parts = [self.buf]
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.buf = b"".join(parts)
                raise TimeoutError
            data = self.chan.recv(left)
            if not data:
                self.buf = b"".join(parts)
                raise EOFError
            nl = data.find(b"\n")
            if nl >= 0:
                parts.append(data[:nl])
                self.buf = data[nl + 1 :]
                return b"".join(parts)
            parts.append(data)

    def send(self, req: dict[str, Any]) -> None:
        try:
            self.chan.send(json.dumps(req, separators=(",", ":")).encode("utf-8") + b"\n")
        except OSError as exc:
            self._died(req, exc)

    def next_message(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Return the next chunk or the reply for `req`; each waits at most `timeout` seconds."""
        try:
            while True:
                msg = json.loads(self._line(timeout))
                if msg.get("id") != req["id"]:
                    continue  # a late line of a request we gave up on
                return dict(msg)
        except TimeoutError as exc:
            self.kill()
            raise AgentLost(
                f"agent on {self.name} gave no reply to {req.get('op')} within {timeout:g}s; stopped it"
            ) from exc
        except (EOFError, OSError, ValueError) as exc:
            self._died(req, exc)

    def _died(self, req: dict[str, Any], exc: BaseException) -> NoReturn:
        self.dead = True
        rc = self.chan.exit_status(2.0)
        tail = last_line(self.chan.stderr_text())
        what = f"exit status {rc}" if rc is not None else type(exc).__name__
        raise AgentLost(
            f"agent on {self.name} died during {req.get('op')} ({what})" + (f": {tail}" if tail else "")
        ) from exc

    def request(self, req: dict[str, Any], timeout: float, on_chunk: Callable[[Any], None] | None) -> Any:
        """Send one request and return the reply dict; raise AgentLost when the agent is gone."""
        self.send(req)
        while True:
            msg = self.next_message(req, timeout)
            if "chunk" in msg:
                if on_chunk is not None:
                    on_chunk(msg["chunk"])
                continue
            return msg

    def kill(self) -> None:
        self.dead = True
        try:
            self.chan.close()
        except Exception:  # noqa: BLE001 - closing a broken channel must not mask the error
            pass


class AgentConnection(Connection):
    """A connection whose requests the agent answers; see the module docstring."""

    mode = "agent"

    def __init__(self, name: str, launcher: Launcher, opts: ConnectionOptions) -> None:
        super().__init__(name, launcher, opts)
        self._session: AgentSession | None = None
        self._ids = itertools.count(1)
        self._had_agent = False
        # One request on the wire at a time: threads sharing a connection take turns.  A plain
        # Lock (not RLock) because a stream's generator may be finished from another thread.
        self._wire = threading.Lock()
        self._stream_owner: int | None = None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._acquire()
        try:
            yield
        finally:
            self._wire.release()

    def _acquire(self) -> None:
        if self._stream_owner == threading.get_ident():
            raise AgentError(f"connection to {self.name} is busy with a stream: finish or close it first")
        bound = self.opts.command_timeout + REPLY_MARGIN
        if not self._wire.acquire(timeout=bound):
            raise AgentError(
                f"connection to {self.name} stayed busy for {bound:g}s (another thread's request)"
            )

    # ------------------------------------------------------------ agent lifecycle

    def connect(self) -> AgentConnection:
        """Start the agent now (otherwise the first request does); return self.

        Raise `NoPython` when the target has no interpreter and never had an agent.
        """
        with self._locked():
            self._ensure()
        return self

    def _start_agent(self) -> AgentSession:
        python = self.opts.python
        try:
            chan = self.launcher.open(start_argv(python))
        except FileNotFoundError as exc:
            if exc.filename not in (None, "sh"):
                raise ConnectError(
                    f"cannot start the agent on {self.name}: {exc.filename}: command not found"
                ) from exc
            chan = self._open_without_sh(python or "python3")
        session = AgentSession(chan, self.name)
        chan.send(agent_payload())
        try:
            reply = session.request({"id": 0, "op": "hello"}, self.opts.connect_timeout + 20.0, None)
        except AgentLost as exc:
            rc = chan.exit_status(1.0)
            line = no_python_line(self.name, chan.stderr_text(), python)
            session.kill()
            if line is None and rc in _NO_PYTHON:
                tail = last_line(chan.stderr_text())
                line = f"{self.name}: no usable Python: the agent's start exited {rc}" + (
                    f": {tail}" if tail else ""
                )
            if line is not None:
                if not self._had_agent:
                    raise NoPython(line) from None
                raise AgentLost(f"cannot start the agent again: {line}") from None
            raise AgentLost(f"cannot start the agent on {self.name}: {exc}") from exc
        self.round_trips += 1
        if not reply.get("ok"):
            session.kill()
            raise AgentError(f"agent on {self.name} failed to start: {reply.get('error')}")
        session.hello = self.hello = reply["result"]
        return session

    def _open_without_sh(self, python: str) -> RawChannel:
        """Start the interpreter directly where the target has no `sh` (a local PATH without it)."""
        try:
            return self.launcher.open([python, *PYTHON_FLAGS, "-c", PRELUDE + BOOTSTRAP])
        except FileNotFoundError as exc:
            if not self._had_agent:
                raise NoPython(
                    f"{self.name}: no usable Python: no sh and no {python}; the agent needs {needs_text()}"
                ) from None
            raise AgentLost(f"cannot start the agent on {self.name}: {python} is gone") from exc

    def _ensure(self) -> AgentSession:
        self._check_open()
        if self._session is not None and not self._session.dead:
            return self._session
        if self._session is not None:  # it died: one fresh start, then give up
            self._session.kill()
            self._session = None
        started = time.time()
        try:
            session = self._start_agent()
        except ConnectError as exc:
            if self._had_agent:
                raise AgentLost(f"agent on {self.name} died and reconnecting failed: {exc}") from exc
            raise
        self._session = session
        self._had_agent = True
        self._timed("start", started)
        return session

    def _request(
        self, op: str, params: dict[str, Any], timeout: float, on_chunk: Callable[[Any], None] | None = None
    ) -> dict[str, Any]:
        with self._locked():
            session = self._ensure()
            req = {"id": next(self._ids), "op": op}
            req.update(params)
            self.round_trips += 1
            started = time.time()
            reply = dict(session.request(req, timeout, on_chunk))
            self._timed(op, started)
            return reply

    # ------------------------------------------------------------ the protocol

    def _call(self, op: str, params: dict[str, Any], reply_timeout: float) -> dict[str, Any]:
        return self._request(op, params, reply_timeout)

    def _run(
        self, params: dict[str, Any], shown: str, timeout: float, on_output: Callable[[str, str], None] | None
    ) -> CommandResult:
        on_chunk = None
        if on_output is not None:
            params["stream"] = True

            def on_chunk(chunk: Any) -> None:
                on_output(chunk.get("stream", "stdout"), chunk.get("data", ""))

        reply = self._request("run", params, timeout + REPLY_MARGIN, on_chunk)
        if not reply.get("ok"):
            raise AgentError(f"run on {self.name}: {reply.get('error')}")
        return self._result(shown, reply["result"])

    def _result(self, shown: str, r: Mapping[str, Any]) -> CommandResult:
        import base64

        res = CommandResult(
            target=self.name,
            command=shown,
            rc=int(r["rc"]),
            stdout=r.get("stdout", ""),
            stderr=r.get("stderr", ""),
            start=float(r.get("start", time.time())),
            duration=float(r.get("duration", 0.0)),
            timed_out=bool(r.get("timed_out")),
        )
        if "stdout_b64" in r:
            res._stdout_bytes = base64.b64decode(r["stdout_b64"])
        if "stderr_b64" in r:
            res._stderr_bytes = base64.b64decode(r["stderr_b64"])
        return res

    def read_files(self, paths: Sequence[str], *, max_bytes: int | None = None) -> dict[str, str | OSError]:
        """Read many files in one round trip; each value is its text or the OSError it gave."""
        paths = list(paths)
        params: dict[str, Any] = {"paths": paths}
        if max_bytes:
            params["max_bytes"] = int(max_bytes)
        raw = self.call("read_files", **params)
        out: dict[str, str | OSError] = {}
        for path in paths:
            entry = raw.get(path, {"errno": None, "error": "missing from reply"})
            if "data" in entry:
                out[path] = entry["data"]
            else:
                out[path] = OSError(entry.get("errno") or 0, entry.get("error") or "error", path)
        return out

    def _write(self, path: str, data: str | bytes, timeout: float, mode: str) -> WriteResult:
        import base64

        params: dict[str, Any] = {"path": path, "timeout": timeout, "mode": mode}
        if isinstance(data, bytes):
            params["b64"] = base64.b64encode(data).decode("ascii")
        else:
            params["data"] = data
        r = self.call("write_file", **params)
        return WriteResult(
            path,
            bool(r["ok"]),
            r.get("errno"),
            r.get("error"),
            bool(r.get("timed_out")),
            float(r.get("duration", 0.0)),
        )

    def stream(self, op: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Yield the chunks of a streaming op as they arrive, then `{"done": True, "result": ...}`.

        The connection is held for the stream: other threads wait, and a request from the
        consuming thread itself raises AgentError.  Leaving the loop early reads and drops the
        rest of the stream (bounded by the op's timeout) so the connection stays usable.
        """
        timeout = self._op_timeout(params)
        self._acquire()
        done = False
        session: AgentSession | None = None
        req: dict[str, Any] = {"id": next(self._ids), "op": op}
        req.update(params)
        try:
            session = self._ensure()
            self.round_trips += 1
            self._stream_owner = threading.get_ident()
            session.send(req)
            while True:
                msg = session.next_message(req, timeout)
                if "chunk" in msg:
                    yield msg["chunk"]
                    continue
                done = True
                if not msg.get("ok"):
                    raise AgentError(f"{op} on {self.name}: {msg.get('error')}")
                yield {"done": True, "result": msg.get("result")}
                return
        finally:
            if not done and session is not None and not session.dead:
                try:
                    while "chunk" in session.next_message(req, timeout):
                        pass
                except AgentLost:
                    pass  # next_message stopped the agent; the next request starts a new one
            self._stream_owner = None
            self._wire.release()

    def _shutdown(self) -> None:
        if self._session is not None:
            self._session.chan.close_stdin()  # the agent exits at EOF
            self._session.chan.exit_status(1.0)
            self._session.kill()
            self._session = None

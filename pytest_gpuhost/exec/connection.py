"""One connection per target: the agent session, the fallback without Python, evidence.

A `Connection` owns a `Launcher` (transport.py) and, once used, one agent started through it
(`python3 -u -c BOOTSTRAP`, program sent on stdin).  Requests are one JSON line each way over
that single channel, so a command costs a round trip, not a new SSH channel.  When the target
has no python3 the connection falls back to one channel per command wrapped in
`timeout -s KILL N`, with files read by `cat`.

If the agent dies, the request in flight fails with `AgentError`; the next request starts a new
agent (reconnecting SSH if needed) once, and raises `AgentError` if that fails too.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from pytest_gpuhost.errors import AgentError, CommandTimeout, ConnectError, GpuhostError
from pytest_gpuhost.exec.agent import BOOTSTRAP, agent_payload
from pytest_gpuhost.exec.transport import Launcher, PrefixLauncher, RawChannel

__all__ = ["CommandResult", "Connection", "WriteResult", "RawChannel"]

#: Extra seconds a reply may take beyond the operation's own timeout (kill grace, transfer).
REPLY_MARGIN = 15.0
#: Exit codes that mean "python3 is not there" when starting the agent.
_NO_PYTHON = (126, 127)


@dataclass
class CommandResult:
    """What every command returns; also the evidence record."""

    target: str
    command: str
    rc: int
    stdout: str
    stderr: str
    start: float
    duration: float
    timed_out: bool = False

    def __post_init__(self) -> None:
        self._stdout_bytes: bytes | None = None
        self._stderr_bytes: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    @property
    def stdout_bytes(self) -> bytes:
        """The exact bytes printed (stdout is decoded with replacement characters)."""
        return self._stdout_bytes if self._stdout_bytes is not None else self.stdout.encode("utf-8")

    @property
    def stderr_bytes(self) -> bytes:
        return self._stderr_bytes if self._stderr_bytes is not None else self.stderr.encode("utf-8")

    def summary(self) -> str:
        """One line: the command and how it ended."""
        how = "timed out" if self.timed_out else f"exited {self.rc}"
        tail = (self.stderr.strip().splitlines() or [""])[-1]
        return f"`{self.command}` on {self.target} {how}" + (f": {tail}" if tail else "")


@dataclass
class WriteResult:
    """Outcome of a watched write (sysfs, FIFO, file)."""

    path: str
    ok: bool
    errno: int | None = None
    error: str | None = None
    timed_out: bool = False
    duration: float = 0.0

    def as_oserror(self) -> OSError:
        return OSError(self.errno or 0, self.error or "write failed", self.path)


@dataclass
class _Options:
    command_timeout: float = 60.0
    python: str = "python3"
    allow_fallback: bool = True


class _AgentSession:
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
            raise AgentError(
                f"agent on {self.name} gave no reply to {req.get('op')} within {timeout:g}s; stopped it"
            ) from exc
        except (EOFError, OSError, ValueError) as exc:
            self._died(req, exc)

    def _died(self, req: dict[str, Any], exc: BaseException) -> NoReturn:
        self.dead = True
        rc = self.chan.exit_status(2.0)
        tail = _last_line(self.chan.stderr_text())
        what = f"exit status {rc}" if rc is not None else type(exc).__name__
        raise AgentError(
            f"agent on {self.name} died during {req.get('op')} ({what})" + (f": {tail}" if tail else "")
        ) from exc

    def request(self, req: dict[str, Any], timeout: float, on_chunk: Callable[[Any], None] | None) -> Any:
        """Send one request and return the reply dict; raise AgentError when the agent is gone."""
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


#: Observers get at most this much of each output (reports keep far less); bounds redaction cost.
OBSERVED_OUTPUT = 1 << 20


def _clip(text: str) -> str:
    if len(text) <= OBSERVED_OUTPUT:
        return text
    return text[:OBSERVED_OUTPUT] + f"\n... [{len(text) - OBSERVED_OUTPUT} more characters not recorded]"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _redactor() -> tuple[Callable[[str], str], Callable[[Sequence[str]], list[str]]]:
    try:
        from pytest_gpuhost import redact as _r

        return _r.redact, _r.redact_argv
    except ImportError:  # evidence work not there yet: keep the text as it is
        return (lambda s: s), (lambda a: list(a))


class Connection:
    """One per target; owns one agent (or the fallback). See docs/INTERNALS.md section 1."""

    def __init__(
        self,
        name: str,
        launcher: Launcher,
        *,
        command_timeout: float = 60.0,
        python: str = "python3",
        allow_fallback: bool = True,
        options: Any = None,
    ) -> None:
        self.name = name
        self.launcher = launcher
        self.opts = _Options(float(command_timeout), python, allow_fallback)
        self.options = options  # what targets.open_connection was given; reused by container()
        self.round_trips = 0
        self.on_command: list[Callable[[str, CommandResult], None]] = []
        self.config: Any = None  # a pytest Config: the pytest_gpuhost_command hook is called on it
        self.mode: str | None = None  # "agent" or "fallback", once connected
        self.hello: dict[str, Any] = {}
        self.children: list[Connection] = []
        self._session: _AgentSession | None = None
        self._ids = itertools.count(1)
        self._had_agent = False
        self._closed = False
        # One request on the wire at a time: threads sharing a connection take turns.  A plain
        # Lock (not RLock) because a stream's generator may be finished from another thread.
        self._wire = threading.Lock()
        self._stream_owner: int | None = None

    def __repr__(self) -> str:
        return f"<Connection {self.name} via {self.launcher.description} mode={self.mode}>"

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

    def connect(self) -> Connection:
        """Start the agent now (otherwise the first request does); return self."""
        with self._locked():
            self._ensure()
        return self

    def _start_agent(self) -> _AgentSession | None:
        """Start an agent; None when the target has no Python (fallback applies)."""
        argv = [self.opts.python, "-u", "-c", BOOTSTRAP]
        try:
            chan = self.launcher.open(argv)
        except FileNotFoundError as exc:
            if exc.filename in (None, self.opts.python):
                return None  # no interpreter here: the fallback applies
            raise ConnectError(
                f"cannot start the agent on {self.name}: {exc.filename}: command not found"
            ) from exc
        session = _AgentSession(chan, self.name)
        chan.send(agent_payload())
        try:
            reply = session.request({"id": 0, "op": "hello"}, self._connect_timeout() + 20.0, None)
        except AgentError as exc:
            rc = chan.exit_status(1.0)
            session.kill()
            if rc in _NO_PYTHON and not self._had_agent:
                return None
            raise AgentError(f"cannot start the agent on {self.name}: {exc}") from exc
        self.round_trips += 1
        if not reply.get("ok"):
            session.kill()
            raise AgentError(f"agent on {self.name} failed to start: {reply.get('error')}")
        session.hello = self.hello = reply["result"]
        return session

    def _connect_timeout(self) -> float:
        return float(getattr(self.options, "connect_timeout", None) or 10.0)

    def _ensure(self) -> _AgentSession | None:
        if self._closed:
            raise AgentError(f"connection to {self.name} is closed")
        if self.mode == "fallback":
            return None
        if self._session is not None and not self._session.dead:
            return self._session
        if self._session is not None:  # it died: one fresh start, then give up
            self._session.kill()
            self._session = None
        try:
            session = self._start_agent()
        except ConnectError as exc:
            if self._had_agent:
                raise AgentError(f"agent on {self.name} died and reconnecting failed: {exc}") from exc
            raise
        if session is None:
            if not self.opts.allow_fallback:
                raise AgentError(f"no {self.opts.python} on {self.name} and the fallback is disabled")
            self.mode = "fallback"
            return None
        self._session = session
        self._had_agent = True
        self.mode = "agent"
        return session

    def _request(
        self, op: str, params: dict[str, Any], timeout: float, on_chunk: Callable[[Any], None] | None = None
    ) -> dict[str, Any]:
        with self._locked():
            session = self._ensure()
            if session is None:
                raise AgentError(
                    f"{op}: {self.name} has no {self.opts.python}; only run/read/write work there"
                )
            req = {"id": next(self._ids), "op": op}
            req.update(params)
            self.round_trips += 1
            return dict(session.request(req, timeout, on_chunk))

    # ------------------------------------------------------------ public API

    def call(self, op: str, *, reply_timeout: float | None = None, **params: Any) -> Any:
        """Run a raw agent op and return its result; raise AgentError (with errno) on failure.

        `reply_timeout` bounds the wait for the reply (default: the op's own `timeout`, or the
        command timeout, plus a margin); quick bookkeeping ops pass a short one so that a cut link
        is noticed in seconds.
        """
        timeout = float(reply_timeout or self._op_timeout(params))
        with self._locked():
            fallback = self._ensure() is None
        if fallback:
            reply = self._fallback_call(op, params)
        else:
            reply = self._request(op, params, timeout)
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
        with self._locked():
            session = self._ensure()
        if session is None:
            result = self._fallback_run(params, t)
        else:
            on_chunk = None
            if on_output is not None:
                params["stream"] = True

                def on_chunk(chunk: Any) -> None:
                    on_output(chunk.get("stream", "stdout"), chunk.get("data", ""))

            reply = self._request("run", params, t + REPLY_MARGIN, on_chunk)
            if not reply.get("ok"):
                raise AgentError(f"run on {self.name}: {reply.get('error')}")
            result = self._result(shown, reply["result"])
        self._record(result, env)
        if check:
            if result.timed_out:
                raise CommandTimeout(result.summary())
            if result.rc != 0:
                raise GpuhostError(result.summary())
        return result

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
        with self._locked():
            fallback = self._ensure() is None
        if fallback:
            return self._fallback_read_files(paths)
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

    def write_file(
        self, path: str, data: str | bytes, *, timeout: float | None = None, mode: str = "w"
    ) -> WriteResult:
        """Write under a watchdog on the target: a write blocked in the kernel comes back `timed_out`."""
        import base64

        t = float(timeout if timeout is not None else self.opts.command_timeout)
        params: dict[str, Any] = {"path": path, "timeout": t, "mode": mode}
        if isinstance(data, bytes):
            params["b64"] = base64.b64encode(data).decode("ascii")
        else:
            params["data"] = data
        start = time.time()
        with self._locked():
            fallback = self._ensure() is None
        if fallback:
            wr = self._fallback_write(path, data, t, mode)
        else:
            r = self.call("write_file", **params)
            wr = WriteResult(
                path,
                bool(r["ok"]),
                r.get("errno"),
                r.get("error"),
                bool(r.get("timed_out")),
                float(r.get("duration", 0.0)),
            )
        shown = _describe_write(path, data, mode)
        rc = 0 if wr.ok else (-9 if wr.timed_out else (wr.errno or 1))
        self._record(
            CommandResult(
                self.name, shown, rc, "", "" if wr.ok else (wr.error or ""), start, wr.duration, wr.timed_out
            ),
            None,
        )
        return wr

    def stream(self, op: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Yield the chunks of a streaming op as they arrive, then `{"done": True, "result": ...}`.

        The connection is held for the stream: other threads wait, and a request from the
        consuming thread itself raises AgentError.  Leaving the loop early reads and drops the
        rest of the stream (bounded by the op's timeout) so the connection stays usable.
        """
        timeout = self._op_timeout(params)
        self._acquire()
        done = False
        session: _AgentSession | None = None
        try:
            session = self._ensure()
            if session is None:
                raise AgentError(f"{op}: {self.name} has no {self.opts.python}; streaming needs the agent")
            req = {"id": next(self._ids), "op": op}
            req.update(params)
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
                except AgentError:
                    pass  # next_message stopped the agent; the next request starts a new one
            self._stream_owner = None
            self._wire.release()

    def open_channel(self, argv: Sequence[str]) -> RawChannel:
        """Start `argv` on the target on a channel of its own, for bulk bytes (tar, hashing).

        Over SSH this is an OpenSSH client process where one can log in (see transport.py)."""
        if self._closed:
            raise AgentError(f"connection to {self.name} is closed")
        return self.launcher.open_bulk([str(a) for a in argv])

    def container(self, spec: Any) -> Connection:
        """Open a connection to a container through this one (or by its own SSH for ssh://)."""
        from pytest_gpuhost.exec.targets import ContainerSpec, open_connection, parse_container

        cs = spec if isinstance(spec, ContainerSpec) else parse_container(str(spec))
        if cs.kind == "ssh":
            assert cs.target is not None
            conn = open_connection(cs.target, self.options)
        else:
            launcher = PrefixLauncher(self.launcher, cs.prefix(), f"{cs.kind}:{cs.name} via {self.name}")
            conn = Connection(
                f"{self.name}/{cs.name}",
                launcher,
                command_timeout=self.opts.command_timeout,
                python=self.opts.python,
                allow_fallback=self.opts.allow_fallback,
                options=self.options,
            )
            conn.connect()
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
        if self._session is not None:
            self._session.chan.close_stdin()  # the agent exits at EOF
            self._session.chan.exit_status(1.0)
            self._session.kill()
            self._session = None
        self.launcher.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ evidence

    def _record(self, result: CommandResult, env: Mapping[str, str] | None) -> None:
        if not (self.on_command or self.config is not None or _evidence_module() is not None):
            return
        redact, _ = _redactor()
        shown = result.command
        if env:
            try:
                from pytest_gpuhost.redact import redact_env

                shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in redact_env(env).items()) + " " + shown
            except ImportError:
                shown = " ".join(f"{k}=..." for k in env) + " " + shown
        red = CommandResult(
            result.target,
            redact(shown),
            result.rc,
            redact(_clip(result.stdout)),
            redact(_clip(result.stderr)),
            result.start,
            result.duration,
            result.timed_out,
        )
        ev = _evidence_module()
        if ev is not None:
            current = getattr(ev, "current", None)
            bucket = current() if current is not None else None
            if bucket is not None:
                bucket.command(red)
        for cb in list(self.on_command):
            cb(self.name, red)
        if self.config is not None:
            hook = getattr(self.config.hook, "pytest_gpuhost_command", None)
            if hook is not None:
                hook(target=self.name, result=red)

    # ------------------------------------------------------------ fallback (no python3)

    def _fallback_exec(
        self, argv: Sequence[str], timeout: float, stdin: bytes | None = None
    ) -> tuple[int, bytes, bytes, bool, float, float]:
        """Run argv on a channel of its own under `timeout -s KILL`; bounded locally too."""
        start = time.time()
        t0 = time.monotonic()
        secs = max(1, int(timeout + 0.999))
        self.round_trips += 1
        try:
            chan = self.launcher.open(["timeout", "-s", "KILL", str(secs), *argv])
        except FileNotFoundError as exc:
            raise AgentError(f"{self.name} has neither {self.opts.python} nor {exc.filename}") from exc
        try:
            if stdin:
                chan.send(stdin)
            chan.close_stdin()
            out = bytearray()
            deadline = t0 + secs + 5.0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    data = chan.recv(left)
                except TimeoutError:
                    break
                if not data:
                    break
                out += data
            rc = chan.exit_status(max(0.1, deadline - time.monotonic()))
            err = chan.stderr_text().encode("utf-8")
        finally:
            chan.close()
        rc = -9 if rc is None else rc
        timed_out = rc in (137, -9)
        if timed_out:
            rc = -9
        return rc, bytes(out), err, timed_out, start, time.monotonic() - t0

    def _fallback_run(self, params: Mapping[str, Any], timeout: float) -> CommandResult:
        import base64

        if "argv" in params:
            argv = list(params["argv"])
            shown = shlex.join(argv)
        else:
            argv = ["sh", "-c", params["shell"]]
            shown = params["shell"]
        if params.get("env"):
            argv = ["env", *(f"{k}={v}" for k, v in params["env"].items()), *argv]
        if params.get("cwd"):
            argv = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", params["cwd"], *argv]
        stdin = None
        if "stdin_b64" in params:
            stdin = base64.b64decode(params["stdin_b64"])
        elif "stdin" in params:
            stdin = params["stdin"].encode("utf-8")
        rc, out, err, timed_out, start, dur = self._fallback_exec(argv, timeout, stdin)
        res = CommandResult(
            self.name,
            shown,
            rc,
            out.decode("utf-8", "replace"),
            err.decode("utf-8", "replace"),
            start,
            dur,
            timed_out,
        )
        res._stdout_bytes = out
        return res

    def _fallback_call(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        """Answer the core file ops with POSIX tools when the target has no Python."""
        try:
            if op == "batch":
                replies = []
                for req in params.get("requests") or []:
                    sub = dict(req)
                    replies.append(self._fallback_call(str(sub.pop("op", "")), sub))
                return {"ok": True, "result": replies}
            if op == "run":
                res = self._fallback_run(params, float(params.get("timeout") or self.opts.command_timeout))
                return {
                    "ok": True,
                    "result": {
                        "rc": res.rc,
                        "stdout": res.stdout,
                        "stderr": res.stderr,
                        "timed_out": res.timed_out,
                        "start": res.start,
                        "duration": res.duration,
                    },
                }
            if op == "read_files":
                files = self._fallback_read_files(list(params.get("paths") or []))
                return {"ok": True, "result": {p: _entry(v) for p, v in files.items()}}
            if op == "write_file":
                data = params.get("data", "")
                if params.get("b64") is not None:
                    import base64

                    data = base64.b64decode(params["b64"])
                wr = self._fallback_write(
                    params["path"], data, float(params["timeout"]), params.get("mode") or "w"
                )
                return {
                    "ok": True,
                    "result": {
                        "ok": wr.ok,
                        "errno": wr.errno,
                        "error": wr.error,
                        "timed_out": wr.timed_out,
                        "duration": wr.duration,
                    },
                }
            if op in _FB_SCRIPTS:
                return {"ok": True, "result": self._fallback_paths(op, params)}
            if op == "glob":
                patterns = params.get("patterns") or [params.get("pattern")]
                out = {}
                for pattern in patterns:
                    rc, data, err, _t, _s, _d = self._fallback_exec(
                        ["sh", "-c", _FB_GLOB, "sh", str(pattern)], self.opts.command_timeout
                    )
                    out[pattern] = sorted(x for x in data.decode("utf-8", "replace").split("\0") if x)
                return {"ok": True, "result": out if "patterns" in params else out[patterns[0]]}
        except OSError as exc:
            return {"ok": False, "error": f"{op}: {exc}", "errno": exc.errno}
        return {
            "ok": False,
            "error": f"{op} needs {self.opts.python} on {self.name}, which it lacks",
            "errno": None,
        }

    def _fallback_paths(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        paths = params.get("paths") or ([params["path"]] if params.get("path") else [])
        key = op
        if op == "readlink" and params.get("resolve"):
            key = "readlink_resolve"
        if op == "stat" and params.get("follow", True):
            key = "stat_follow"
        rc, data, err, timed_out, _s, _d = self._fallback_exec(
            ["sh", "-c", _FB_SCRIPTS[key], "sh", *paths], self.opts.command_timeout
        )
        if timed_out:
            raise OSError(0, f"timed out after {self.opts.command_timeout:g}s")
        fields = data.decode("utf-8", "replace").split("\0")
        out: dict[str, Any] = {}
        for i, path in enumerate(paths):
            try:
                code, text = int(fields[2 * i]), fields[2 * i + 1]
            except (IndexError, ValueError):
                out[path] = {"errno": None, "error": "no answer"}
                continue
            if code != 0:
                exc = _oserror_from_text(text, path, False)
                out[path] = {"errno": exc.errno or None, "error": exc.strerror}
            elif op == "listdir":
                out[path] = sorted(x for x in text.split("\n") if x)
            elif key == "readlink_resolve":
                out[path] = text
            elif op == "readlink":
                out[path] = {"target": text}
            else:
                out[path] = _parse_stat(text)
        return out

    def _fallback_read_files(self, paths: list[str]) -> dict[str, str | OSError]:
        out: dict[str, str | OSError] = {}
        for path in paths:
            rc, data, err, timed_out, _s, _d = self._fallback_exec(
                ["cat", "--", path], self.opts.command_timeout
            )
            if rc == 0:
                out[path] = data.decode("utf-8", "replace")
            else:
                out[path] = _oserror_from_text(err.decode("utf-8", "replace"), path, timed_out)
        return out

    def _fallback_write(self, path: str, data: str | bytes, timeout: float, mode: str) -> WriteResult:
        payload = data.encode("utf-8") if isinstance(data, str) else data
        script = 'cat >> "$1"' if mode == "a" else 'cat > "$1"'
        rc, _out, err, timed_out, _s, dur = self._fallback_exec(
            ["sh", "-c", script, "sh", path], timeout, payload
        )
        if rc == 0:
            return WriteResult(path, True, duration=dur)
        exc = _oserror_from_text(err.decode("utf-8", "replace"), path, timed_out)
        return WriteResult(path, False, exc.errno, exc.strerror, timed_out, dur)


# Each prints, per path argument, "<status>\\0<output>\\0" (output of a failure is its message).
_FB_EACH = 'for p; do {}; printf "%s\\0%s\\0" "$?" "$out"; done'
_FB_SCRIPTS = {
    "readlink": _FB_EACH.format(
        'out=$(readlink -- "$p" 2>&1 || { if [ -e "$p" ]; then echo Invalid argument; '
        "else echo No such file or directory; fi; false; })"
    ),
    "readlink_resolve": _FB_EACH.format('out=$(readlink -f -- "$p" 2>&1)'),
    "listdir": _FB_EACH.format(
        'if [ ! -e "$p" ]; then out="No such file or directory"; false; '
        'elif [ ! -d "$p" ]; then out="Not a directory"; false; else out=$(ls -1A -- "$p" 2>&1); fi'
    ),
    "stat": _FB_EACH.format('out=$(stat -c "%f %s %u %g %Y %i %d %h" -- "$p" 2>&1)'),
    "stat_follow": _FB_EACH.format('out=$(stat -L -c "%f %s %u %g %Y %i %d %h" -- "$p" 2>&1)'),
}
# IFS empty: the pattern is expanded as a glob but never split on spaces.
_FB_GLOB = 'IFS=; for f in $1; do if [ -e "$f" ] || [ -L "$f" ]; then printf "%s\\0" "$f"; fi; done'


def _parse_stat(text: str) -> dict[str, Any]:
    import stat as st

    raw, size, uid, gid, mtime, ino, dev, nlink = text.split()[:8]
    mode = int(raw, 16)
    kinds = [
        (st.S_ISLNK, "link"),
        (st.S_ISDIR, "dir"),
        (st.S_ISREG, "file"),
        (st.S_ISFIFO, "fifo"),
        (st.S_ISSOCK, "socket"),
        (st.S_ISCHR, "char"),
        (st.S_ISBLK, "block"),
    ]
    kind = next((name for test, name in kinds if test(mode)), "other")
    return {
        "type": kind,
        "mode": st.S_IMODE(mode),
        "size": int(size),
        "uid": int(uid),
        "gid": int(gid),
        "mtime": float(mtime),
        "ino": int(ino),
        "dev": int(dev),
        "nlink": int(nlink),
    }


def _entry(value: str | OSError) -> dict[str, Any]:
    if isinstance(value, OSError):
        return {"errno": value.errno or None, "error": value.strerror}
    return {"data": value}


_ERRNO_TEXT = {
    "No such file or directory": 2,
    "Permission denied": 13,
    "Is a directory": 21,
    "Operation not permitted": 1,
    "Device or resource busy": 16,
    "Invalid argument": 22,
    "No such device": 19,
    "Not a directory": 20,
}


def _oserror_from_text(text: str, path: str, timed_out: bool) -> OSError:
    if timed_out:
        return OSError(0, "timed out", path)
    for msg, num in _ERRNO_TEXT.items():
        if msg in text:
            return OSError(num, msg, path)
    return OSError(0, _last_line(text) or "failed", path)


def _describe_write(path: str, data: str | bytes, mode: str) -> str:
    op = ">>" if mode == "a" else ">"
    if isinstance(data, str) and len(data) <= 200 and "\n" not in data.rstrip("\n"):
        return f"echo {shlex.quote(data.rstrip(chr(10)))} {op} {shlex.quote(path)}"
    return f"write {len(data)} bytes {op} {shlex.quote(path)}"


_EVIDENCE: list[Any] = []


def _evidence_module() -> Any:
    """Return pytest_gpuhost.run.evidence if it exists (imported once), else None."""
    if not _EVIDENCE:
        mod: Any
        try:
            from pytest_gpuhost.run import evidence as mod
        except ImportError:
            mod = None
        _EVIDENCE.append(mod)
    return _EVIDENCE[0]

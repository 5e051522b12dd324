"""The connection for targets without a usable Python: one channel per command, POSIX tools for file ops.

Each command runs on a channel of its own under `timeout -s KILL N` (the whole process group is
killed on the target), bounded here too, N + 5 s.  Files are read with `cat` and written with
`sh -c 'cat > "$1"'`; `listdir`, `stat`, `readlink` and `glob` are answered by small `sh` scripts;
other agent ops fail with "needs the agent" and why the node has none (`needs_agent`).  A channel that ends without an exit status (the SSH
connection dropped) or gives none within the bound raises `AgentLost`, as the agent would.
"""

from __future__ import annotations

import base64
import shlex
import stat as st
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pytest_gpuhost.errors import AgentError, AgentLost
from pytest_gpuhost.exec.agent_session import last_line
from pytest_gpuhost.exec.connection import Connection
from pytest_gpuhost.exec.results import CommandResult, WriteResult

__all__ = ["FallbackConnection"]


class FallbackConnection(Connection):
    """A connection that answers the core ops with one `timeout`-wrapped channel each."""

    mode = "fallback"
    _said_why = False

    def connect(self) -> FallbackConnection:
        """Nothing runs on the target between commands; return self."""
        self._check_open()
        return self

    def _shutdown(self) -> None:
        """Nothing to stop: every command's channel is closed when it ends."""

    def _exec(
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
            raise AgentError(f"{self.name} has no usable Python and no {exc.filename}") from exc
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
            lost = chan.lost()
        finally:
            chan.close()
        if lost:
            raise AgentLost(
                f"channel to {self.name} closed during `{shlex.join(argv)}`"
                + (f": {last_line(err.decode('utf-8', 'replace'))}" if err.strip() else "")
            )
        if rc is None:
            raise AgentLost(f"{self.name} gave no exit status for `{shlex.join(argv)}` within {secs + 5}s")
        timed_out = rc in (137, -9)
        if timed_out:
            rc = -9
        return rc, bytes(out), err, timed_out, start, time.monotonic() - t0

    # ------------------------------------------------------------ the protocol

    def _run(
        self, params: dict[str, Any], shown: str, timeout: float, on_output: Callable[[str, str], None] | None
    ) -> CommandResult:
        if "argv" in params:
            argv = list(params["argv"])
        else:
            argv = ["sh", "-c", params["shell"]]
        if params.get("env"):
            argv = ["env", *(f"{k}={v}" for k, v in params["env"].items()), *argv]
        if params.get("cwd"):
            argv = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", params["cwd"], *argv]
        stdin = None
        if "stdin_b64" in params:
            stdin = base64.b64decode(params["stdin_b64"])
        elif "stdin" in params:
            stdin = params["stdin"].encode("utf-8")
        rc, out, err, timed_out, start, dur = self._exec(argv, timeout, stdin)
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

    def _call(self, op: str, params: dict[str, Any], reply_timeout: float) -> dict[str, Any]:
        """Answer the core file ops with POSIX tools, in the agent's reply format."""
        try:
            if op == "batch":
                replies = []
                for req in params.get("requests") or []:
                    sub = dict(req)
                    replies.append(self._call(str(sub.pop("op", "")), sub, reply_timeout))
                return {"ok": True, "result": replies}
            if op == "run":
                shown = shlex.join(params["argv"]) if "argv" in params else params["shell"]
                res = self._run(
                    params, shown, float(params.get("timeout") or self.opts.command_timeout), None
                )
                keys = ("rc", "stdout", "stderr", "timed_out", "start", "duration")
                return {"ok": True, "result": {k: getattr(res, k) for k in keys}}
            if op == "read_files":
                files = self.read_files(list(params.get("paths") or []))
                return {"ok": True, "result": {p: _entry(v) for p, v in files.items()}}
            if op == "write_file":
                data = params.get("data", "")
                if params.get("b64") is not None:
                    data = base64.b64decode(params["b64"])
                wr = self._write(params["path"], data, float(params["timeout"]), params.get("mode") or "w")
                fields = ("ok", "errno", "error", "timed_out", "duration")
                return {"ok": True, "result": {k: getattr(wr, k) for k in fields}}
            if op in _SCRIPTS:
                return {"ok": True, "result": self._paths(op, params)}
            if op == "glob":
                patterns = params.get("patterns") or [params.get("pattern")]
                out = {}
                for pattern in patterns:
                    _rc, data, _e, _t, _s, _d = self._exec(
                        ["sh", "-c", _GLOB, "sh", str(pattern)], self.opts.command_timeout
                    )
                    out[pattern] = sorted(x for x in data.decode("utf-8", "replace").split("\0") if x)
                return {"ok": True, "result": out if "patterns" in params else out[patterns[0]]}
        except OSError as exc:
            return {"ok": False, "error": f"{op}: {exc}", "errno": exc.errno}
        return {"ok": False, "error": self.needs_agent(), "errno": None}

    def needs_agent(self) -> str:
        """Say that an operation needs the agent: the first time with the whole reason, then briefly.

        The reason (what Python the node has, what the agent needs) is one line said once per
        connection, so a run whose every check needs the agent does not print it once per check.
        """
        why = self.no_python.removeprefix(f"{self.name}: ") or "no usable Python"
        if self._said_why:
            return f"needs the agent, which {self.name} cannot run (no usable Python: said once above)"
        self._said_why = True
        return f"needs the agent; {why}"

    def _paths(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        paths = params.get("paths") or ([params["path"]] if params.get("path") else [])
        key = op
        if op == "readlink" and params.get("resolve"):
            key = "readlink_resolve"
        if op == "stat" and params.get("follow", True):
            key = "stat_follow"
        _rc, data, _err, timed_out, _s, _d = self._exec(
            ["sh", "-c", _SCRIPTS[key], "sh", *paths], self.opts.command_timeout
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

    def read_files(self, paths: Sequence[str], *, max_bytes: int | None = None) -> dict[str, str | OSError]:
        """Read each file with `cat` on a channel of its own (`max_bytes` is not applied)."""
        self._check_open()
        out: dict[str, str | OSError] = {}
        for path in paths:
            rc, data, err, timed_out, _s, _d = self._exec(["cat", "--", path], self.opts.command_timeout)
            if rc == 0:
                out[path] = data.decode("utf-8", "replace")
            else:
                out[path] = _oserror_from_text(err.decode("utf-8", "replace"), path, timed_out)
        return out

    def _write(self, path: str, data: str | bytes, timeout: float, mode: str) -> WriteResult:
        payload = data.encode("utf-8") if isinstance(data, str) else data
        script = 'cat >> "$1"' if mode == "a" else 'cat > "$1"'
        rc, _out, err, timed_out, _s, dur = self._exec(["sh", "-c", script, "sh", path], timeout, payload)
        if rc == 0:
            return WriteResult(path, True, duration=dur)
        exc = _oserror_from_text(err.decode("utf-8", "replace"), path, timed_out)
        return WriteResult(path, False, exc.errno, exc.strerror, timed_out, dur)

    def stream(self, op: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Raise AgentError when iterated, as the agent's stream would fail: streaming needs it."""
        self._check_open()
        raise AgentError(f"{op} on {self.name}: {self.needs_agent()}")
        yield {}  # unreachable: makes this a generator, so it fails where the agent's would


# Each prints, per path argument, "<status>\\0<output>\\0" (output of a failure is its message).
_EACH = 'for p; do {}; printf "%s\\0%s\\0" "$?" "$out"; done'
_SCRIPTS = {
    "readlink": _EACH.format(
        'out=$(readlink -- "$p" 2>&1 || { if [ -e "$p" ]; then echo Invalid argument; '
        "else echo No such file or directory; fi; false; })"
    ),
    "readlink_resolve": _EACH.format('out=$(readlink -f -- "$p" 2>&1)'),
    "listdir": _EACH.format(
        'if [ ! -e "$p" ]; then out="No such file or directory"; false; '
        'elif [ ! -d "$p" ]; then out="Not a directory"; false; else out=$(ls -1A -- "$p" 2>&1); fi'
    ),
    "stat": _EACH.format('out=$(stat -c "%f %s %u %g %Y %i %d %h" -- "$p" 2>&1)'),
    "stat_follow": _EACH.format('out=$(stat -L -c "%f %s %u %g %Y %i %d %h" -- "$p" 2>&1)'),
}
# IFS empty: the pattern is expanded as a glob but never split on spaces.
_GLOB = 'IFS=; for f in $1; do if [ -e "$f" ] || [ -L "$f" ]; then printf "%s\\0" "$f"; fi; done'

_KINDS = (
    (st.S_ISLNK, "link"),
    (st.S_ISDIR, "dir"),
    (st.S_ISREG, "file"),
    (st.S_ISFIFO, "fifo"),
    (st.S_ISSOCK, "socket"),
    (st.S_ISCHR, "char"),
    (st.S_ISBLK, "block"),
)


def _parse_stat(text: str) -> dict[str, Any]:
    raw, size, uid, gid, mtime, ino, dev, nlink = text.split()[:8]
    mode = int(raw, 16)
    return {
        "type": next((name for test, name in _KINDS if test(mode)), "other"),
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


# The tools' messages are the only account of why they failed: errno values are read from them.
_ERRNO_TEXT: Mapping[str, int] = {
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
    return OSError(0, last_line(text) or "failed", path)

"""The gpuhost agent core: a line-delimited JSON server that runs ON the target.

This file is not imported by the plugin; `pytest_gpuhost.exec.agent.agent_source()` concatenates it
with every `probe_*.py` of this package (sorted by name) and a final `main()` call, and the
connection sends that program to the target, where a tiny bootstrap `exec`s it.  So:

* stdlib only, Python 3.6 syntax (no walrus, no `from __future__` (it is stripped anyway), no
  annotations that need evaluation); the agent must run on old distributions.
* Probe files never import from `pytest_gpuhost`; everything defined here is already in their
  global namespace.  Register handlers with the decorators below::

      @op("gpu_inventory")                 # handler(params: dict) -> JSON-able result
      def gpu_inventory(params):
          return {...}

      @op("tar_stream", stream=True)       # handler(params, emit): call emit(chunk) for each
      def tar_stream(params, emit):        # chunk; the return value is the final result
          emit({"b64": ...})
          return {"bytes": n}

      @fact("iommu_groups")                # handler(params: dict) -> JSON-able; the "facts" op
      def iommu_groups(params):            # calls it with the request's "params"
          return {...}

  Raise `OSError` (its errno is passed back) or `OpError("one line")` to fail a request.
  Helpers probes may use: `run_process(argv_or_shell, timeout, ...)` (same dict as the `run`
  op), `read_text(path, max_bytes)`, `b64e(bytes)`/`b64d(str)`, `emit` for streaming ops.

Wire protocol (docs/INTERNALS.md section 1): one JSON object per line each way.  Request
`{"id": 7, "op": "run", ...params}`; reply `{"id": 7, "ok": true, "result": ...}` or
`{"id": 7, "ok": false, "error": "one line", "errno": 13 | null}`; streaming ops send
`{"id": 7, "chunk": ...}` lines before the final reply.  Requests are handled one at a time;
nothing in a handler waits without a bound, so the agent always comes back to its loop.
"""

# ruff: noqa: UP031  (%-formatting reads the same on every Python the agent may meet)

import base64
import errno as _errno
import glob as _glob
import json
import os
import platform
import select
import signal
import socket
import subprocess
import sys
import time

AGENT_VERSION = 1
_OPS = {}
_STREAM_OPS = set()
_FACTS = {}
_ORPHANS = []  # pids of write children left to the kernel; reaped when they finish
_PROTO_FDS = []  # the protocol's descriptors; a forked writer closes them at once

DEFAULT_MAX_OUTPUT = 64 * 1024 * 1024
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
KILL_GRACE = 0.5  # seconds between SIGTERM and SIGKILL of a timed-out process group
EXIT_LINGER = 0.5  # seconds to wait for EOF after the main process exited (background children)


class OpError(Exception):
    """A request failed; the message is one line for the operator."""

    def __init__(self, message, errno=None):
        Exception.__init__(self, message)
        self.errno = errno


def op(name, stream=False):
    """Register an agent operation under `name` (see the module docstring)."""

    def deco(fn):
        _OPS[name] = fn
        if stream:
            _STREAM_OPS.add(name)
        else:
            _STREAM_OPS.discard(name)
        return fn

    return deco


def fact(name):
    """Register a fact for the `facts` op."""

    def deco(fn):
        _FACTS[name] = fn
        return fn

    return deco


def b64e(data):
    return base64.b64encode(data).decode("ascii")


def b64d(text):
    return base64.b64decode(text.encode("ascii"))


def _text(data, out, key):
    """Store bytes as text under `key`, adding `key_b64` when they are not UTF-8."""
    try:
        out[key] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[key] = data.decode("utf-8", "replace")
        out[key + "_b64"] = b64e(data)


def _param_bytes(params, key="data"):
    if params.get("b64") is not None:
        return b64d(params["b64"])
    data = params.get(key, "")
    if isinstance(data, str):
        return data.encode("utf-8")
    return bytes(data)


def _oserror(exc):
    return {"errno": exc.errno, "error": exc.strerror or str(exc)}


def _reap_orphans():
    for pid in list(_ORPHANS):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _ORPHANS.remove(pid)


# ---------------------------------------------------------------- run


def _killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_process(
    argv=None,
    shell=None,
    timeout=None,
    stdin=None,
    env=None,
    cwd=None,
    max_output=DEFAULT_MAX_OUTPUT,
    kill_grace=KILL_GRACE,
    on_output=None,
    stdin_b64=None,
):
    """Run a command in its own session; kill its whole process group at the timeout.

    Returns the `run` op's result dict.  `on_output(stream_name, bytes)` is called as output
    arrives (used for streaming).  Output printed before a timeout is kept.
    """
    if timeout is None:
        raise OpError("run: timeout is required")
    timeout = float(timeout)
    if argv is None and shell is None:
        raise OpError("run: give argv or shell")
    if argv is not None:
        args = [str(a) for a in argv]
        if not args:
            raise OpError("run: empty argv")
    else:
        args = ["/bin/sh", "-c", shell]
    full_env = None
    if env:
        full_env = dict(os.environ)
        for k, v in env.items():
            if v is None:
                full_env.pop(k, None)
            else:
                full_env[k] = str(v)
    if stdin_b64 is not None:
        stdin_data = b64d(stdin_b64)
    elif stdin is not None:
        stdin_data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
    else:
        stdin_data = None
    start = time.time()
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        # Same shape as a shell's "command not found" so callers need one code path.
        return {
            "rc": 127 if exc.errno == _errno.ENOENT else 126,
            "stdout": "",
            "stderr": "%s: %s\n" % (exc.filename or args[0], exc.strerror),
            "timed_out": False,
            "start": start,
            "duration": time.monotonic() - t0,
        }
    out_fd = proc.stdout.fileno()
    err_fd = proc.stderr.fileno()
    bufs = {out_fd: [], err_fd: []}
    names = {out_fd: "stdout", err_fd: "stderr"}
    sizes = {"stdout": 0, "stderr": 0}
    truncated = False
    open_fds = set(bufs)
    wfd = None
    pending = b""
    if stdin_data is not None:
        wfd = proc.stdin.fileno()
        pending = stdin_data
        os.set_blocking(wfd, False)
        if not pending:
            proc.stdin.close()
            wfd = None
    timed_out = False
    exited_at = None
    poller = select.poll()
    for fd in open_fds:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    if wfd is not None:
        poller.register(wfd, select.POLLOUT | select.POLLERR)
    while open_fds or wfd is not None:
        now = time.monotonic()
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        limit = deadline if exited_at is None else min(deadline, exited_at + EXIT_LINGER)
        if now >= limit:
            if exited_at is None:
                timed_out = True
            break
        # Wake every 100 ms while the main process runs, to notice it exiting while a
        # background child keeps the pipes open; EOF itself wakes us at once.
        wait = min(limit - now, 0.1) if exited_at is None else limit - now
        for fd, _ev in poller.poll(int(wait * 1000) + 1):
            if fd == wfd:
                try:
                    n = os.write(wfd, pending[:65536])
                    pending = pending[n:]
                except BlockingIOError:
                    pass
                except OSError:  # EPIPE: the command does not read its stdin
                    pending = b""
                if not pending:
                    poller.unregister(wfd)
                    try:
                        proc.stdin.close()
                    except OSError:
                        pass
                    wfd = None
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                poller.unregister(fd)
                open_fds.discard(fd)
                continue
            name = names[fd]
            if on_output is not None:
                on_output(name, data)
            if sizes[name] < max_output:
                bufs[fd].append(data[: max_output - sizes[name]])
            if sizes[name] + len(data) > max_output:
                truncated = True
            sizes[name] += len(data)
    if timed_out:
        _killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=kill_grace)
        except subprocess.TimeoutExpired:
            pass
        _killpg(proc.pid, signal.SIGKILL)
        # Collect what was printed during the grace period, without waiting for EOF: a
        # process in another session may still hold the pipes.
        for fd in list(open_fds):
            try:
                os.set_blocking(fd, False)
                while True:
                    data = os.read(fd, 65536)
                    if not data:
                        break
                    if sizes[names[fd]] < max_output:
                        bufs[fd].append(data)
                    sizes[names[fd]] += len(data)
            except (BlockingIOError, OSError):
                pass
    try:
        rc = proc.wait(timeout=max(0.1, kill_grace))
    except subprocess.TimeoutExpired:
        # Unkillable (D state): report it, leave the process to the kernel.
        _ORPHANS.append(proc.pid)
        rc = -9
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
    if timed_out:
        rc = -9  # the contract: a timed-out command reports SIGKILL whatever signal ended it
    result = {
        "rc": rc,
        "timed_out": timed_out,
        "start": start,
        "duration": time.monotonic() - t0,
    }
    _text(b"".join(bufs[out_fd]), result, "stdout")
    _text(b"".join(bufs[err_fd]), result, "stderr")
    if truncated:
        result["truncated"] = True
    return result


@op("run")
def op_run(params, emit=None):
    on_output = None
    if params.get("stream") and emit is not None:

        def on_output(name, data):
            chunk = {"stream": name}
            _text(data, chunk, "data")
            emit(chunk)

    return run_process(
        argv=params.get("argv"),
        shell=params.get("shell"),
        timeout=params.get("timeout"),
        stdin=params.get("stdin"),
        stdin_b64=params.get("stdin_b64"),
        env=params.get("env"),
        cwd=params.get("cwd"),
        max_output=int(params.get("max_output") or DEFAULT_MAX_OUTPUT),
        kill_grace=float(params.get("kill_grace", KILL_GRACE)),
        on_output=on_output,
    )


_STREAM_OPS.add("run")  # run streams its output when asked ("stream": true)


# ---------------------------------------------------------------- files


def read_text(path, max_bytes=DEFAULT_MAX_BYTES):
    """Read up to `max_bytes` of a file; raise OSError."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        chunks = []
        left = max_bytes
        while left > 0:
            data = os.read(fd, min(left, 1 << 20))
            if not data:
                break
            chunks.append(data)
            left -= len(data)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_str(path, default=None, max_bytes=65536):
    """Return a small file's text, stripped (sysfs, procfs values); `default` when unreadable."""
    try:
        return read_text(path, max_bytes).decode("utf-8", "replace").strip()
    except OSError:
        return default


def link_name(path):
    """Return the last part of a symlink's target (a sysfs driver or group link); None if none."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


@op("read_files")
def op_read_files(params):
    max_bytes = int(params.get("max_bytes") or DEFAULT_MAX_BYTES)
    out = {}
    for path in params.get("paths") or []:
        try:
            entry = {}
            _text(read_text(path, max_bytes), entry, "data")
            out[path] = entry
        except OSError as exc:
            out[path] = _oserror(exc)
    return out


def _write_child(path, data, mode, wfd):
    # In the forked child: one write() per chunk so sysfs sees the whole value at once.
    code = 0
    msg = b""
    try:
        flags = os.O_WRONLY | getattr(os, "O_NOCTTY", 0)
        if mode == "a":
            flags |= os.O_APPEND | os.O_CREAT
        elif mode == "w":
            flags |= os.O_CREAT | os.O_TRUNC
        fd = os.open(path, flags, 0o644)
        try:
            view = memoryview(data)
            while True:
                n = os.write(fd, view)
                view = view[n:]
                if not len(view):
                    break
        finally:
            os.close(fd)
    except OSError as exc:
        code = exc.errno or 255
        msg = (exc.strerror or str(exc)).encode("utf-8", "replace")
    except BaseException as exc:  # noqa: B036 - the child must always report and exit
        code = 255
        msg = str(exc).encode("utf-8", "replace")
    try:
        os.write(wfd, b"%d %s" % (code, msg))
    finally:
        os._exit(0)


def write_file(path, data, timeout, mode="w"):
    """Write `data` to `path` in a forked child under a watchdog; never block the caller."""
    t0 = time.monotonic()
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(rfd)
            # A writer stuck in the kernel must not hold the agent's pipes: the SSH channel (and
            # the session on the target) could never close.
            for fd in _PROTO_FDS:
                try:
                    os.close(fd)
                except OSError:
                    pass
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _write_child(path, data, mode, wfd)
        finally:
            os._exit(255)
    os.close(wfd)
    try:
        ready, _, _ = select.select([rfd], [], [], float(timeout))
        if not ready:
            # Blocked (FIFO without reader, nvidia unbind with holders): try to kill it and
            # leave whatever survives to the kernel.
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            _ORPHANS.append(pid)
            return {
                "ok": False,
                "errno": None,
                "error": "write to %s did not finish within %gs" % (path, float(timeout)),
                "timed_out": True,
                "duration": time.monotonic() - t0,
            }
        report = b""
        while True:
            chunk = os.read(rfd, 4096)
            if not chunk:
                break
            report += chunk
    finally:
        os.close(rfd)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    code_s, _, msg = report.partition(b" ")
    code = int(code_s or 255)
    return {
        "ok": code == 0,
        "errno": code if code not in (0, 255) else None,
        "error": msg.decode("utf-8", "replace") if code else None,
        "timed_out": False,
        "duration": time.monotonic() - t0,
    }


@op("write_file")
def op_write_file(params):
    if params.get("timeout") is None:
        raise OpError("write_file: timeout is required")
    mode = params.get("mode") or "w"
    if mode not in ("w", "a", "r+"):
        raise OpError("write_file: mode must be w, a or r+")
    return write_file(params["path"], _param_bytes(params), params["timeout"], mode)


def _stat_dict(st):
    import stat as _st

    mode = st.st_mode
    if _st.S_ISLNK(mode):
        kind = "link"
    elif _st.S_ISDIR(mode):
        kind = "dir"
    elif _st.S_ISREG(mode):
        kind = "file"
    elif _st.S_ISFIFO(mode):
        kind = "fifo"
    elif _st.S_ISSOCK(mode):
        kind = "socket"
    elif _st.S_ISCHR(mode):
        kind = "char"
    elif _st.S_ISBLK(mode):
        kind = "block"
    else:
        kind = "other"
    return {
        "type": kind,
        "mode": _st.S_IMODE(mode),
        "size": st.st_size,
        "uid": st.st_uid,
        "gid": st.st_gid,
        "mtime": st.st_mtime,
        "ino": st.st_ino,
        "dev": st.st_dev,
        "nlink": st.st_nlink,
    }


def _per_path(params, fn):
    paths = params.get("paths")
    if paths is None and params.get("path") is not None:
        paths = [params["path"]]
    out = {}
    for path in paths or []:
        try:
            out[path] = fn(path)
        except OSError as exc:
            out[path] = _oserror(exc)
    return out


@op("stat")
def op_stat(params):
    follow = params.get("follow", True)
    return _per_path(params, lambda p: _stat_dict(os.stat(p) if follow else os.lstat(p)))


@op("listdir")
def op_listdir(params):
    return _per_path(params, lambda p: sorted(os.listdir(p)))


@op("readlink")
def op_readlink(params):
    if params.get("resolve"):
        return _per_path(params, os.path.realpath)
    return _per_path(params, lambda p: {"target": os.readlink(p)})


@op("glob")
def op_glob(params):
    patterns = params.get("patterns")
    if patterns is None:
        patterns = [params.get("pattern")]
    out = {}
    for pattern in patterns:
        if not pattern:
            raise OpError("glob: pattern is required")
        out[pattern] = sorted(_glob.glob(pattern, recursive=bool(params.get("recursive"))))
    if "patterns" not in params:
        return out[patterns[0]]
    return out


# ---------------------------------------------------------------- facts, hello, batch


@op("facts")
def op_facts(params):
    names = params.get("names") or sorted(_FACTS)
    fparams = params.get("params") or {}
    out = {}
    for name in names:
        fn = _FACTS.get(name)
        if fn is None:
            out[name] = {"error": "unknown fact %r" % name}
            continue
        try:
            out[name] = fn(fparams)
        except OSError as exc:
            out[name] = {"error": "%s: %s" % (name, exc.strerror or exc), "errno": exc.errno}
        except Exception as exc:
            out[name] = {"error": "%s: %s: %s" % (name, type(exc).__name__, _one_line(exc))}
    return out


@op("hello")
def op_hello(params):
    return {
        "pid": os.getpid(),
        "python": platform.python_version(),
        "uid": os.getuid(),
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "version": AGENT_VERSION,
        "ops": sorted(_OPS),
        "facts": sorted(_FACTS),
    }


@op("batch")
def op_batch(params):
    replies = []
    for req in params.get("requests") or []:
        reply = _dispatch(req, None)
        reply.pop("id", None)
        replies.append(reply)
    return replies


@fact("kernel")
def fact_kernel(params):
    u = os.uname()
    return {"release": u.release, "version": u.version, "machine": u.machine}


@fact("hostname")
def fact_hostname(params):
    return socket.gethostname()


@fact("os_release")
def fact_os_release(params):
    out = {}
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        try:
            text = read_text(path, 65536).decode("utf-8", "replace")
        except OSError:
            continue
        for line in text.splitlines():
            k, sep, v = line.partition("=")
            if sep and k.strip():
                out[k.strip()] = v.strip().strip("\"'")
        break
    return out


# ---------------------------------------------------------------- loop


def _one_line(exc):
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def _dispatch(req, emit):
    rid = req.get("id")
    name = req.get("op")
    fn = _OPS.get(name)
    if fn is None:
        return {"id": rid, "ok": False, "error": "unknown op %r" % (name,), "errno": None}
    try:
        if name in _STREAM_OPS:
            result = fn(req, emit)
        else:
            result = fn(req)
        return {"id": rid, "ok": True, "result": result}
    except OSError as exc:
        msg = "%s: %s" % (name, exc.strerror or _one_line(exc))
        if getattr(exc, "filename", None):
            msg += ": %s" % exc.filename
        return {"id": rid, "ok": False, "error": msg, "errno": exc.errno}
    except OpError as exc:
        return {"id": rid, "ok": False, "error": _one_line(exc), "errno": exc.errno}
    except Exception as exc:
        return {
            "id": rid,
            "ok": False,
            "error": "%s: %s: %s" % (name, type(exc).__name__, _one_line(exc)),
            "errno": None,
        }


def main():
    # Keep the protocol on private descriptors: fd 0 becomes /dev/null and fd 1 goes to stderr,
    # so a child that inherits them (or a probe that prints) cannot corrupt the stream.
    proto_in = os.fdopen(os.dup(0), "rb", 65536)
    proto_out = os.fdopen(os.dup(1), "wb", 0)
    _PROTO_FDS[:] = [proto_in.fileno(), proto_out.fileno()]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)

    def send(obj):
        proto_out.write(json.dumps(obj, separators=(",", ":")).encode("utf-8") + b"\n")

    while True:
        line = proto_in.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line.decode("utf-8"))
        except ValueError as exc:
            send({"id": None, "ok": False, "error": "bad request: %s" % _one_line(exc), "errno": None})
            continue
        rid = req.get("id")

        def emit(chunk, rid=rid):
            send({"id": rid, "chunk": chunk})

        send(_dispatch(req, emit))
        if _ORPHANS:
            _reap_orphans()

"""The `run` operation: a command in its own session, its process group killed at the timeout.

Target side: stdlib only, Python 3.6 syntax (see the package docstring).
"""

import errno
import os
import select
import signal
import subprocess
import time

from pytest_gpuhost.exec.agent.registry import DEFAULT_MAX_OUTPUT, ORPHANS, OpError, b64d, op, text_into

KILL_GRACE = 0.5  # seconds between SIGTERM and SIGKILL of a timed-out process group
EXIT_LINGER = 0.5  # seconds to wait for EOF after the main process exited (background children)


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
            "rc": 127 if exc.errno == errno.ENOENT else 126,
            "stdout": "",
            "stderr": f"{exc.filename or args[0]}: {exc.strerror}\n",
            "timed_out": False,
            "start": start,
            "duration": time.monotonic() - t0,
        }
    stdout, stderr, stdin_pipe = proc.stdout, proc.stderr, proc.stdin
    assert stdout is not None and stderr is not None  # both are PIPE
    out_fd = stdout.fileno()
    err_fd = stderr.fileno()
    bufs = {out_fd: [], err_fd: []}  # type: dict
    names = {out_fd: "stdout", err_fd: "stderr"}
    sizes = {"stdout": 0, "stderr": 0}
    truncated = False
    open_fds = set(bufs)
    wfd = None
    pending = b""
    if stdin_data is not None:
        assert stdin_pipe is not None  # PIPE when there is data
        wfd = stdin_pipe.fileno()
        pending = stdin_data
        os.set_blocking(wfd, False)
        if not pending:
            stdin_pipe.close()
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
            if fd == wfd and stdin_pipe is not None:
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
                        stdin_pipe.close()
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
        ORPHANS.append(proc.pid)
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
    text_into(b"".join(bufs[out_fd]), result, "stdout")
    text_into(b"".join(bufs[err_fd]), result, "stderr")
    if truncated:
        result["truncated"] = True
    return result


def run_recorded(argv, timeout, record, keep=8192):
    """Run `argv` like `run_process`; append a copy for the evidence to `record`, return the result.

    The copy holds argv, rc, duration, timed_out and the first `keep` characters of stdout and
    stderr: enough to show what a probe saw without carrying whole outputs into every report.
    """
    res = run_process(argv=argv, timeout=timeout)
    record.append(
        {
            "argv": list(argv),
            "rc": res["rc"],
            "stdout": res.get("stdout", "")[:keep],
            "stderr": res.get("stderr", "")[:keep],
            "duration": round(res.get("duration", 0.0), 4),
            "timed_out": res.get("timed_out", False),
        }
    )
    return res


@op("run", stream=True)  # streams its output when asked ("stream": true)
def op_run(params, emit=None):
    on_output = None
    if params.get("stream") and emit is not None:

        def on_output(name, data):
            chunk = {"stream": name}
            text_into(data, chunk, "data")
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

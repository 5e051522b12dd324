"""File operations: bounded reads, writes in a forked child under a watchdog, stat, list, glob.

Target side: stdlib only, Python 3.6 syntax (see the package docstring).
"""

import glob
import os
import re
import select
import signal
import stat
import time

from pytest_gpuhost.exec.agent.registry import (
    DEFAULT_MAX_BYTES,
    ORPHANS,
    PROTO_FDS,
    OpError,
    op,
    oserror_dict,
    param_bytes,
    text_into,
)

# The plugin's state on a target (journals, run locks, the health suite's kernel-log cursor) lives
# under one directory: $GPUHOST_STATE_DIR in the agent's environment, else /var/lib/gpuhost. A
# `local://` agent inherits the controller's environment, which is how the plugin's own tests keep
# the machine that runs them clean; on an SSH target the variable is the target's own.
STATE_DIR_ENV = "GPUHOST_STATE_DIR"
DEFAULT_STATE_DIR = "/var/lib/gpuhost"


def state_path(rel=""):
    """Return `rel` under the agent's state directory (an absolute `rel` is returned as is)."""
    if rel.startswith("/"):
        return rel
    base = os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR
    return os.path.join(base, rel) if rel else base


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


_PCI_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def pci_upstream(devices, bdf, bridges, ranges):
    """Return the BDFs of the PCI bridges above `bdf`, nearest first.

    `devices` is sysfs's /sys/bus/pci/devices, where BDF is a link into the device hierarchy:
    one readlink names every bridge on the way. A flat sysfs (plain directories, as in the lab
    and some containers) falls back to the bridges whose secondary..subordinate bus range holds
    the device's bus, narrowest first; `ranges` caches those per bridge (None: unreadable), so
    each is read once for all devices. `bridges` is the set of bridge BDFs, or a function that
    returns it (called only for a flat sysfs).
    """
    try:
        link = os.readlink(os.path.join(devices, bdf))
    except OSError:
        link = ""
    parts = [p for p in link.split("/") if _PCI_BDF.match(p)]
    if len(parts) > 1 and parts[-1] == bdf:
        return list(reversed(parts[:-1]))
    if callable(bridges):
        bridges = bridges()
    out = []
    dom, bus = bdf[:4], int(bdf[5:7], 16)
    for b in sorted(bridges):
        if b == bdf or b[:4] != dom:
            continue
        if b not in ranges:
            lo = read_str(os.path.join(devices, b, "secondary_bus_number"))
            hi = read_str(os.path.join(devices, b, "subordinate_bus_number"))
            try:
                ranges[b] = (int(lo or ""), int(hi or ""))
            except ValueError:
                ranges[b] = None
        r = ranges[b]
        if r is not None and r[0] <= bus <= r[1]:
            out.append((r[1] - r[0], b))
    return [b for _, b in sorted(out)]


@op("read_files")
def op_read_files(params):
    max_bytes = int(params.get("max_bytes") or DEFAULT_MAX_BYTES)
    out = {}
    for path in params.get("paths") or []:
        try:
            entry = {}  # type: dict
            text_into(read_text(path, max_bytes), entry, "data")
            out[path] = entry
        except OSError as exc:
            out[path] = oserror_dict(exc)
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
            for fd in PROTO_FDS:
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
            ORPHANS.append(pid)
            return {
                "ok": False,
                "errno": None,
                "error": f"write to {path} did not finish within {float(timeout):g}s",
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
    return write_file(params["path"], param_bytes(params), params["timeout"], mode)


def _stat_dict(st):
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        kind = "link"
    elif stat.S_ISDIR(mode):
        kind = "dir"
    elif stat.S_ISREG(mode):
        kind = "file"
    elif stat.S_ISFIFO(mode):
        kind = "fifo"
    elif stat.S_ISSOCK(mode):
        kind = "socket"
    elif stat.S_ISCHR(mode):
        kind = "char"
    elif stat.S_ISBLK(mode):
        kind = "block"
    else:
        kind = "other"
    return {
        "type": kind,
        "mode": stat.S_IMODE(mode),
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
            out[path] = oserror_dict(exc)
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
        out[pattern] = sorted(glob.glob(pattern, recursive=bool(params.get("recursive"))))
    if "patterns" not in params:
        return out[patterns[0]]
    return out

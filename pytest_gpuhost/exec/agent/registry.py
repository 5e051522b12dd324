"""The agent's registry of operations and facts, the reply encoding, and one request's dispatch.

First of the core files (see `CORE_FILES` in the package): every other core file and every
probe builds on the names defined here.  Target side: stdlib only, Python 3.6 syntax.
"""

import base64
import os

AGENT_VERSION = 1
DEFAULT_MAX_OUTPUT = 64 * 1024 * 1024
DEFAULT_MAX_BYTES = 4 * 1024 * 1024

OPS = {}  # type: dict
STREAM_OPS = set()  # type: set
FACTS = {}  # type: dict
UNAVAILABLE = {}  # type: dict  # probe -> why it is not loaded (a module this Python lacks)
ORPHANS = []  # type: list  # pids of children left to the kernel; reaped when they finish
PROTO_FDS = []  # type: list  # the protocol's descriptors; a forked writer closes them at once


class OpError(Exception):
    """A request failed; the message is one line for the operator."""

    def __init__(self, message, errno=None):
        Exception.__init__(self, message)
        self.errno = errno


def op(name, stream=False):
    """Register `handler(params)` as operation `name`; a stream op is `handler(params, emit)`."""

    def deco(fn):
        OPS[name] = fn
        if stream:
            STREAM_OPS.add(name)
        else:
            STREAM_OPS.discard(name)
        return fn

    return deco


def fact(name):
    """Register `handler(params)` as fact `name` of the `facts` op."""

    def deco(fn):
        FACTS[name] = fn
        return fn

    return deco


def b64e(data):
    return base64.b64encode(data).decode("ascii")


def b64d(text):
    return base64.b64decode(text.encode("ascii"))


def text_into(data, out, key):
    """Store bytes as text under `key`, adding `key_b64` when they are not UTF-8."""
    try:
        out[key] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[key] = data.decode("utf-8", "replace")
        out[key + "_b64"] = b64e(data)


def param_bytes(params, key="data"):
    """Return a request's payload: `b64` when given, else `key` as UTF-8."""
    if params.get("b64") is not None:
        return b64d(params["b64"])
    data = params.get(key, "")
    if isinstance(data, str):
        return data.encode("utf-8")
    return bytes(data)


def oserror_dict(exc):
    return {"errno": exc.errno, "error": exc.strerror or str(exc)}


def one_line(exc):
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def reap_orphans():
    for pid in list(ORPHANS):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            ORPHANS.remove(pid)


def dispatch(req, emit):
    """Run one request; return its reply (an error reply for any failure of the handler)."""
    rid = req.get("id")
    name = req.get("op")
    fn = OPS.get(name)
    if fn is None:
        return {"id": rid, "ok": False, "error": f"unknown op {name!r}", "errno": None}
    try:
        if name in STREAM_OPS:
            result = fn(req, emit)
        else:
            result = fn(req)
        return {"id": rid, "ok": True, "result": result}
    except OSError as exc:
        msg = f"{name}: {exc.strerror or one_line(exc)}"
        if getattr(exc, "filename", None):
            msg += f": {exc.filename}"
        return {"id": rid, "ok": False, "error": msg, "errno": exc.errno}
    except OpError as exc:
        return {"id": rid, "ok": False, "error": one_line(exc), "errno": exc.errno}
    except Exception as exc:
        return {
            "id": rid,
            "ok": False,
            "error": f"{name}: {type(exc).__name__}: {one_line(exc)}",
            "errno": None,
        }

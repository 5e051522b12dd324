"""The `facts`, `hello` and `batch` operations, and the facts every host has.

Target side: stdlib only, Python 3.6 syntax (see the package docstring).
"""

import os
import platform
import socket
import sys

from pytest_gpuhost.exec.agent.files import read_text, state_path
from pytest_gpuhost.exec.agent.registry import (
    AGENT_VERSION,
    FACTS,
    OPS,
    UNAVAILABLE,
    OpError,
    dispatch,
    fact,
    one_line,
    op,
)


@op("facts")
def op_facts(params):
    names = params.get("names") or sorted(FACTS)
    fparams = params.get("params") or {}
    out = {}  # type: dict
    for name in names:
        fn = FACTS.get(name)
        if fn is None:
            out[name] = {"error": f"unknown fact {name!r}"}
            continue
        try:
            out[name] = fn(fparams)
        except OSError as exc:
            out[name] = {"error": f"{name}: {exc.strerror or exc}", "errno": exc.errno}
        except OpError as exc:
            out[name] = {"error": one_line(exc)}
        except Exception as exc:
            out[name] = {"error": f"{name}: {type(exc).__name__}: {one_line(exc)}"}
    return out


@op("hello")
def op_hello(params):
    return {
        "pid": os.getpid(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "uid": os.getuid(),
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "version": AGENT_VERSION,
        "ops": sorted(OPS),
        "facts": sorted(FACTS),
        "unavailable": dict(UNAVAILABLE),
        "state_dir": state_path(),
        "machine_id": _machine_id(),
        "host_key": _host_key(),
    }


def _host_key():
    """SHA-256 (hex, 32 digits) of the node's SSH host public keys, "" when it has none.

    A second name of the machine beside machine-id: two machines cloned from one image share
    /etc/machine-id, and differ here once their host keys were made anew on first boot.
    """
    import glob
    import hashlib

    h = hashlib.sha256()
    found = False
    for path in sorted(glob.glob("/etc/ssh/ssh_host_*_key.pub")):
        try:
            with open(path, "rb") as f:
                fields = f.read(16384).split()
        except OSError:
            continue
        if len(fields) >= 2:  # "TYPE BASE64 [comment]": the comment is not the key
            h.update(fields[0] + b" " + fields[1] + b"\n")
            found = True
    return h.hexdigest()[:32] if found else ""


def _machine_id():
    """The node's machine-id(5) ("" when it has none): it names the machine, not the boot."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                value = f.read(64).strip()
        except OSError:
            continue
        if value:
            return value
    return ""


@op("batch")
def op_batch(params):
    replies = []
    for req in params.get("requests") or []:
        reply = dispatch(req, None)
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

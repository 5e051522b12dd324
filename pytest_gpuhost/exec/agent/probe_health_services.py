"""Agent probe: the `health_services` fact, the inference service's unit state and health endpoint.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py).  Read-only:
`systemctl show` per unit, and one GET of the first unit's loopback health URL.

On a node without systemd (a container whose PID 1 is `sleep infinity`, tini or supervisord)
systemctl is missing or answers "System has not been booted with systemd as init system": the
entry says `missing` (`systemctl`, or `systemd` where /run/systemd/system is absent, the test
sd_booted(3) makes), so the verdict can say it cannot see rather than fail the node.
"""

import os
import re
import socket
import time

from pytest_gpuhost.exec.agent.core import fact, run_recorded

SHOW = "LoadState,ActiveState,SubState,MainPID,Result,NRestarts"
_LOCAL_URL = re.compile(r"^http://(127\.0\.0\.1|localhost|\[::1\])(?::(\d{1,5}))?(/\S*)$")


def http_get(url, timeout):
    """GET a loopback health URL (HTTP/1.0, first 512 bytes of the body).

    A plain socket rather than urllib: urllib.request and what it imports (http.client, email,
    ssl) cost the agent ~20 ms of start-up on every host, and only http://loopback is allowed.
    """
    t0 = time.monotonic()
    out = {"url": url, "status": None, "error": None, "body": None}  # type: dict
    m = _LOCAL_URL.match(url)
    if not m:
        out["error"] = "refusing a non-local health URL"
        return out
    host, port, path = m.group(1), int(m.group(2) or 80), m.group(3)
    addr = "::1" if host == "[::1]" else host
    netloc = host if port == 80 else f"{host}:{port}"
    request = (
        f"GET {path} HTTP/1.0\r\nHost: {netloc}\r\nUser-Agent: pytest-gpuhost\r\nConnection: close\r\n\r\n"
    )
    try:
        with socket.create_connection((addr, port), timeout=timeout) as sock:
            sock.sendall(request.encode("ascii", "replace"))
            data = b""
            while True:
                head, sep, body = data.partition(b"\r\n\r\n")
                if (sep and len(body) >= 512) or len(data) > 65536:
                    break
                chunk = sock.recv(8192)
                if not chunk:
                    break
                data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].decode("latin-1").split(None, 2)
        if not sep or len(status) < 2 or not status[0].startswith("HTTP/") or not status[1].isdigit():
            out["error"] = f"not an HTTP response: {data[:60]!r}"
        else:
            out["status"] = int(status[1])
            out["body"] = body[:512].decode("utf-8", "replace")
            if out["status"] >= 400:
                out["error"] = "HTTP {} {}".format(out["status"], status[2] if len(status) > 2 else "")
    except socket.timeout:  # noqa: UP041 - TimeoutError is its alias only from Python 3.10 (targets may be older)
        out["error"] = f"timeout: no answer within {timeout:g}s"
    except OSError as exc:
        out["error"] = "{}: {}".format(type(exc).__name__, " ".join(str(exc).split()) or type(exc).__name__)
    out["duration"] = round(time.monotonic() - t0, 4)
    return out


def systemd_missing(res):
    """Return what a failed systemctl run lacked ("systemctl", "systemd"), or None.

    sd_booted(3): a system booted with systemd has the directory /run/systemd/system.
    """
    if res["rc"] == 127:
        return "systemctl"
    if res["rc"] != 0 and not os.path.isdir("/run/systemd/system"):
        return "systemd"
    return None


def _show(unit, timeout, record):
    argv = ["systemctl", "show", "-p", SHOW, "--", unit]
    res = run_recorded(argv, timeout, record)
    return res


@fact("health_services")
def fact_health_services(params):
    """Return each unit's `systemctl show` properties; with a `url`, its health GET too."""
    timeout = float(params.get("timeout", 20))
    out = {}
    record = []  # type: list
    for svc in params.get("services") or []:
        unit = svc["unit"]
        res = _show(unit, timeout, record)
        entry = {"unit": unit, "show": {}, "error": None, "health": None}  # type: dict
        if res["timed_out"]:
            entry["error"] = "systemctl show timed out"
        elif res["rc"] == 127:
            entry["error"] = "systemctl show: command not found"
        elif res["rc"] != 0:
            err = (res.get("stderr") or res.get("stdout") or "").strip().splitlines()
            entry["error"] = f"systemctl show exited {res['rc']}" + (": " + err[-1] if err else "")
        if not res["timed_out"]:
            missing = systemd_missing(res)
            if missing:
                entry["missing"] = missing
        for line in res["stdout"].splitlines():
            k, sep, v = line.partition("=")
            if sep:
                entry["show"][k] = v
        if svc.get("url"):
            entry["health"] = http_get(svc["url"], float(svc.get("timeout", 3)))
        out[unit] = entry
    return {"ok": True, "services": out, "commands": record}

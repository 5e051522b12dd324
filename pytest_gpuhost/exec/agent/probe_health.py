# Agent probe: the `health` fact, everything suites/health judges, gathered in one request.
#
# Concatenated into the agent (stdlib only, no __future__ imports, Python 3.6 syntax).  The
# parts run in parallel threads, each command under its own timeout, so one request costs the
# slowest part, not the sum.  Nothing here changes the host except `health_commit`, which
# records the kernel-log cursor in /var/lib/gpuhost/health-state.json after a successful run.
# Targets may run Python 3.6: %-formatting and zip() without strict= are deliberate.
# ruff: noqa: UP031, B905, F821
import calendar
import hashlib
import json
import os
import re
import socket
import threading
import time

if "fact" not in globals():  # imported on its own (tests, linters): registration is a no-op

    def fact(name):
        def register(func):
            return func

        return register

    def op(name, stream=False):
        def register(func):
            return func

        return register


HL_STATE_PATH = "/var/lib/gpuhost/health-state.json"
HL_PARTS = ("gpus", "smi", "nvlink", "p2p", "kernel_log", "pci", "disk", "services")
HL_QUERY_FIELDS = (
    "index",
    "pci.bus_id",
    "name",
    "uuid",
    "driver_version",
    "persistence_mode",
    "temperature.gpu",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.failure",
    "clocks_throttle_reasons.active",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
)
_HL_BAD_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query')
_HL_ISO = re.compile(r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:[,.](\d+))?(Z|[+-]\d\d:?\d\d)?\s+(.*)$")
_HL_RAW = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\]\s?(.*)$")
_HL_XID = re.compile(r"\bXid \(PCI:([0-9A-Fa-f:.]+)\):\s*(\d+)\b,?\s*(.*)$")
_HL_SXID = re.compile(r"\bSXid \(PCI:([0-9A-Fa-f:.]+)\):\s*(\d+)\b,?\s*(.*)$")
_HL_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HL_CMD_KEEP = 8192  # bytes of each command's output kept in the evidence


def _hl_cmd(argv, timeout, record):
    """Run argv with the agent's hardened runner; keep a trimmed copy for the evidence."""
    res = run_process(argv=argv, timeout=timeout)  # defined by the agent core
    record.append(
        {
            "argv": list(argv),
            "rc": res["rc"],
            "stdout": res.get("stdout", "")[:_HL_CMD_KEEP],
            "stderr": res.get("stderr", "")[:_HL_CMD_KEEP],
            "duration": round(res.get("duration", 0.0), 4),
            "timed_out": res.get("timed_out", False),
        }
    )
    return res


def _hl_cmd_error(res, what):
    if res["timed_out"]:
        return "%s timed out" % what
    if res["rc"] == 127:
        return "%s: command not found" % what
    err = (res.get("stderr") or res.get("stdout") or "").strip().splitlines()
    return "%s exited %d%s" % (what, res["rc"], (": " + err[-1]) if err else "")


def _hl_num(text):
    """Parse a nvidia-smi csv cell: int, float, Yes/No as 1/0, or None for N/A."""
    t = text.strip()
    if not t or t.startswith("[") or t in ("N/A", "Unknown"):
        return None
    if t in ("Yes", "Enabled"):
        return 1
    if t in ("No", "Disabled"):
        return 0
    try:
        return int(t, 0) if t.startswith("0x") else int(t)
    except ValueError:
        try:
            return float(t)
        except ValueError:
            return t


# ---------------------------------------------------------------- nvidia-smi


def _hl_gpus(params, record):
    timeout = float(params.get("timeout", 20))
    fields = list(params.get("query_fields") or HL_QUERY_FIELDS)
    dropped = []
    for _ in range(len(fields)):
        res = _hl_cmd(
            ["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"],
            timeout,
            record,
        )
        bad = _HL_BAD_FIELD.search(res.get("stdout", "") + res.get("stderr", ""))
        if res["rc"] != 0 and bad and bad.group(1) in fields and bad.group(1) not in ("index", "pci.bus_id"):
            # Older or newer drivers lack some fields (clocks_throttle_reasons became
            # clocks_event_reasons): drop the field and ask again, still in this request.
            fields.remove(bad.group(1))
            dropped.append(bad.group(1))
            continue
        break
    if res["rc"] != 0:
        return {
            "ok": False,
            "error": _hl_cmd_error(res, "nvidia-smi --query-gpu"),
            "gpus": [],
            "dropped": dropped,
        }
    gpus = []
    for line in res["stdout"].splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        row = {"raw": {}}
        for key, cell in zip(fields, cells):
            row["raw"][key] = cell
        bus = row["raw"].get("pci.bus_id", "")
        row["bdf"] = _hl_short_bdf(bus)
        for key, cell in row["raw"].items():
            if key not in ("pci.bus_id", "name", "uuid", "driver_version"):
                row[key] = _hl_num(cell)
        row["name"] = row["raw"].get("name")
        row["uuid"] = row["raw"].get("uuid")
        row["driver_version"] = row["raw"].get("driver_version")
        gpus.append(row)
    return {"ok": True, "gpus": gpus, "dropped": dropped}


def _hl_short_bdf(bus):
    """Turn nvidia-smi's 00000000:17:00.0 into sysfs's 0000:17:00.0."""
    bus = bus.strip().lower()
    m = re.match(r"^([0-9a-f]+):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$", bus)
    if not m:
        return bus
    return "%04x:%s:%s.%s" % (int(m.group(1), 16) & 0xFFFF, m.group(2), m.group(3), m.group(4))


def _hl_smi(params, record, driver=None):
    """CUDA and driver version from nvidia-smi's header.

    The CUDA version is a property of the installed driver, so it is kept in the health state
    (written by health_commit) keyed by the driver version: with `driver` (the version the
    `gpus` part just read) equal to the cached one, nvidia-smi is not started again.
    """
    if driver and not params.get("no_cache"):
        state, _ = _hl_state(params)
        cached = (state or {}).get("cuda")
        if isinstance(cached, dict) and cached.get("driver_version") == driver and cached.get("cuda_version"):
            return {
                "ok": True,
                "cuda_version": cached["cuda_version"],
                "driver_version": driver,
                "cached": {
                    "driver_version": driver,
                    "cuda_version": cached["cuda_version"],
                    "at": cached.get("at"),
                },
            }
    res = _hl_cmd(["nvidia-smi"], float(params.get("timeout", 20)), record)
    if res["rc"] != 0:
        return {"ok": False, "error": _hl_cmd_error(res, "nvidia-smi")}
    out = {"ok": True, "cuda_version": None, "driver_version": None}
    m = re.search(r"CUDA Version:\s*([0-9.]+)", res["stdout"])
    if m:
        out["cuda_version"] = m.group(1)
    m = re.search(r"Driver Version:\s*([0-9.]+)", res["stdout"])
    if m:
        out["driver_version"] = m.group(1)
    return out


def _hl_nvlink(params, record):
    res = _hl_cmd(["nvidia-smi", "nvlink", "-s"], float(params.get("timeout", 20)), record)
    if res["rc"] != 0 and not res["stdout"].strip():
        return {"ok": False, "error": _hl_cmd_error(res, "nvidia-smi nvlink -s")}
    gpus = {}
    current = None
    for line in res["stdout"].splitlines():
        m = re.match(r"^GPU (\d+):", line.strip())
        if m:
            current = {"links": {}}
            gpus[m.group(1)] = current
            continue
        m = re.match(r"^Link (\d+):\s*(.*)$", line.strip())
        if m and current is not None:
            state = m.group(2).strip()
            speed = re.match(r"^([0-9.]+)\s*GB/s", state)
            current["links"][m.group(1)] = {
                "up": bool(speed) and float(speed.group(1)) > 0,
                "gbps": float(speed.group(1)) if speed else None,
                "text": state,
            }
    return {"ok": True, "gpus": gpus}


def _hl_p2p(params, record):
    res = _hl_cmd(["nvidia-smi", "topo", "-p2p", "r"], float(params.get("timeout", 20)), record)
    if res["rc"] != 0:
        return {"ok": False, "error": _hl_cmd_error(res, "nvidia-smi topo -p2p r")}
    labels = []
    rows = []
    for line in res["stdout"].splitlines():
        cells = line.split()
        if not cells:
            if labels:
                break
            continue
        if not labels:
            if all(c.startswith("GPU") for c in cells):
                labels = cells
            continue
        if cells[0] in labels:
            rows.append(cells[1 : 1 + len(labels)])
    return {"ok": bool(labels), "labels": labels, "matrix": rows, "error": None if labels else "no matrix"}


# ---------------------------------------------------------------- kernel log


def _hl_iso_epoch(m):
    year, mon, day, hh, mm, ss = (int(m.group(i)) for i in range(1, 7))
    frac = float("0." + m.group(7)) if m.group(7) else 0.0
    epoch = calendar.timegm((year, mon, day, hh, mm, ss, 0, 0, 0)) + frac
    tz = m.group(8)
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        epoch -= sign * (int(digits[:2]) * 3600 + int(digits[2:4]) * 60)
    return epoch


def _hl_btime():
    try:
        for line in read_text("/proc/stat", 1 << 20).decode("ascii", "replace").splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def _hl_state(params):
    """The health state file as (state, error): read once per gather (see _hl_gather), shared
    by the kernel-log part (the cursor) and the smi part (the cached CUDA version)."""
    got = params.get("_state")
    if got is None:
        got = _hl_read_state(params.get("state_path") or HL_STATE_PATH)
    return got


def _hl_read_state(path):
    try:
        data = read_text(path, 1 << 20)
    except OSError as exc:
        return None, (None if exc.errno == 2 else "%s: %s" % (path, exc.strerror))
    try:
        state = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        return None, "%s: not JSON (%s); treating as first run" % (path, exc)
    if not isinstance(state, dict):
        return None, "%s: not an object; treating as first run" % path
    return state, None


def _hl_line_key(ts, msg):
    return hashlib.sha1(("%.6f %s" % (ts, msg)).encode("utf-8", "replace")).hexdigest()[:16]


def _hl_kernel_log(params, record):
    timeout = float(params.get("timeout", 20))
    path = params.get("state_path") or HL_STATE_PATH
    state, state_error = _hl_state(params)
    lines = []
    res = _hl_cmd(["dmesg", "--time-format", "iso"], timeout, record)
    mode = "iso"
    if res["rc"] != 0:
        res = _hl_cmd(["dmesg"], timeout, record)
        mode = "raw"
    if res["rc"] != 0:
        return {"ok": False, "error": _hl_cmd_error(res, "dmesg"), "state_path": path}
    btime = _hl_btime() if mode == "raw" else None
    for text in res["stdout"].splitlines():
        ts = None
        msg = text
        if mode == "iso":
            m = _HL_ISO.match(text)
            if m:
                ts, msg = _hl_iso_epoch(m), m.group(9)
        else:
            m = _HL_RAW.match(text)
            if m:
                ts, msg = float(m.group(1)) + (btime or 0.0), m.group(2)
        if ts is None:
            continue  # continuation lines carry no timestamp; Xid lines always have one
        lines.append((ts, msg))
    since = None
    seen = set()
    if state is not None:
        since = state.get("last_ts")
        seen = set(state.get("seen_at_last") or [])
    new = []
    for ts, msg in lines:
        if since is not None and (ts < since or (ts == since and _hl_line_key(ts, msg) in seen)):
            continue
        new.append((ts, msg))
    xid, sxid = [], []
    for ts, msg in new:
        m = _HL_SXID.search(msg)
        if m:
            sxid.append({"ts": ts, "bdf": m.group(1).lower(), "code": int(m.group(2)), "msg": msg})
            continue
        m = _HL_XID.search(msg)
        if m:
            xid.append({"ts": ts, "bdf": m.group(1).lower(), "code": int(m.group(2)), "msg": msg})
    last_ts = max([ts for ts, _ in lines] + ([since] if since is not None else []) or [0.0])
    at_last = sorted(_hl_line_key(ts, msg) for ts, msg in lines if ts == last_ts)
    if since is not None and last_ts == since:
        at_last = sorted(set(at_last) | seen)
    return {
        "ok": True,
        "mode": mode,
        "first_run": state is None,
        "since": since,
        "state_path": path,
        "state_error": state_error,
        "lines_total": len(lines),
        "lines_new": len(new),
        "xid": xid,
        "sxid": sxid,
        "cursor": {
            "version": 1,
            "last_ts": last_ts,
            "seen_at_last": at_last,
            "boot_id": _hl_boot_id(),
        },
    }


def _hl_boot_id():
    try:
        return read_text("/proc/sys/kernel/random/boot_id", 256).decode("ascii").strip()
    except OSError:
        return None


# ---------------------------------------------------------------- PCI, IOMMU, ACS

_HL_SYS_PCI = "/sys/bus/pci/devices"
_HL_ACS_BITS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans")


def _hl_read(path):
    try:
        return read_text(path, 65536).decode("ascii", "replace").strip()
    except OSError:
        return None


def _hl_link_name(path):
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def _hl_acs_from_config(bdf):
    """Return the ACS control bits from config space, None when it cannot be read in full."""
    try:
        data = read_text(os.path.join(_HL_SYS_PCI, bdf, "config"), 4096)
    except OSError:
        return None
    if len(data) < 0x104:
        return None  # only root sees extended config space
    off = 0x100
    for _ in range(64):
        if off < 0x100 or off + 8 > len(data):
            break
        header = int.from_bytes(data[off : off + 4], "little")
        if header in (0, 0xFFFFFFFF):
            break
        cap_id = header & 0xFFFF
        if cap_id == 0x000D:
            ctl = int.from_bytes(data[off + 6 : off + 8], "little")
            return {
                "source": "config",
                "present": True,
                "ctl": {n: bool(ctl >> i & 1) for i, n in enumerate(_HL_ACS_BITS)},
            }
        off = header >> 20
        if off == 0:
            break
    return {"source": "config", "present": False, "ctl": {}}


def _hl_acs_from_lspci(bdf, timeout, record):
    res = _hl_cmd(["lspci", "-vvv", "-s", bdf], timeout, record)
    if res["rc"] != 0 or not res["stdout"].strip():
        return None
    out = res["stdout"]
    m = re.search(r"ACSCtl:\s*(.*)", out)
    if m:
        ctl = {}
        for tok in m.group(1).split():
            if tok[-1:] in "+-" and tok[:-1] in _HL_ACS_BITS:
                ctl[tok[:-1]] = tok[-1] == "+"
        return {"source": "lspci", "present": True, "ctl": ctl}
    if "<access denied>" in out:
        return None
    if re.search(r"Capabilities: \[[1-9a-f][0-9a-f]{2} v", out):
        return {"source": "lspci", "present": False, "ctl": {}}  # extended caps listed, no ACS
    return None


def _hl_upstream(bdf, bridges, ranges):
    """Return the BDFs of the bridges above `bdf`, nearest first.

    sysfs's /sys/bus/pci/devices/BDF is a link into the device hierarchy: one readlink gives
    every bridge on the way. A flat sysfs (plain directories, as in some containers) falls back
    to the bridges whose secondary..subordinate bus range holds the device's bus; `ranges`
    caches those per bridge, so each is read once for all GPUs.
    """
    try:
        link = os.readlink(os.path.join(_HL_SYS_PCI, bdf))
    except OSError:
        link = ""
    parts = [p for p in link.split("/") if _HL_BDF.match(p)]
    if len(parts) > 1 and parts[-1] == bdf:
        return list(reversed(parts[:-1]))
    out = []
    dom, bus = bdf[:4], int(bdf[5:7], 16)
    for b in sorted(bridges):
        if b == bdf or b[:4] != dom:
            continue
        if b not in ranges:
            lo = _hl_read(os.path.join(_HL_SYS_PCI, b, "secondary_bus_number"))
            hi = _hl_read(os.path.join(_HL_SYS_PCI, b, "subordinate_bus_number"))
            try:
                ranges[b] = (int(lo), int(hi))
            except (TypeError, ValueError):
                ranges[b] = None
        r = ranges[b]
        if r is not None and r[0] <= bus <= r[1]:
            out.append((r[1] - r[0], b))
    return [b for _, b in sorted(out)]


def _hl_ids(base):
    """Return (class, vendor, driver) of a PCI device: one read of `uevent` where it exists."""
    text = _hl_read(os.path.join(base, "uevent"))
    if text:
        ev = dict(line.partition("=")[::2] for line in text.splitlines())
        try:
            cls = "0x%06x" % int(ev.get("PCI_CLASS", ""), 16)
            vendor = "0x%s" % ev["PCI_ID"].split(":")[0].lower()
            return cls, vendor, ev.get("DRIVER") or None
        except (KeyError, ValueError):
            pass
    return (
        _hl_read(os.path.join(base, "class")) or "",
        _hl_read(os.path.join(base, "vendor")),
        _hl_link_name(os.path.join(base, "driver")),
    )


def _hl_pci(params, record):
    timeout = float(params.get("timeout", 20))
    try:
        all_bdfs = sorted(os.listdir(_HL_SYS_PCI))
    except OSError as exc:
        return {"ok": False, "error": "%s: %s" % (_HL_SYS_PCI, exc.strerror), "devices": {}}
    ids = {b: _hl_ids(os.path.join(_HL_SYS_PCI, b)) for b in all_bdfs}
    bridges = set(b for b in all_bdfs if ids[b][0].startswith("0x0604"))
    devices = {}
    acs_cache = {}
    ranges = {}
    for b in all_bdfs:
        base = os.path.join(_HL_SYS_PCI, b)
        cls, vendor, driver = ids[b]
        if vendor != "0x10de" or cls[:6] not in ("0x0300", "0x0302"):
            continue
        group = _hl_link_name(os.path.join(base, "iommu_group"))
        dev = {
            "driver": driver,
            "class": cls,
            "iommu_group": group,
            "iommu_type": _hl_read("/sys/kernel/iommu_groups/%s/type" % group) if group else None,
            "link": {
                "speed": _hl_read(os.path.join(base, "current_link_speed")),
                "width": _hl_read(os.path.join(base, "current_link_width")),
                "max_speed": _hl_read(os.path.join(base, "max_link_speed")),
                "max_width": _hl_read(os.path.join(base, "max_link_width")),
            },
            "bridges": [],
        }
        for up in _hl_upstream(b, bridges, ranges):
            if up not in acs_cache:
                acs = _hl_acs_from_config(up)
                if acs is None:
                    acs = _hl_acs_from_lspci(up, timeout, record)
                acs_cache[up] = acs or {"source": "unknown", "present": None, "ctl": {}}
            dev["bridges"].append({"bdf": up, "acs": acs_cache[up]})
        devices[b] = dev
    return {"ok": True, "devices": devices, "iommu_groups_present": os.path.isdir("/sys/kernel/iommu_groups")}


# ---------------------------------------------------------------- disk, services


def _hl_disk(params, record):
    out = {}
    for path in params.get("data_paths") or ["/"]:
        try:
            st = os.statvfs(path)
        except OSError as exc:
            out[path] = {"error": "%s: %s" % (path, exc.strerror), "errno": exc.errno}
            continue
        out[path] = {
            "total": st.f_blocks * st.f_frsize,
            "free": st.f_bfree * st.f_frsize,
            "avail": st.f_bavail * st.f_frsize,
        }
    return {"ok": True, "paths": out}


_HL_LOCAL_URL = re.compile(r"^http://(127\.0\.0\.1|localhost|\[::1\])(?::(\d{1,5}))?(/\S*)$")


def _hl_http(url, timeout):
    """GET a loopback health URL (HTTP/1.0, first 512 bytes of the body).

    A plain socket rather than urllib: urllib.request and what it imports (http.client, email,
    ssl) cost the agent ~20 ms of start-up on every host, and only http://loopback is allowed.
    """
    t0 = time.monotonic()
    out = {"url": url, "status": None, "error": None, "body": None}
    m = _HL_LOCAL_URL.match(url)
    if not m:
        out["error"] = "refusing a non-local health URL"
        return out
    host, port, path = m.group(1), int(m.group(2) or 80), m.group(3)
    addr = "::1" if host == "[::1]" else host
    try:
        with socket.create_connection((addr, port), timeout=timeout) as sock:
            sock.sendall(
                (
                    "GET %s HTTP/1.0\r\nHost: %s\r\nUser-Agent: pytest-gpuhost\r\nConnection: close\r\n\r\n"
                    % (path, host if port == 80 else "%s:%d" % (host, port))
                ).encode("ascii", "replace")
            )
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
            out["error"] = "not an HTTP response: %r" % data[:60]
        else:
            out["status"] = int(status[1])
            out["body"] = body[:512].decode("utf-8", "replace")
            if out["status"] >= 400:
                out["error"] = "HTTP %d %s" % (out["status"], status[2] if len(status) > 2 else "")
    except socket.timeout:  # noqa: UP041 - TimeoutError is its alias only from Python 3.10 (targets may be older)
        out["error"] = "timeout: no answer within %gs" % timeout
    except OSError as exc:
        out["error"] = "%s: %s" % (type(exc).__name__, " ".join(str(exc).split()) or type(exc).__name__)
    out["duration"] = round(time.monotonic() - t0, 4)
    return out


def _hl_services(params, record):
    timeout = float(params.get("timeout", 20))
    out = {}
    for svc in params.get("services") or []:
        unit = svc["unit"]
        res = _hl_cmd(
            [
                "systemctl",
                "show",
                "-p",
                "LoadState,ActiveState,SubState,MainPID,Result,NRestarts",
                "--",
                unit,
            ],
            timeout,
            record,
        )
        entry = {"unit": unit, "show": {}, "error": None, "health": None}
        if res["rc"] != 0:
            entry["error"] = _hl_cmd_error(res, "systemctl show")
        for line in res["stdout"].splitlines():
            k, sep, v = line.partition("=")
            if sep:
                entry["show"][k] = v
        if svc.get("url"):
            entry["health"] = _hl_http(svc["url"], float(svc.get("timeout", 3)))
        out[unit] = entry
    return {"ok": True, "services": out}


_HL_FUNCS = {
    "gpus": _hl_gpus,
    "smi": _hl_smi,
    "nvlink": _hl_nvlink,
    "p2p": _hl_p2p,
    "kernel_log": _hl_kernel_log,
    "pci": _hl_pci,
    "disk": _hl_disk,
    "services": _hl_services,
}


def _hl_gather(params, parts):
    results = {}
    records = {}
    if "kernel_log" in parts or "smi" in parts:
        params = dict(params, _state=_hl_read_state(params.get("state_path") or HL_STATE_PATH))

    def work(name):
        rec = []
        records[name] = rec
        try:
            results[name] = _HL_FUNCS[name](params, rec)
        except Exception as exc:
            results[name] = {
                "ok": False,
                "error": "%s: %s" % (type(exc).__name__, " ".join(str(exc).split())),
            }

    def gpus_then_smi():
        # smi after gpus, in one thread: the driver version just read says whether the cached
        # CUDA version still holds (one nvidia-smi start fewer per run)
        work("gpus")
        rec = []
        records["smi"] = rec
        gpus = (results.get("gpus") or {}).get("gpus") or []
        drivers = sorted({g.get("driver_version") for g in gpus if g.get("driver_version")})
        try:
            results["smi"] = _hl_smi(params, rec, drivers[0] if len(drivers) == 1 else None)
        except Exception as exc:
            results["smi"] = {
                "ok": False,
                "error": "%s: %s" % (type(exc).__name__, " ".join(str(exc).split())),
            }

    jobs = [(n, work, (n,)) for n in parts if n != "smi" or "gpus" not in parts]
    if "gpus" in parts and "smi" in parts:
        jobs = [(n, f, a) for n, f, a in jobs if n != "gpus"] + [("gpus", gpus_then_smi, ())]
    threads = [threading.Thread(target=f, args=a) for _, f, a in jobs]
    names = [n for n, _, _ in jobs]
    for t in threads:
        t.daemon = True
        t.start()
    # Every command inside has its own timeout; this bound only guards against a probe bug.
    deadline = time.monotonic() + float(params.get("timeout", 20)) * 3 + 5
    for t, name in zip(threads, names):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            for n in (name, "smi") if name == "gpus" and "smi" in parts else (name,):
                results[n] = {"ok": False, "error": "%s: probe did not finish in time" % n}
    results["commands"] = [c for n in parts for c in list(records.get(n, []))]
    smi = results.get("smi") or {}
    cursor = (results.get("kernel_log") or {}).get("cursor")
    if isinstance(cursor, dict) and smi.get("ok") and smi.get("cuda_version") and smi.get("driver_version"):
        # committed with the kernel-log cursor, for the next run's _hl_smi
        cursor["cuda"] = smi.get("cached") or {
            "driver_version": smi["driver_version"],
            "cuda_version": smi["cuda_version"],
            "at": time.time(),
        }
    return results


@fact("health")
def fact_health(params):
    """Gather every health fact of this host; `parts` limits, `samples` re-reads.

    `samples: N` (with `interval` seconds) returns `{"samples": [...]}`: the same parts read N
    times in this one request, for measurements near a threshold.
    """
    parts = [p for p in (params.get("parts") or HL_PARTS) if p in _HL_FUNCS]
    started = time.time()
    samples = int(params.get("samples") or 0)
    if samples:
        samples = max(1, min(samples, 10))
        interval = max(0.0, min(float(params.get("interval", 0.5)), 5.0))
        out = []
        for i in range(samples):
            if i:
                time.sleep(interval)
            one = _hl_gather(params, parts)
            one["time"] = time.time()
            out.append(one)
        return {"samples": out, "time": started}
    result = _hl_gather(params, parts)
    result["time"] = started
    result["duration"] = round(time.time() - started, 4)
    result["hostname"] = socket.gethostname()
    return result


@op("health_commit")
def op_health_commit(params):
    """Record the kernel-log cursor of a successful run (atomically: temp file, rename)."""
    path = params.get("state_path") or HL_STATE_PATH
    state = params.get("state")
    if not isinstance(state, dict):
        raise OpError("health_commit: state must be an object")
    state = dict(state)
    state["committed"] = time.time()
    d = os.path.dirname(path)
    if d and not os.path.isdir(d):
        os.makedirs(d, 0o755)
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(state, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    return {"path": path, "last_ts": state.get("last_ts")}

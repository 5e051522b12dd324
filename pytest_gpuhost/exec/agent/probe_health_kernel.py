"""Agent probe: the `health_kernel_log` fact (Xid/SXid since the last run) and `health_commit`.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py).  The kernel log
is read with `dmesg --time-format iso` (plain `dmesg` plus /proc/stat's btime where that option
is missing); only lines after the cursor of the last committed run count.  The cursor (last
timestamp and the keys of the lines at it) lives in health-state.json under the agent's state
directory (`state_path`: /var/lib/gpuhost by default), which `health_commit` writes after a
successful run; nothing else here changes the host.

Besides the Xid lines (`NVRM: Xid (PCI:dddd:bb:dd): N, ...`; older drivers print no `PCI:`, e.g.
304.64's `NVRM: Xid (0000:01:00): 8, Channel 00000000`, fixtures/outputs/kernlog-xid-no-pci-
prefix-304.txt), the driver reports a GPU lost from the bus in records of its own, with or
without an Xid 79 next to them (fixtures/outputs/kernlog-fallen-off-bus-*.txt):

- at probe, when the GPU's PMC_BOOT_0 and PMC_BOOT_42 read all ones (open-gpu-kernel-modules,
  returning NV_ERR_GPU_IS_LOST), one record of three lines: `NVRM: The NVIDIA GPU 0000:b3:00.0` /
  `NVRM: (PCI ID: 10de:26b5) installed in this system has` / `NVRM: fallen off the bus and is not
  responding to commands.`; dmesg prints the second and third lines indented, with no timestamp;
- at run time, `NVRM: GPU 0000:06:00.0: GPU has fallen off the bus.`.

Each is reported as an Xid 79 on that GPU (`record: "fallen_off_bus"`), once per GPU and run
whether or not the driver also logged the Xid 79 line.

A node that does not let the agent read the kernel log (a rented container: syslog(2) needs
CAP_SYSLOG, which container runtimes drop, and Docker's seccomp profile refuses it without;
dmesg then prints "read kernel buffer failed: Operation not permitted") is not a node with a
broken log: the part says `denied: "EPERM"` (decided from the capability set, not dmesg's
words), `missing: "dmesg"` where there is no dmesg, and still carries the state of earlier runs.
"""

import calendar
import hashlib
import json
import os
import re
import time

from pytest_gpuhost.exec.agent.core import OpError, fact, op, read_str, read_text, run_recorded, state_path

STATE_FILE = "health-state.json"  # under the agent's state directory (state_path)
_ISO = re.compile(r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:[,.](\d+))?(Z|[+-]\d\d:?\d\d)?\s+(.*)$")
_RAW = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\]\s?(.*)$")
_XID = re.compile(r"\bXid \((?:PCI:)?([0-9A-Fa-f:.]+)\):\s*(\d+)\b,?\s*(.*)$")
_SXID = re.compile(r"\bSXid \(PCI:([0-9A-Fa-f:.]+)\):\s*(\d+)\b,?\s*(.*)$")
_FALLEN = (
    re.compile(
        r"NVRM: The NVIDIA GPU ([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})\.\d\b.*fallen off the bus", re.S
    ),
    re.compile(r"NVRM: GPU ([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})\.\d: GPU has fallen off the bus"),
)
XID_FALLEN_OFF_THE_BUS = 79
# "Xid 45 ... caused by previous Xid 149" (fixtures/outputs/kernlog-xid45-caused-by-previous.txt)
_CAUSE = re.compile(r"\bcaused by previous Xid (\d+)\b")


def _committed(state):
    """When a state was committed (0 when it does not say)."""
    try:
        return float(state.get("committed") or 0)
    except (TypeError, ValueError):
        return 0.0


def read_state(path):
    """Return the health state file as (state, error); a missing file is (None, None)."""
    try:
        data = read_text(path, 1 << 20)
    except OSError as exc:
        return None, (None if exc.errno == 2 else f"{path}: {exc.strerror}")
    try:
        state = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        return None, f"{path}: not JSON ({exc}); treating as first run"
    if not isinstance(state, dict):
        return None, f"{path}: not an object; treating as first run"
    return state, None


def _iso_epoch(m):
    year, mon, day, hh, mm, ss = (int(m.group(i)) for i in range(1, 7))
    frac = float("0." + m.group(7)) if m.group(7) else 0.0
    epoch = calendar.timegm((year, mon, day, hh, mm, ss, 0, 0, 0)) + frac
    tz = m.group(8)
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        epoch -= sign * (int(digits[:2]) * 3600 + int(digits[2:4]) * 60)
    return epoch


def _btime():
    for line in (read_str("/proc/stat", "", 1 << 20) or "").splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return None


def _line_key(ts, msg):
    """Return the cursor key of a record: its time and first line (continuation lines not in it)."""
    first = msg.split("\n", 1)[0]
    return hashlib.sha1(f"{ts:.6f} {first}".encode("utf-8", "replace")).hexdigest()[:16]


def _dmesg_lines(timeout, record):
    """Return (lines as (epoch, message), mode, failed result or None)."""
    res = run_recorded(["dmesg", "--time-format", "iso"], timeout, record)
    mode = "iso"
    if res["rc"] != 0:
        res = run_recorded(["dmesg"], timeout, record)
        mode = "raw"
    if res["rc"] != 0:
        return [], mode, res
    btime = _btime() if mode == "raw" else None
    lines = []  # type: list
    for text in res["stdout"].splitlines():
        m = (_ISO if mode == "iso" else _RAW).match(text)
        if not m:
            # dmesg prints the further lines of a multi-line record indented, with no timestamp
            if lines and text[:1].isspace() and text.strip():
                lines[-1] = (lines[-1][0], lines[-1][1] + "\n" + text.strip())
            continue
        if mode == "iso":
            lines.append((_iso_epoch(m), m.group(9)))
        else:
            lines.append((float(m.group(1)) + (btime or 0.0), m.group(2)))
    return lines, mode, None


CAP_SYSLOG = 34  # include/uapi/linux/capability.h


def _has_cap(bit):
    """Say whether this process has capability `bit` in its effective set (/proc/self/status CapEff)."""
    for line in (read_str("/proc/self/status", "", 1 << 16) or "").splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split()[1], 16) >> bit & 1)
            except (IndexError, ValueError):
                return True
    return True


def _events(new):
    """Return (Xid events, SXid events) of (epoch, message) lines; see the module docstring."""
    xid, sxid, fallen = [], [], []
    for ts, msg in new:
        m = _SXID.search(msg)
        if m:
            sxid.append({"ts": ts, "bdf": m.group(1).lower(), "code": int(m.group(2)), "msg": msg})
            continue
        m = _XID.search(msg)
        if m:
            xid.append({"ts": ts, "bdf": m.group(1).lower(), "code": int(m.group(2)), "msg": msg})
            cause = _CAUSE.search(m.group(3))
            if cause:
                xid[-1]["cause"] = int(cause.group(1))
            continue
        for pattern in _FALLEN:
            m = pattern.search(msg)
            if m:
                fallen.append(
                    {
                        "ts": ts,
                        "bdf": m.group(1).lower(),
                        "code": XID_FALLEN_OFF_THE_BUS,
                        "msg": msg.replace("\n", " "),
                        "record": "fallen_off_bus",
                    }
                )
                break
    lost = {e["bdf"] for e in xid if e["code"] == XID_FALLEN_OFF_THE_BUS}
    for e in fallen:
        if e["bdf"] not in lost:
            lost.add(e["bdf"])
            xid.append(e)
    xid.sort(key=lambda e: e["ts"])
    return xid, sxid


@fact("health_kernel_log")
def fact_health_kernel_log(params):
    """Return the Xid and SXid lines logged since the committed cursor, and the new cursor."""
    timeout = float(params.get("timeout", 20))
    path = params.get("state_path") or state_path(STATE_FILE)
    state, state_error = read_state(path)
    sent = params.get("state")
    if isinstance(sent, dict) and (state is None or _committed(sent) >= _committed(state)):
        # the controller keeps the state of every run (a --check-only run keeps it there alone,
        # writing nothing here) and sends it: the newer of the two is this node's last run
        state, state_error, path = sent, None, params.get("state_from") or "controller"
    record = []  # type: list
    lines, mode, failed = _dmesg_lines(timeout, record)
    if failed is not None:
        if failed["timed_out"]:
            why = "dmesg timed out"
        elif failed["rc"] == 127:
            why = "dmesg: command not found"
        else:
            err = (failed.get("stderr") or failed.get("stdout") or "").strip().splitlines()
            why = "dmesg exited %d%s" % (failed["rc"], (": " + err[-1]) if err else "")  # noqa: UP031
        out = {"ok": False, "error": why, "state_path": path, "commands": record}
        if failed["rc"] == 127:
            out["missing"] = "dmesg"
        elif not failed["timed_out"] and not _has_cap(CAP_SYSLOG):
            out["denied"] = "EPERM"
            out["needs"] = "CAP_SYSLOG"
        if state is not None:  # what earlier runs recorded still counts (the other checks read it)
            out["pending"] = list(state.get("pending") or [])
            out["previous_counters"] = state.get("counters")
        return out
    boot_id = read_str("/proc/sys/kernel/random/boot_id", None, 256)
    since = state.get("last_ts") if state is not None else None
    seen = set(state.get("seen_at_last") or []) if state is not None else set()
    # The kernel log holds this boot only: after a reboot every line is new, whatever its time
    # says (dmesg's wall-clock times are the boot time plus the monotonic clock, and a clock
    # set back, or the estimate dmesg makes, can put them before the last run's cursor).
    new_boot = (
        state is not None and bool(state.get("boot_id")) and bool(boot_id) and state["boot_id"] != boot_id
    )
    if new_boot:
        since, seen = None, set()
    new = [
        (ts, msg)
        for ts, msg in lines
        if since is None or not (ts < since or (ts == since and _line_key(ts, msg) in seen))
    ]
    xid, sxid = _events(new)
    last_ts = max([ts for ts, _ in lines] + ([since] if since is not None else []) or [0.0])
    at_last = sorted(_line_key(ts, msg) for ts, msg in lines if ts == last_ts)
    if since is not None and last_ts == since:
        at_last = sorted(set(at_last) | seen)
    return {
        "ok": True,
        "mode": mode,
        "first_run": state is None,
        "new_boot": new_boot,
        "since": since,
        "state_path": path,
        "state_error": state_error,
        "lines_total": len(lines),
        "lines_new": len(new),
        "xid": xid,
        "sxid": sxid,
        # what earlier runs found the node owes (a GPU reset, a reboot): judged with this boot's id
        "pending": list(state.get("pending") or []) if state is not None else [],
        # the counters the last run recorded (modules/health/counters compares this run's with them)
        "previous_counters": state.get("counters") if state is not None else None,
        "cursor": {
            "version": 1,
            "last_ts": last_ts,
            "seen_at_last": at_last,
            "boot_id": boot_id,
        },
        "commands": record,
    }


@op("health_commit")
def op_health_commit(params):
    """Record the kernel-log cursor of a successful run (atomically: temp file, rename)."""
    path = params.get("state_path") or state_path(STATE_FILE)
    state = params.get("state")
    if not isinstance(state, dict):
        raise OpError("health_commit: state must be an object")
    state = dict(state)
    state.setdefault("committed", time.time())  # the controller's stamp: the copy it keeps has the same
    d = os.path.dirname(path)
    if d and not os.path.isdir(d):
        os.makedirs(d, 0o755)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    return {"path": path, "last_ts": state.get("last_ts")}

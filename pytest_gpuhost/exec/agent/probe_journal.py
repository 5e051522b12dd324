"""Agent probe: a run lock and an atomically written journal on the target (suites/p2p).

The lock is a directory made with mkdir (atomic on every filesystem), holding owner.json with
this agent's pid, its start time, the boot id and a heartbeat.  The holder is the agent process
of the run that took it, so the lock lives exactly as long as that run's agent: a run whose
controller vanished leaves an agent that dies with its channel, and the next run finds the
lock stale (owner dead, host rebooted, or heartbeat older than stale_s) and takes it over.
Runs on the target (stdlib only, Python 3.6 syntax; see the package docstring).
"""

import json
import os
import time

from pytest_gpuhost.exec.agent.core import op, read_str

_MAX_JSON = 64 << 20  # far above any journal or owner record; a bound all the same


def _start_time(pid):
    stat = read_str(f"/proc/{pid}/stat")
    if not stat:
        return None
    # field 22 (starttime) counted after the ")" that closes comm, which may contain spaces
    return stat.rsplit(")", 1)[1].split()[19]


def _write_atomic(path, data):
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owner_state(owner, stale_s):
    """Return why a lock owner is stale, or None while it is alive."""
    if not owner:
        return "no owner record"
    if owner.get("boot_id") != read_str("/proc/sys/kernel/random/boot_id"):
        return "the host rebooted since"
    pid = owner.get("pid")
    if not isinstance(pid, int) or _start_time(pid) != owner.get("pid_start"):
        return f"its agent (pid {pid}) is gone"
    age = time.time() - float(owner.get("heartbeat", 0))
    if age > stale_s:
        return f"no heartbeat for {int(age)} s"
    return None


@op("gpuhost_lock")
def gpuhost_lock(params):
    """Acquire, refresh or release the run lock at params["path"] (a directory)."""
    path = params["path"]
    action = params.get("action", "acquire")
    owner_file = path + "/owner.json"
    me = os.getpid()
    now = time.time()
    raw = read_str(owner_file, max_bytes=_MAX_JSON)
    try:
        current = json.loads(raw) if raw else None
    except ValueError:
        current = None
    mine = current.get("run_id") == params.get("run_id") if current else False
    if action == "release":
        if mine:
            os.unlink(owner_file)
            os.rmdir(path)
        return {"released": mine, "holder": None if mine else current}
    if action == "refresh":
        if not mine or current is None:
            return {"acquired": False, "holder": current}
        current["heartbeat"] = now
        current["pid"], current["pid_start"] = me, _start_time(me)
        _write_atomic(owner_file, json.dumps(current))
        return {"acquired": True, "holder": current}
    if mine:
        return {"acquired": True, "holder": current, "took_over": None}
    record = dict(params.get("owner") or {})
    record.update(
        run_id=params.get("run_id"),
        pid=me,
        pid_start=_start_time(me),
        boot_id=read_str("/proc/sys/kernel/random/boot_id"),
        acquired=now,
        heartbeat=now,
        hostname=os.uname()[1],
    )
    took_over = None
    for _attempt in range(2):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkdir(path)
        except FileExistsError:
            raw = read_str(owner_file, max_bytes=_MAX_JSON)
            try:
                holder = json.loads(raw) if raw else None
            except ValueError:
                holder = None
            if holder is None:
                # mkdir done, owner.json not yet written: a live acquirer, unless it is old
                try:
                    age = now - os.stat(path).st_mtime
                except OSError:
                    continue
                if age < 10:
                    return {"acquired": False, "holder": None, "reason": "being acquired"}
            why = _owner_state(holder, float(params.get("stale_s", 600)))
            if why is None:
                return {"acquired": False, "holder": holder}
            stale = f"{path}.stale.{int(now * 1000)}"
            try:
                os.rename(path, stale)
            except OSError:
                continue
            took_over = {"holder": holder, "why": why, "moved_to": stale}
            continue
        _write_atomic(owner_file, json.dumps(record))
        return {"acquired": True, "holder": record, "took_over": took_over}
    return {"acquired": False, "holder": None, "reason": "lost the race twice"}


@op("gpuhost_journal")
def gpuhost_journal(params):
    """Write (atomically, fsynced), read or retire the journal at params["path"]."""
    path = params["path"]
    action = params.get("action", "read")
    if action == "write":
        _write_atomic(path, json.dumps(params["data"], indent=1, sort_keys=True))
        lock = params.get("lock")
        if lock:  # the journal's writer is alive: refresh its lock's heartbeat in the same request
            return {
                "ok": True,
                "lock": gpuhost_lock({"path": lock["path"], "run_id": lock["run_id"], "action": "refresh"}),
            }
        return {"ok": True}
    if action == "retire":
        if os.path.exists(path):
            os.rename(path, params.get("to") or path + ".done")
        return {"ok": True}
    raw = read_str(path, max_bytes=_MAX_JSON)
    if raw is None:
        return {"journal": None}
    try:
        return {"journal": json.loads(raw)}
    except ValueError as exc:
        return {"journal": None, "corrupt": str(exc)}

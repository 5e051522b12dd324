# Agent probe: a run lock and an atomically written journal on the target (suites/p2p).
#
# The lock is a directory made with mkdir (atomic on every filesystem), holding owner.json with
# this agent's pid, its start time, the boot id and a heartbeat. The holder is the agent process
# of the run that took it, so the lock lives exactly as long as that run's agent: a run whose
# controller vanished leaves an agent that dies with its channel, and the next run finds the
# lock stale (owner dead, host rebooted, or heartbeat older than stale_s) and takes it over.
# ruff: noqa: F821
import json as _jr_json
import os as _jr_os
import time as _jr_time


def _jr_read(path, default=None):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return default


def _jr_start_time(pid):
    stat = _jr_read(f"/proc/{pid}/stat")
    if not stat:
        return None
    # field 22 (starttime) counted after the ")" that closes comm, which may contain spaces
    return stat.rsplit(")", 1)[1].split()[19]


def _jr_write_atomic(path, data):
    directory = _jr_os.path.dirname(path)
    _jr_os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{_jr_os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(data)
        fh.flush()
        _jr_os.fsync(fh.fileno())
    _jr_os.rename(tmp, path)
    fd = _jr_os.open(directory, _jr_os.O_RDONLY)
    try:
        _jr_os.fsync(fd)
    finally:
        _jr_os.close(fd)


def _jr_owner_state(owner, stale_s):
    """Return why a lock owner is stale, or None while it is alive."""
    if not owner:
        return "no owner record"
    if owner.get("boot_id") != _jr_read("/proc/sys/kernel/random/boot_id"):
        return "the host rebooted since"
    pid = owner.get("pid")
    if not isinstance(pid, int) or _jr_start_time(pid) != owner.get("pid_start"):
        return f"its agent (pid {pid}) is gone"
    age = _jr_time.time() - float(owner.get("heartbeat", 0))
    if age > stale_s:
        return f"no heartbeat for {int(age)} s"
    return None


@op("gpuhost_lock")
def gpuhost_lock(params):
    """Acquire, refresh or release the run lock at params["path"] (a directory)."""
    path = params["path"]
    action = params.get("action", "acquire")
    owner_file = path + "/owner.json"
    me = _jr_os.getpid()
    now = _jr_time.time()
    raw = _jr_read(owner_file)
    try:
        current = _jr_json.loads(raw) if raw else None
    except ValueError:
        current = None
    mine = bool(current) and current.get("run_id") == params.get("run_id")
    if action == "release":
        if mine:
            _jr_os.unlink(owner_file)
            _jr_os.rmdir(path)
        return {"released": mine, "holder": None if mine else current}
    if action == "refresh":
        if not mine:
            return {"acquired": False, "holder": current}
        current["heartbeat"] = now
        current["pid"], current["pid_start"] = me, _jr_start_time(me)
        _jr_write_atomic(owner_file, _jr_json.dumps(current))
        return {"acquired": True, "holder": current}
    if mine:
        return {"acquired": True, "holder": current, "took_over": None}
    record = dict(params.get("owner") or {})
    record.update(
        run_id=params.get("run_id"),
        pid=me,
        pid_start=_jr_start_time(me),
        boot_id=_jr_read("/proc/sys/kernel/random/boot_id"),
        acquired=now,
        heartbeat=now,
        hostname=_jr_os.uname()[1],
    )
    took_over = None
    for _attempt in range(2):
        try:
            _jr_os.makedirs(_jr_os.path.dirname(path), exist_ok=True)
            _jr_os.mkdir(path)
        except FileExistsError:
            raw = _jr_read(owner_file)
            try:
                holder = _jr_json.loads(raw) if raw else None
            except ValueError:
                holder = None
            if holder is None:
                # mkdir done, owner.json not yet written: a live acquirer, unless it is old
                try:
                    age = now - _jr_os.stat(path).st_mtime
                except OSError:
                    continue
                if age < 10:
                    return {"acquired": False, "holder": None, "reason": "being acquired"}
            why = _jr_owner_state(holder, float(params.get("stale_s", 600)))
            if why is None:
                return {"acquired": False, "holder": holder}
            stale = f"{path}.stale.{int(now * 1000)}"
            try:
                _jr_os.rename(path, stale)
            except OSError:
                continue
            took_over = {"holder": holder, "why": why, "moved_to": stale}
            continue
        _jr_write_atomic(owner_file, _jr_json.dumps(record))
        return {"acquired": True, "holder": record, "took_over": took_over}
    return {"acquired": False, "holder": None, "reason": "lost the race twice"}


@op("gpuhost_journal")
def gpuhost_journal(params):
    """Write (atomically, fsynced), read or retire the journal at params["path"]."""
    path = params["path"]
    action = params.get("action", "read")
    if action == "write":
        _jr_write_atomic(path, _jr_json.dumps(params["data"], indent=1, sort_keys=True))
        lock = params.get("lock")
        if lock:  # the journal's writer is alive: refresh its lock's heartbeat in the same request
            return {
                "ok": True,
                "lock": gpuhost_lock({"path": lock["path"], "run_id": lock["run_id"], "action": "refresh"}),
            }
        return {"ok": True}
    if action == "retire":
        if _jr_os.path.exists(path):
            _jr_os.rename(path, params.get("to") or path + ".done")
        return {"ok": True}
    raw = _jr_read(path)
    if raw is None:
        return {"journal": None}
    try:
        return {"journal": _jr_json.loads(raw)}
    except ValueError as exc:
        return {"journal": None, "corrupt": str(exc)}

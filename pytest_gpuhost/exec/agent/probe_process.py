"""Agent probe: process table, GPU holders, and signals by exact PID with a start-time check.

The agent knows its own PID, its ancestors and its session, so the selection can never include
them.  Runs on the target (stdlib only, Python 3.6 syntax; see the package docstring).
"""

import os
import signal
import time

from pytest_gpuhost.exec.agent.core import op, read_str


def _stat(pid):
    """Return (ppid, pgid, sid, starttime, state) from /proc/PID/stat, or None if gone."""
    try:
        with open("/proc/" + str(pid) + "/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'
    rest = data[data.rindex(b")") + 2 :].split()
    return {
        "state": rest[0].decode("ascii", "replace"),
        "ppid": int(rest[1]),
        "pgid": int(rest[2]),
        "sid": int(rest[3]),
        "starttime": int(rest[19]),
    }


def _text(raw):
    return raw.decode("utf-8", "surrogateescape").encode("utf-8", "backslashreplace").decode("utf-8")


def _own_tree():
    own = os.getpid()
    ancestors = []
    pid = own
    for _ in range(64):
        st = _stat(pid)
        if st is None or st["ppid"] <= 0:
            break
        pid = st["ppid"]
        ancestors.append(pid)
    return {"pid": own, "ancestors": ancestors, "sid": os.getsid(0), "pgid": os.getpgid(0)}


def _gpu_holders():
    """Map PID -> sorted /dev/nvidia* paths it holds open (what fuser/lsof would say)."""
    holders = {}  # type: dict
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fd_dir = "/proc/" + name + "/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir + "/" + fd)
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                holders.setdefault(int(name), set()).add(target)
    return dict((pid, sorted(paths)) for pid, paths in holders.items())


@op("proc_list")
def proc_list(params):
    """List processes: pid, ppid, sid, start time, argv, exe, unit cgroup, GPU devices held."""
    holders = _gpu_holders() if params.get("gpu_holders", True) else {}
    procs = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        st = _stat(pid)
        if st is None:
            continue
        try:
            with open("/proc/" + str(pid) + "/cmdline", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        argv = [_text(a) for a in raw.split(b"\0")[:-1]] if raw else []
        try:
            exe = os.readlink("/proc/" + str(pid) + "/exe")
        except OSError:
            exe = None
        cgroup = ""
        try:
            with open("/proc/" + str(pid) + "/cgroup") as f:
                for line in f:
                    parts = line.rstrip("\n").split(":", 2)
                    if len(parts) == 3 and (parts[0] == "0" or parts[1] == "name=systemd"):
                        cgroup = parts[2]
        except OSError:
            pass
        comm = read_str("/proc/" + str(pid) + "/comm", "")
        st.update(pid=pid, argv=argv, exe=exe, cgroup=cgroup, comm=comm, gpus=holders.get(pid, []))
        procs.append(st)
    return {"processes": procs, "self": _own_tree(), "clk_tck": os.sysconf("SC_CLK_TCK")}


def _alive(pid, starttime):
    st = _stat(pid)
    return st is not None and st["starttime"] == starttime and st["state"] not in ("Z", "X")


@op("proc_signal")
def proc_signal(params):
    """Send a signal to exact PIDs whose start time still matches; never to this agent's own tree."""
    sig = int(params["signal"])
    own = _own_tree()
    protected = set([own["pid"]] + own["ancestors"])
    out = []
    for item in params["targets"]:
        pid = int(item["pid"])
        res = {"pid": pid}  # type: dict
        st = _stat(pid)
        if pid in protected or (st is not None and st["sid"] == own["sid"]):
            res["status"] = "refused"
        elif st is None or st["state"] in ("Z", "X"):
            res["status"] = "gone"
        elif st["starttime"] != int(item["starttime"]):
            res["status"] = "reused"
        else:
            pidfd = None
            try:
                # a pidfd pins the process: the start-time check and the signal hit the same one
                if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
                    pidfd = os.pidfd_open(pid)
                    again = _stat(pid)
                    if again is None or again["starttime"] != int(item["starttime"]):
                        res["status"] = "reused"
                    else:
                        signal.pidfd_send_signal(pidfd, sig)
                        res["status"] = "sent"
                else:
                    os.kill(pid, sig)
                    res["status"] = "sent"
            except ProcessLookupError:
                res["status"] = "gone"
            except OSError as exc:
                res["status"] = "error"
                res["error"] = exc.strerror
                res["errno"] = exc.errno
            finally:
                if pidfd is not None:
                    os.close(pidfd)
        out.append(res)
    return out


@op("proc_wait")
def proc_wait(params):
    """Wait (bounded by timeout) until the given PIDs (with start times) are gone; list survivors."""
    deadline = time.time() + float(params["timeout"])
    targets = [(int(t["pid"]), int(t["starttime"])) for t in params["targets"]]
    while True:
        alive = [pid for pid, start in targets if _alive(pid, start)]
        if not alive or time.time() >= deadline:
            break
        time.sleep(0.05)
    return {"alive": alive, "waited": float(params["timeout"]) - max(0.0, deadline - time.time())}

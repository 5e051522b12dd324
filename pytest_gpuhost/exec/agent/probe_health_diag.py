"""Agent probe: the `health_diag` fact, active diagnostics where installed, opt-in and time-bounded.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py).  Nothing runs
unless the inventory asks (`diag: [nvbandwidth, dcgm]`, modules/health/thresholds.py): then, in
the same request as the other health facts, `nvbandwidth -j -t host_to_device_memcpy_ce
device_to_host_memcpy_ce` (NVIDIA/nvbandwidth: CE copies between host memory and each GPU) and
`dcgmi diag -r LEVEL -j` (DCGM's diagnostic, JSON), each under what is left of `diag_timeout`.
A tool that is not installed is reported as such (the check skips with that reason).  The
copies use the GPUs: an opt-in for nodes drained of work.  modules/health/diag.py judges.
"""

import os
import time

from pytest_gpuhost.exec.agent.core import fact, run_recorded

NVBANDWIDTH_TESTS = ("host_to_device_memcpy_ce", "device_to_host_memcpy_ce")
MAX_OUTPUT = 1 << 20


def _which(name):
    for d in (os.environ.get("PATH") or "/usr/bin:/bin").split(os.pathsep):
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    for d in ("/usr/local/bin", "/usr/bin", "/usr/sbin"):  # sshd's PATH may be short
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def _argv(tool, params):
    if tool == "nvbandwidth":
        return ["nvbandwidth", "-j", "-t"] + list(NVBANDWIDTH_TESTS)
    if tool == "dcgm":
        level = int(params.get("diag_level") or 1)
        return ["dcgmi", "diag", "-r", str(max(1, min(level, 4))), "-j"]
    return None


@fact("health_diag")
def fact_health_diag(params):
    """Run the diagnostics the inventory asked for, each within what is left of the time budget."""
    wanted = [t for t in (params.get("diag") or []) if isinstance(t, str)]
    if not wanted:
        return {"ok": True, "enabled": []}
    budget = float(params.get("diag_timeout") or 90)
    start = time.monotonic()
    record = []  # type: list
    results = {}
    for tool in wanted:
        argv = _argv(tool, params)
        if argv is None:
            results[tool] = {"error": "unknown diagnostic " + tool}
            continue
        exe = _which(argv[0])
        if exe is None:
            results[tool] = {"missing": argv[0] + " is not installed on this host"}
            continue
        left = budget - (time.monotonic() - start)
        if left < 5:
            results[tool] = {"error": "not run: the diagnostics' time budget (diag_timeout) was spent"}
            continue
        res = run_recorded([exe] + argv[1:], left, record)
        results[tool] = {
            "argv": argv,
            "rc": res["rc"],
            "timed_out": res["timed_out"],
            "duration": res.get("duration"),
            "stdout": (res.get("stdout") or "")[:MAX_OUTPUT],
            "stderr": (res.get("stderr") or "")[-4000:],
        }
    return {"ok": True, "enabled": wanted, "results": results, "commands": record}

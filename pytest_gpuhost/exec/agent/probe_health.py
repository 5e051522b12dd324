"""Agent probe: the `health` fact, the GPU parts suites/health judges, and free disk space.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py).  The parts run
in parallel threads, each command under its own timeout, so one request costs the slowest part,
not the sum.  Read-only.  The kernel log, PCI/ACS and services are facts of their own
(probe_health_kernel.py, probe_health_pci.py, probe_health_services.py), asked for in the same
request; modules/health/facts.py merges them into one facts dict.  The `gpus`, `remap` and
`nvlink` parts and the GPUs' side of `fabric` come from the `health_nvml` fact
(probe_health_nvml.py) where it ran first in the request and read the GPUs through NVML
(`nvml_parts`); from nvidia-smi (probe_health_smi.py) otherwise.
"""

import os
import socket
import threading
import time

from pytest_gpuhost.exec.agent.core import fact, read_str, run_recorded
from pytest_gpuhost.exec.agent.probe_health_services import systemd_missing
from pytest_gpuhost.exec.agent.probe_health_smi import (
    cmd_error,
    part_p2p,
    part_smi,
    smi_fabric,
    smi_gpus,
    smi_nvlink,
    smi_remap,
)

PARTS = ("gpus", "smi", "fabric", "remap", "nvlink", "p2p", "disk")
NVML_KEY = "_health_nvml"  # params: what the `health_nvml` fact read, earlier in this request
NVML_PARTS = ("gpus", "remap", "nvlink", "fabric")  # "fabric": the GPUs' side; the unit is systemctl's


def nvml_parts(params):
    """Return ({part: answer} from this request's NVML read, or None to read nvidia-smi; why not).

    probe_health_nvml.py reads the `gpus`, `remap` and `nvlink` parts, and the GPUs' fabric state,
    through libnvidia-ml.so.1 before this fact runs. A hung call is the parts' answer (nvidia-smi calls the same driver and would hang
    as well); a missing library or a failed nvmlInit_v2 is a fallback to nvidia-smi, and the
    parts nvidia-smi fills say why.
    """
    got = params.get(NVML_KEY)
    if not isinstance(got, dict):
        return None, None
    if got.get("ok"):
        return {k: got[k] for k in NVML_PARTS if k in got}, None
    if got.get("error") == "driver hung":
        part = {
            "ok": False,
            "error": "NVML call {} hung after {:g} s".format(got.get("call"), float(got.get("after_s") or 0)),
            "hung": {"call": got.get("call"), "after_s": got.get("after_s")},
            "source": "nvml",
        }  # type: dict
        return {
            "gpus": dict(part, gpus=[]),
            "remap": dict(part, gpus={}),
            "nvlink": dict(part, gpus={}),
        }, None
    return None, str(got.get("error") or "no answer")


def _sourced(name, params, read):
    parts, why = nvml_parts(params)
    if parts is not None and name in parts:
        return parts[name]
    out = read()
    out["source"] = "nvidia-smi"
    if why:
        out["nvml_fallback"] = why
    return out


def part_gpus(params, record):
    """The GPUs' fields, through NVML when this request read them so, else from nvidia-smi."""
    return _sourced("gpus", params, lambda: smi_gpus(params, record))


def part_remap(params, record):
    """Every GPU's row remapping, through NVML when this request read it so, else from nvidia-smi."""
    return _sourced("remap", params, lambda: smi_remap(params, record))


FABRIC_UNIT = (
    "nvidia-fabricmanager.service"  # NVIDIA Fabric Manager user guide: systemctl start nvidia-fabricmanager
)


def fabric_wanted(params, gpus):
    """Return True when a GPU's model sits on NVSwitches (params' fabric_models, first match wins)."""
    for g in gpus:
        name = str(g.get("name") or "").lower()
        for key, on in params.get("fabric_models") or []:
            if key.lower() in name:
                if on:
                    return True
                break
    return False


def part_fabric(params, record):
    """Each GPU's fabric State/Status and memory temperature limit, and the Fabric Manager unit's state.

    The GPUs' side comes from this request's NVML read where there was one (nvmlDeviceGetGpuFabricInfo,
    the MEM_MAX threshold), else from `nvidia-smi -q` (smi_fabric); the unit from systemctl.
    """
    timeout = float(params.get("timeout", 20))
    parts, why = nvml_parts(params)
    nvml = (parts or {}).get("fabric")
    if nvml is not None:
        gpus = {b: {"state": g["state"], "status": g["status"]} for b, g in nvml["gpus"].items()}
        mem_max = {b: g["memory_temp_max"] for b, g in nvml["gpus"].items() if g.get("memory_temp_max")}
        out = {
            "ok": True,
            "gpus": gpus,
            "memory_temp_max": mem_max,
            "memory_temp_max_tlimit": {},
            "source": "nvml",
        }
    else:
        out = smi_fabric(timeout, record)
        out["source"] = "nvidia-smi"
        if why:
            out["nvml_fallback"] = why
        if not out["ok"]:
            return out
    show = run_recorded(
        ["systemctl", "show", "-p", "LoadState", "-p", "ActiveState", "-p", "SubState", FABRIC_UNIT],
        timeout,
        record,
    )
    unit = dict(ln.partition("=")[::2] for ln in show.get("stdout", "").splitlines() if "=" in ln)
    if show["rc"] != 0 and not unit:
        unit = {"error": cmd_error(show, "systemctl show " + FABRIC_UNIT)}
        missing = None if show["timed_out"] else systemd_missing(show)
        if missing:
            unit["missing"] = missing
    out.update(unit=FABRIC_UNIT, service=unit)
    return out


def part_nvlink(params, record):
    """Each GPU's NVLinks and their error counters, through NVML when this request read them so."""
    return _sourced("nvlink", params, lambda: smi_nvlink(params, record))


def part_disk(params, record):
    out = {}
    for path in params.get("data_paths") or ["/"]:
        try:
            st = os.statvfs(path)
        except OSError as exc:
            out[path] = {"error": f"{path}: {exc.strerror}", "errno": exc.errno}
            continue
        out[path] = {
            "total": st.f_blocks * st.f_frsize,
            "free": st.f_bfree * st.f_frsize,
            "avail": st.f_bavail * st.f_frsize,
            "ro": bool(st.f_flag & os.ST_RDONLY),
        }
    return {"ok": True, "paths": out}


FUNCS = {"gpus": part_gpus, "remap": part_remap, "nvlink": part_nvlink, "p2p": part_p2p, "disk": part_disk}


def _failure(exc):
    return {"ok": False, "error": "{}: {}".format(type(exc).__name__, " ".join(str(exc).split()))}


def gather(params, parts):
    """Read `parts` once, in parallel threads; return them with the commands they ran."""
    results = {}  # type: dict
    records = {}  # type: dict

    def work(name):
        rec = []  # type: list
        records[name] = rec
        try:
            results[name] = FUNCS[name](params, rec)
        except Exception as exc:
            results[name] = _failure(exc)

    def gpus_then_smi():
        # smi after gpus, in one thread: the driver version just read says whether the cached
        # CUDA version still holds (one nvidia-smi start fewer per run)
        if "gpus" in parts:
            work("gpus")
        gpus = (results.get("gpus") or {}).get("gpus") or []
        drivers = sorted({g.get("driver_version") for g in gpus if g.get("driver_version")})
        rec = []  # type: list
        records["smi"] = rec
        try:
            results["smi"] = part_smi(params, rec, drivers[0] if len(drivers) == 1 else None)
        except Exception as exc:
            results["smi"] = _failure(exc)
        if "fabric" in parts and fabric_wanted(params, gpus):
            # only on NVSwitch models: one more nvidia-smi start, where the fabric exists
            rec = []
            records["fabric"] = rec
            try:
                results["fabric"] = part_fabric(params, rec)
            except Exception as exc:
                results["fabric"] = _failure(exc)

    jobs = [(n, work, (n,)) for n in parts if n in FUNCS and not (n == "gpus" and "smi" in parts)]  # type: list
    if "smi" in parts:
        jobs.append(("smi", gpus_then_smi, ()))
    threads = [threading.Thread(target=f, args=a) for _, f, a in jobs]
    for t in threads:
        t.daemon = True
        t.start()
    # Every command inside has its own timeout; this bound only guards against a probe bug.
    deadline = time.monotonic() + float(params.get("timeout", 20)) * 3 + 5
    for t, (name, _, _) in zip(threads, jobs):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            for n in ("gpus", "smi") if name == "smi" else (name,):
                if n in parts:
                    results[n] = {"ok": False, "error": n + ": probe did not finish in time"}
    results["commands"] = [c for n in parts for c in list(records.get(n, []))]
    return results


_CONTAINER_FILES = (("/.dockerenv", "docker"), ("/run/.containerenv", "podman"))
# The `container=` values of systemd's Container Interface (systemd.io/CONTAINER_INTERFACE, the
# list systemd-detect-virt knows); any other value is not taken as a container manager's word.
_CONTAINER_MANAGERS = (
    "lxc",
    "lxc-libvirt",
    "systemd-nspawn",
    "docker",
    "podman",
    "rkt",
    "wsl",
    "proot",
    "pouch",
    "oci",
)


def node_shape():
    """Say what kind of node this is: a container (and which), its PID 1, systemd, its GPU devices.

    Read from files, never from a tool: `/.dockerenv` (Docker), `/run/.containerenv` (Podman),
    `/run/systemd/container` and PID 1's `container=` where it names a container manager (the
    Container Interface systemd and LXC follow); `/dev/nvidiaN` are the GPUs the container runtime gave the node (the NVIDIA
    container toolkit creates only those), `NVIDIA_VISIBLE_DEVICES` what it was asked for.
    """
    kind = None
    for path, name in _CONTAINER_FILES:
        if os.path.exists(path):
            kind = name
            break
    env = {}
    try:
        with open("/proc/1/environ", "rb") as f:
            for item in f.read(1 << 16).split(b"\0"):
                k, _, v = item.decode("utf-8", "replace").partition("=")
                if k in ("container", "NVIDIA_VISIBLE_DEVICES"):
                    env[k] = v
    except OSError:
        pass
    if kind is None:
        said = read_str("/run/systemd/container", None, 256) or env.get("container")
        kind = said if said in _CONTAINER_MANAGERS else None
    try:
        devs = sorted(int(n[6:]) for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())
    except OSError:
        devs = []
    return {
        "container": kind,
        "pid1": read_str("/proc/1/comm", None, 256),
        "systemd": os.path.isdir("/run/systemd/system"),
        "gpu_devices": devs,
        "visible_devices": env.get("NVIDIA_VISIBLE_DEVICES"),
    }


@fact("health")
def fact_health(params):
    """Gather the health parts of this host; `parts` limits, `samples` re-reads.

    `samples: N` (with `interval` seconds) returns `{"samples": [...]}`: the same parts read N
    times in this one request, for measurements near a threshold.
    """
    parts = [p for p in (params.get("parts") or PARTS) if p in PARTS]
    started = time.time()
    samples = int(params.get("samples") or 0)
    if samples:
        params.pop(NVML_KEY, None)  # read once, before: each sample reads the GPUs anew (nvidia-smi)
        samples = max(1, min(samples, 10))
        interval = max(0.0, min(float(params.get("interval", 0.5)), 5.0))
        out = []
        for i in range(samples):
            if i:
                time.sleep(interval)
            one = gather(params, parts)
            one["time"] = time.time()
            out.append(one)
        return {"samples": out, "time": started}
    result = gather(params, parts)
    result["time"] = started
    result["duration"] = round(time.time() - started, 4)
    result["hostname"] = socket.gethostname()
    result["node"] = node_shape()
    return result

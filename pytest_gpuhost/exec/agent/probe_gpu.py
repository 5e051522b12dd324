"""Agent probe: NVIDIA GPUs, their PCI functions and IOMMU groups, GPU holders, persistence.

Runs on the target (stdlib only, Python 3.6 syntax; see the package docstring).  The P2P
probe (cupy, pynvml) is probe_p2p.py.
"""

import glob
import os
import re
import subprocess
import time

from pytest_gpuhost.exec.agent.core import fact, link_name, read_str

_PCI = "/sys/bus/pci/devices"
_GROUPS = "/sys/kernel/iommu_groups"
_NVIDIA_VENDOR = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")


def _int(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _function(bdf):
    base = os.path.join(_PCI, bdf)
    group = link_name(base + "/iommu_group")
    return {
        "bdf": bdf,
        "vendor": read_str(base + "/vendor"),
        "device": read_str(base + "/device"),
        "class": read_str(base + "/class"),
        "driver": link_name(base + "/driver"),
        "driver_override": read_str(base + "/driver_override"),
        "iommu_group": _int(group),
        "numa_node": _int(read_str(base + "/numa_node")),
    }


def _minor_from_proc(bdf):
    info = read_str(f"/proc/driver/nvidia/gpus/{bdf.lower()}/information")
    if not info:
        return None
    m = re.search(r"Device Minor:\s*(\d+)", info)
    return int(m.group(1)) if m else None


def _smi(args, timeout=20):
    """Run nvidia-smi with args; return stdout, or None when it is missing or fails."""
    try:
        proc = subprocess.run(  # noqa: UP022 - capture_output/text need 3.7
            ["nvidia-smi"] + list(args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=timeout,
            universal_newlines=True,  # noqa: UP021
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _norm_bdf(bus_id):
    # nvidia-smi prints 00000000:17:00.0; sysfs uses 0000:17:00.0
    bus_id = bus_id.strip().lower()
    m = re.match(r"^([0-9a-f]+):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$", bus_id)
    if not m:
        return bus_id
    return f"{int(m.group(1), 16) & 0xFFFF:04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


def _smi_table(fields):
    """Query nvidia-smi --query-gpu; return {bdf: {field: value}} or None."""
    out = _smi(["--query-gpu=pci.bus_id," + ",".join(fields), "--format=csv,noheader,nounits"])
    if out is None:
        return None
    table = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields) + 1:
            continue
        table[_norm_bdf(cells[0])] = dict(zip(fields, cells[1:]))
    return table


# One nvidia-smi query serves every fact of one `facts` request: the facts of a request share
# their params dict, so the table is kept there and never outlives the request.
_SMI_FIELDS = ["index", "minor_number", "name", "persistence_mode"]


def _smi_shared(params):
    """Return the nvidia-smi table of this facts request (query it on first use)."""
    if "_gpu_smi" not in params:
        params["_gpu_smi"] = _smi_table(_SMI_FIELDS)
    return params["_gpu_smi"]


@fact("gpus")
def gpus_fact(params):
    """Every NVIDIA display/3D function with its driver, IOMMU group (type, members), link, minor."""
    result = []
    smi_minors = None
    want_minors = params.get("minors", True)
    for path in sorted(glob.glob(_PCI + "/*")):
        bdf = os.path.basename(path)
        vendor = read_str(path + "/vendor")
        klass = read_str(path + "/class") or ""
        if vendor != _NVIDIA_VENDOR or not klass.startswith(_GPU_CLASSES):
            continue
        entry = _function(bdf)
        entry["link"] = {
            "speed": read_str(path + "/current_link_speed"),
            "width": _int(read_str(path + "/current_link_width")),
            "max_speed": read_str(path + "/max_link_speed"),
            "max_width": _int(read_str(path + "/max_link_width")),
        }
        up = os.path.dirname(os.path.realpath(path))  # the upstream port (root or switch port)
        entry["link"]["port_max_speed"] = read_str(up + "/max_link_speed")
        entry["link"]["port_max_width"] = _int(read_str(up + "/max_link_width"))
        group = entry["iommu_group"]
        if group is not None:
            gbase = f"{_GROUPS}/{group}"
            entry["group_type"] = read_str(gbase + "/type")
            members = sorted(os.listdir(gbase + "/devices")) if os.path.isdir(gbase + "/devices") else [bdf]
            entry["group_members"] = [_function(m) for m in members]
        else:
            entry["group_type"] = None
            entry["group_members"] = [_function(bdf)]
        minor = None
        if entry["driver"] == "nvidia" and want_minors:
            minor = _minor_from_proc(bdf)
            if minor is None:
                if smi_minors is None:
                    smi_minors = _smi_shared(params) or {}
                minor = _int((smi_minors.get(bdf) or {}).get("minor_number"))
        entry["minor"] = minor
        result.append(entry)
    return result


def _proc_holders(prefix="/dev/nvidia"):
    holders = []
    me = os.getpid()
    for pid_dir in glob.glob("/proc/[0-9]*"):
        pid = int(os.path.basename(pid_dir))
        if pid == me:
            continue
        # path -> descriptors naming it (each open file holds two module references)
        files = {}  # type: dict[str, int]
        try:
            fds = os.listdir(pid_dir + "/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(pid_dir + "/fd/" + fd)
            except OSError:
                continue
            if target.startswith(prefix):
                files[target] = files.get(target, 0) + 1
        if not files:
            continue
        cmdline = ""
        try:
            with open(pid_dir + "/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            pass
        holders.append(
            {
                "pid": pid,
                "comm": read_str(pid_dir + "/comm", ""),
                "cmdline": cmdline,
                "files": sorted(files),
                "fds": files,
                "cgroup": ((read_str(pid_dir + "/cgroup", "") or "").splitlines() or [""])[-1],
            }
        )
    return sorted(holders, key=lambda h: h["pid"])


@fact("gpu_holders")
def gpu_holders_fact(params):
    """Processes with /dev/nvidia* open: pid, comm, cmdline, which files and how many fds each (scans /proc/*/fd)."""
    return _proc_holders(params.get("prefix", "/dev/nvidia"))


def _running(program):
    """PIDs whose comm (cut to 15 characters by the kernel) or argv[0..1] basename is `program`."""
    pids = []
    for pid_dir in glob.glob("/proc/[0-9]*"):
        comm = read_str(pid_dir + "/comm") or ""
        argv = []
        try:
            with open(pid_dir + "/cmdline", "rb") as fh:
                argv = [a.decode("utf-8", "replace") for a in fh.read().split(b"\0")[:2]]
        except OSError:
            pass
        names = {os.path.basename(a) for a in argv if a}
        if comm == program[:15] or program in names:
            pids.append(int(os.path.basename(pid_dir)))
    return sorted(pids)


@fact("persistence")
def persistence_fact(params):
    """nvidia-persistenced processes and legacy persistence mode per GPU (nvidia-smi)."""
    table = _smi_shared(params)
    legacy = None
    if table is not None:
        legacy = {bdf: row.get("persistence_mode") for bdf, row in table.items()}
    return {"persistenced_pids": _running("nvidia-persistenced"), "legacy": legacy}


@fact("nvidia_smi_gpus")
def nvidia_smi_gpus_fact(params):
    """GPUs nvidia-smi lists: {bdf: {index, minor_number, name}}, or None if it cannot run."""
    table = _smi_shared(params)
    if table is None:
        return None
    return {bdf: {k: row.get(k) for k in ("index", "minor_number", "name")} for bdf, row in table.items()}


@fact("host_info")
def host_info_fact(params):
    """Kernel release, boot id and kernel command line: what picks the sysfs era and detects reboots."""
    return {
        # /proc/sys/kernel/osrelease is what uname reports (and what a container or lab can carry)
        "kernel": read_str("/proc/sys/kernel/osrelease") or os.uname()[2],
        "boot_id": read_str("/proc/sys/kernel/random/boot_id"),
        "cmdline": read_str("/proc/cmdline"),
        "time": time.time(),
        # what a loaded NVIDIA driver leaves (none of them: no driver on this host)
        "nvidia_driver": [
            p for p in ("/sys/module/nvidia", "/proc/driver/nvidia", "/dev/nvidiactl") if os.path.exists(p)
        ],
    }

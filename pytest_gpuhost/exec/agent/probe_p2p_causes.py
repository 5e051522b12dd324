"""Agent probe: the `p2p_causes` fact, what besides the IOMMU makes GPU peer-to-peer slow or hang.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py). Read-only, a
few hundred small sysfs and /etc reads. suites/p2p reads it in step 1's one round trip and
judges it in modules/p2p_causes.py:

- per NVIDIA display/3D function not on vfio-pci (a VM's GPU is never judged: only its driver is
  recorded): the size of BAR1 (line 2 of sysfs `resource`: start, end,
  flags per region; NVIDIA GPUs map their framebuffer aperture at region 1), its NUMA node,
  its link as trained now and its maximum, and its AER counters;
- per PCI bridge above a GPU: runtime power management (`power/control`: `auto` lets the port
  suspend, `on` keeps it active; Documentation/ABI/testing/sysfs-devices-power), its runtime
  status and its AER counters (aer_dev_fatal / aer_dev_nonfatal, where the kernel
  counts "Surprise Down" as SDES: drivers/pci/pcie/aer.c aer_uncorrectable_error_string);
- the kernel command line, nvidia_uvm's `uvm_disable_hmm` as loaded
  (/sys/module/nvidia_uvm/parameters/), and every modprobe.d file that sets nvidia_uvm options
  (the directories modprobe.d(5) reads), as configured for the next load.
"""

import glob
import os

from pytest_gpuhost.exec.agent.core import fact, link_name, pci_upstream, read_str, read_text
from pytest_gpuhost.exec.agent.probe_pci_path import SYS_PCI, bridges, is_nvidia_gpu

UVM_PARAM = "/sys/module/nvidia_uvm/parameters/uvm_disable_hmm"
# modprobe.d(5): these directories, later ones overridden by earlier ones of the same file name
MODPROBE_DIRS = (
    "/etc/modprobe.d",
    "/run/modprobe.d",
    "/usr/local/lib/modprobe.d",
    "/lib/modprobe.d",
    "/usr/lib/modprobe.d",
)
MAX_CONF = 64  # files read at most
MAX_CONF_BYTES = 64 * 1024
AER = ("aer_dev_fatal", "aer_dev_nonfatal")


def bar1_bytes(resource_text):
    """Size of region 1 from sysfs `resource` text (None when absent or unset)."""
    lines = (resource_text or "").splitlines()
    if len(lines) < 2:
        return None
    parts = lines[1].split()
    try:
        start, end = int(parts[0], 16), int(parts[1], 16)
    except (IndexError, ValueError):
        return None
    return end - start + 1 if end > start else None


def aer_counts(text):
    """{NAME: count} of an aer_dev_* file (None when it cannot be read)."""
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _text(path, limit=4096):
    try:
        return read_text(path, limit).decode("utf-8", "replace")
    except OSError:
        return None


def _link(base):
    return {
        k: read_str(os.path.join(base, k))
        for k in ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
    }


def _port(bdf):
    base = os.path.join(SYS_PCI, bdf)
    return {
        "power_control": read_str(base + "/power/control"),
        "runtime_status": read_str(base + "/power/runtime_status"),
        "aer": {n: aer_counts(_text(os.path.join(base, n))) for n in AER},
    }


def modprobe_confs():
    """{path: text} of the modprobe.d files that mention nvidia_uvm (bounded)."""
    out = {}  # type: dict
    n = 0
    for d in MODPROBE_DIRS:
        for path in sorted(glob.glob(os.path.join(glob.escape(d), "*.conf"))):
            n += 1
            if n > MAX_CONF:
                return out
            text = _text(path, MAX_CONF_BYTES)
            if text is not None and "nvidia_uvm" in text.replace("-", "_"):
                out[path] = text
    return out


@fact("p2p_causes")
def p2p_causes_fact(params):
    """BAR1, NUMA, links, ports' power management and AER, cmdline, nvidia_uvm's HMM setting."""
    gpus = {}
    ports = {}  # type: dict
    ranges = {}  # type: dict
    try:
        names = sorted(os.listdir(SYS_PCI))
    except OSError as exc:
        return {"error": f"{SYS_PCI}: {exc.strerror}"}
    for b in names:
        base = os.path.join(SYS_PCI, b)
        if not is_nvidia_gpu(base):
            continue
        driver = link_name(base + "/driver")
        if driver == "vfio-pci":  # a VM's GPU: never judged, so not read further
            gpus[b] = {"driver": driver}
            continue
        chain = []
        for up in pci_upstream(SYS_PCI, b, bridges, ranges):
            if up not in ports:
                ports[up] = _port(up)
            chain.append(up)
        numa = read_str(base + "/numa_node")
        gpus[b] = {
            "driver": driver,
            "bar1": bar1_bytes(_text(base + "/resource")),
            "numa_node": int(numa) if numa and numa.lstrip("-").isdigit() else None,
            "link": _link(base),
            "aer": {n: aer_counts(_text(os.path.join(base, n))) for n in AER},
            "ports": chain,
        }
    return {
        "gpus": gpus,
        "ports": ports,
        "cmdline": (_text("/proc/cmdline") or "").strip(),
        "uvm_loaded": os.path.isdir("/sys/module/nvidia_uvm"),
        "uvm_disable_hmm": read_str(UVM_PARAM),
        "modprobe": modprobe_confs(),
    }

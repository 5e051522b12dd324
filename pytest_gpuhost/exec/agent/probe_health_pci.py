"""Agent probe: the `health_pci` fact, the GPUs' PCI functions, IOMMU groups and upstream ACS.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py).  Read-only: sysfs
files and links, config space where it is readable, `lspci -vvv` for a bridge whose extended
config space is not (only root sees it).  suites/health asks for it in the same request as the
`health` fact (modules/health/facts.py merges the two).
"""

import errno
import os
import re

from pytest_gpuhost.exec.agent.core import fact, link_name, pci_upstream, read_str, read_text, run_recorded

SYS_PCI = "/sys/bus/pci/devices"
NVIDIA_DRIVER = "/sys/bus/pci/drivers/nvidia"  # a link per function bound to nvidia
ACS_BITS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans")
GPU_CLASSES = ("0x0300", "0x0302")  # PCI class code: VGA-compatible, 3D controller
NVSWITCH_CLASS = "0x0680"  # "other bridge": how an NVSwitch presents itself on PCIe
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# PCIe AER counters per device since boot (Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats;
# drivers/pci/pcie/aer.c aer_stats_dev_attr: one "NAME count" line per error, then "TOTAL_ERR_*").
# Present only where the device has the AER capability and the kernel handles AER natively.
AER_FILES = (
    ("correctable", "aer_dev_correctable", "TOTAL_ERR_COR"),
    ("fatal", "aer_dev_fatal", "TOTAL_ERR_FATAL"),
    ("nonfatal", "aer_dev_nonfatal", "TOTAL_ERR_NONFATAL"),
)


def read_aer(base):
    """Return a function's AER totals {"correctable", "fatal", "nonfatal"} from sysfs ({} without AER)."""
    out = {}
    for key, name, total in AER_FILES:
        text = read_str(os.path.join(base, name), None, 8192)
        for line in (text or "").splitlines():
            label, _, count = line.strip().rpartition(" ")
            if label == total and count.isdigit():
                out[key] = int(count)
    return out


def _acs_from_config(bdf):
    """Return the ACS control bits from config space, None when it cannot be read in full."""
    try:
        data = read_text(os.path.join(SYS_PCI, bdf, "config"), 4096)
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
        if header & 0xFFFF == 0x000D:
            ctl = int.from_bytes(data[off + 6 : off + 8], "little")
            return {
                "source": "config",
                "present": True,
                "ctl": {n: bool(ctl >> i & 1) for i, n in enumerate(ACS_BITS)},
            }
        off = header >> 20
        if off == 0:
            break
    return {"source": "config", "present": False, "ctl": {}}


def _acs_from_lspci(bdf, timeout, record):
    res = run_recorded(["lspci", "-vvv", "-s", bdf], timeout, record)
    if res["rc"] != 0 or not res["stdout"].strip():
        return None
    out = res["stdout"]
    m = re.search(r"ACSCtl:\s*(.*)", out)
    if m:
        ctl = {}
        for tok in m.group(1).split():
            if tok[-1:] in "+-" and tok[:-1] in ACS_BITS:
                ctl[tok[:-1]] = tok[-1] == "+"
        return {"source": "lspci", "present": True, "ctl": ctl}
    if "<access denied>" in out:
        return None
    if re.search(r"Capabilities: \[[1-9a-f][0-9a-f]{2} v", out):
        return {"source": "lspci", "present": False, "ctl": {}}  # extended caps listed, no ACS
    return None


def pci_ids(base):
    """Return (class, vendor, driver) of a PCI device: one read of `uevent` where it exists."""
    text = read_str(os.path.join(base, "uevent"))
    if text:
        ev = dict(line.partition("=")[::2] for line in text.splitlines())
        try:
            cls = "0x%06x" % int(ev.get("PCI_CLASS", ""), 16)  # noqa: UP031 - a hex field width
            vendor = "0x" + ev["PCI_ID"].split(":")[0].lower()
            return cls, vendor, ev.get("DRIVER") or None
        except (KeyError, ValueError):
            pass
    return (
        read_str(os.path.join(base, "class"), ""),
        read_str(os.path.join(base, "vendor")),
        link_name(os.path.join(base, "driver")),
    )


def scan_bus():
    """Return (bridges, NVIDIA GPUs, NVSwitches) of the whole PCI bus: one `uevent` read per function.

    The GPUs are the NVIDIA (vendor 0x10de) display controllers, class 0x0300 (VGA) or 0x0302
    (3D), whatever driver holds them or none: a GPU whose nvidia probe failed is not in the
    driver's directory, and nvidia-smi does not list it, but it is still on the bus. The
    NVSwitches are NVIDIA's class 0x0680 functions ("Bridge [0680]: NVIDIA Corporation GH100
    [H100 NVSwitch] [10de:22a3]" in lspci of an HGX H100; 10de:1af1 on HGX A100): whether a
    GPU's NVLinks run through switches decides what a GPU reset must take with it.
    """
    try:
        names = os.listdir(SYS_PCI)
    except OSError:
        return set(), {}, []
    bridges = set()
    gpus = {}
    switches = []
    for b in names:
        if not _BDF.match(b):
            continue
        cls, vendor, driver = pci_ids(os.path.join(SYS_PCI, b))
        if cls.startswith("0x0604"):
            bridges.add(b)
        elif vendor == "0x10de" and cls[:6] in GPU_CLASSES:
            gpus[b] = {"class": cls, "driver": driver}
        elif vendor == "0x10de" and cls.startswith(NVSWITCH_CLASS):
            switches.append(b)
    return bridges, gpus, sorted(switches)


@fact("health_pci")
def fact_health_pci(params):
    """Read the GPUs bound to nvidia: IOMMU group and its type, and their upstream bridges' ACS.

    Only functions bound to nvidia are judged (a GPU on vfio-pci belongs to a VM), so they are
    listed from the driver's directory rather than by reading every function of the machine;
    the PCIe link speeds come with the `health` fact (nvidia-smi, sysfs where it says nothing).
    """
    timeout = float(params.get("timeout", 20))
    record = []  # type: list
    try:
        bound = sorted(n for n in os.listdir(NVIDIA_DRIVER) if _BDF.match(n))
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            return {
                "ok": False,
                "error": f"{NVIDIA_DRIVER}: {exc.strerror}",
                "devices": {},
                "commands": record,
            }
        bound = []  # the driver is not loaded: no GPU on nvidia
    # The whole bus, read once: the GPUs on it are the count nvidia-smi must show when the
    # inventory does not say (health_gpu.check_gpu_count), the bridges serve a flat sysfs.
    all_bridges, on_bus, nvswitches = scan_bus()
    devices = {}
    acs_cache = {}  # type: dict
    ranges = {}  # type: dict

    for b in bound:
        base = os.path.join(SYS_PCI, b)
        if b in on_bus:
            cls, driver = on_bus[b]["class"], on_bus[b]["driver"]
        else:
            cls, vendor, driver = pci_ids(base)
            if vendor != "0x10de" or cls[:6] not in GPU_CLASSES:
                continue  # an NVSwitch, also on nvidia
        group = link_name(os.path.join(base, "iommu_group"))
        dev = {
            "driver": driver or "nvidia",
            "class": cls,
            "iommu_group": group,
            "iommu_type": read_str(f"/sys/kernel/iommu_groups/{group}/type") if group else None,
            "bridges": [],
        }  # type: dict
        aer = read_aer(base)
        if aer:
            dev["aer"] = aer
        for up in pci_upstream(SYS_PCI, b, all_bridges, ranges):
            if up not in acs_cache:
                acs = _acs_from_config(up)
                if acs is None:
                    acs = _acs_from_lspci(up, timeout, record)
                acs_cache[up] = acs or {"source": "unknown", "present": None, "ctl": {}}
            dev["bridges"].append({"bdf": up, "acs": acs_cache[up]})
        devices[b] = dev
    return {
        "ok": True,
        "devices": devices,
        "on_bus": on_bus,
        "nvswitches": nvswitches,
        "iommu_groups_present": os.path.isdir("/sys/kernel/iommu_groups"),
        "commands": record,
    }

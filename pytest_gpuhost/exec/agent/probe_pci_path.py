"""Agent probe: the `pci_paths` fact, every NVIDIA GPU's ports up to the root with their ACS state.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py). Read-only. For
each NVIDIA display/3D function, whatever driver holds it: the bridges above it, nearest first,
each with its PCIe port type (from the PCI Express capability: 4 root port, 5 switch upstream
port, 6 switch downstream port) and its ACS capability and control bits (the ACS extended
capability, id 0x000D; capability register at +4, control at +6: PCIe Base Spec "ACS Extended
Capability"). suites/p2p reads it in step 1 to say why a GPU shares its IOMMU group and whether
ACS redirect sends a pair's peer traffic through the root complex (modules/acs.py).

Extended config space (offset 0x100 and up) is readable by root only: without it, a port's type
and ACS state are null ("unknown"), never guessed.
"""

import os
import re

from pytest_gpuhost.exec.agent.core import fact, link_name, pci_upstream, read_str, read_text

SYS_PCI = "/sys/bus/pci/devices"
ACS_BITS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans")
PORT_TYPES = {4: "root", 5: "upstream", 6: "downstream", 7: "pcie-to-pci", 8: "pci-to-pcie"}
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _u(data, off, size):
    return int.from_bytes(data[off : off + size], "little")


def _pcie_type(data):
    """The PCIe device/port type from the PCI Express capability (id 0x10), or None."""
    if len(data) < 0x40 or not _u(data, 0x06, 2) & 0x10:  # status: capabilities list
        return None
    off = data[0x34] & 0xFC
    for _ in range(48):
        if off < 0x40 or off + 4 > len(data):
            return None
        if data[off] == 0x10:
            return (_u(data, off + 2, 2) >> 4) & 0xF
        off = data[off + 1] & 0xFC
    return None


def _acs(data):
    """{"present", "cap", "ctl"} from the ACS extended capability; None when 0x100+ is unreadable."""
    if len(data) < 0x104:
        return None
    off = 0x100
    for _ in range(64):
        if off < 0x100 or off + 8 > len(data):
            break
        header = _u(data, off, 4)
        if header in (0, 0xFFFFFFFF):
            break
        if header & 0xFFFF == 0x000D:
            cap, ctl = _u(data, off + 4, 2), _u(data, off + 6, 2)
            return {
                "present": True,
                "cap": [n for i, n in enumerate(ACS_BITS) if cap >> i & 1],
                "ctl": [n for i, n in enumerate(ACS_BITS) if ctl >> i & 1],
            }
        off = header >> 20
        if off == 0:
            break
    return {"present": False, "cap": [], "ctl": []}


def port(bdf):
    """One bridge: its type, whether it has other functions (multifunction), and its ACS state."""
    try:
        data = read_text(os.path.join(SYS_PCI, bdf, "config"), 4096)
    except OSError:
        data = b""
    code = _pcie_type(data) if len(data) > 0x40 else None
    header = data[0x0E] if len(data) > 0x0E else 0
    return {
        "bdf": bdf,
        "type": PORT_TYPES.get(code, "other") if code is not None else None,
        "multifunction": bool(header & 0x80),
        "acs": _acs(data),
    }


def bridges():
    """Every PCI bridge's BDF (class 0x0604): where `pci_upstream` looks in a flat sysfs."""
    out = []  # type: list
    try:
        names = os.listdir(SYS_PCI)
    except OSError:
        return out
    for b in names:
        if _BDF.match(b) and (read_str(os.path.join(SYS_PCI, b, "class")) or "").startswith("0x0604"):
            out.append(b)
    return out


def is_nvidia_gpu(base):
    """Whether the function at sysfs folder `base` is an NVIDIA display or 3D controller."""
    return read_str(base + "/vendor") == "0x10de" and (read_str(base + "/class") or "").startswith(
        ("0x0300", "0x0302")
    )


@fact("pci_paths")
def pci_paths_fact(params):
    """{GPU BDF: {"driver", "ports": [port, ...] nearest first}} for every NVIDIA display/3D function."""
    out = {}
    ranges = {}  # type: dict
    ports = {}  # type: dict
    try:
        names = sorted(os.listdir(SYS_PCI))
    except OSError as exc:
        return {"error": f"{SYS_PCI}: {exc.strerror}"}
    for b in names:
        base = os.path.join(SYS_PCI, b)
        if not is_nvidia_gpu(base):
            continue
        chain = []
        for up in pci_upstream(SYS_PCI, b, bridges, ranges):
            if up not in ports:
                ports[up] = port(up)
            chain.append(ports[up])
        out[b] = {"driver": link_name(base + "/driver"), "ports": chain}
    return out

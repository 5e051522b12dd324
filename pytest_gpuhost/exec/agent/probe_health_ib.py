"""Agent probe: the `health_ib` fact, InfiniBand/RoCE ports and whether nvidia_peermem is loaded.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py).  Read-only, no
process: per port of every RDMA device, `/sys/class/infiniband/DEV/ports/N/` `state`
("4: ACTIVE"), `phys_state` ("5: LinkUp"), `rate` ("400 Gb/sec (4X NDR)"), `link_layer`
("InfiniBand" or "Ethernet" for RoCE) and `counters/link_downed`, `counters/link_error_recovery`,
`counters/symbol_error` (Documentation/ABI/stable/sysfs-class-infiniband; the formats are
drivers/infiniband/core/sysfs.c state_show, phys_state_show, rate_show, show_pma_counter).
GPUDirect RDMA needs the nvidia_peermem module (NVIDIA GPUDirect RDMA documentation), seen as
/sys/module/nvidia_peermem.  suites/health asks for it in the same request as the other facts;
modules/health/ib.py judges it.
"""

import os
import re

from pytest_gpuhost.exec.agent.core import fact, read_str

IB_ROOT = "/sys/class/infiniband"
PEERMEM = "/sys/module/nvidia_peermem"
COUNTERS = ("link_downed", "link_error_recovery", "symbol_error")
_RATE = re.compile(r"^([0-9.]+) Gb/sec")


def _state(text):
    """Return (number, name) of "4: ACTIVE" / "5: LinkUp"; (None, text) when it has no number."""
    num, sep, name = (text or "").partition(":")
    return (int(num), name.strip()) if sep and num.strip().isdigit() else (None, (text or "").strip())


def read_port(base):
    """Return one port's state, physical state, rate, link layer and error counters."""
    state = _state(read_str(os.path.join(base, "state"), ""))
    phys = _state(read_str(os.path.join(base, "phys_state"), ""))
    rate_text = read_str(os.path.join(base, "rate"), "") or ""
    m = _RATE.match(rate_text)
    counters = {}
    for name in COUNTERS:
        v = read_str(os.path.join(base, "counters", name), None)
        if v is not None and v.strip().isdigit():
            counters[name] = int(v)
    return {
        "state": state[1],
        "state_num": state[0],
        "phys_state": phys[1],
        "phys_num": phys[0],
        "rate": rate_text,
        "rate_gbps": float(m.group(1)) if m else None,
        "link_layer": read_str(os.path.join(base, "link_layer"), None),
        "counters": counters,
    }


@fact("health_ib")
def fact_health_ib(params):
    """Return every RDMA port (DEV/PORT) with its state and counters, and nvidia_peermem's presence."""
    root = params.get("ib_root") or IB_ROOT
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        devices = []
    ports = {}
    for dev in devices:
        pdir = os.path.join(root, dev, "ports")
        try:
            numbers = sorted(os.listdir(pdir), key=lambda n: int(n) if n.isdigit() else 0)
        except OSError:
            continue
        for num in numbers:
            ports[dev + "/" + num] = read_port(os.path.join(pdir, num))
    return {
        "ok": True,
        "ports": ports,
        "peermem": os.path.isdir(params.get("peermem_path") or PEERMEM),
    }

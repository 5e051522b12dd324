"""The `infiniband` health check: RDMA ports up at their rate, no link flaps since the last run, peermem.

Pure logic, no I/O: the `health_ib` fact (exec/agent/probe_health_ib.py) read
/sys/class/infiniband/*/ports/*/ (Documentation/ABI/stable/sysfs-class-infiniband). Which ports
must be up: the inventory's `ib_ports` where set; else every InfiniBand port and every port
(RoCE included) that was ACTIVE at the last run, so a management Ethernet port never cabled does
not fail the node but one that went down does. A port must be `4: ACTIVE` and `5: LinkUp`, at
`ib_rate_min_gbps` or, unset, at least its rate at the last run (a link that retrained to a lower
rate); `counters/link_downed` may grow by `ib_link_downed_max` since the last run (default 0: a
flap fails once, on the run after it). GPUDirect RDMA needs the nvidia_peermem module (NVIDIA
GPUDirect RDMA documentation): with an active port and GPUs, it must be loaded unless
`ib_peermem_required: false`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.modules.health.thresholds import Thresholds
from pytest_gpuhost.modules.health.verdict import Facts, Verdict, facts_gpus, facts_part, failed, skipped

__all__ = ["check_infiniband", "ib_state"]

ACTIVE, LINK_UP = 4, 5  # ib_port_state IB_PORT_ACTIVE; phys_state 5: LinkUp (drivers/infiniband/core/sysfs.c)


def _ports(facts: Facts) -> Mapping[str, Mapping[str, Any]]:
    part = facts.get("ib")
    ports = part.get("ports") if isinstance(part, Mapping) and part.get("ok") else None
    return ports if isinstance(ports, Mapping) else {}


def ib_state(facts: Facts) -> dict[str, Any]:
    """Return what the health state keeps of each port for the next run."""
    return {
        name: {
            "state_num": p.get("state_num"),
            "rate_gbps": p.get("rate_gbps"),
            "link_downed": (p.get("counters") or {}).get("link_downed"),
        }
        for name, p in _ports(facts).items()
    }


def _previous(facts: Facts) -> Mapping[str, Any]:
    part = facts.get("kernel_log")
    prev = part.get("previous_counters") if isinstance(part, Mapping) else None
    ib = prev.get("ib") if isinstance(prev, Mapping) else None
    return ib if isinstance(ib, Mapping) else {}


def check_infiniband(facts: Facts, t: Thresholds) -> Verdict:
    """Judge the RDMA ports against the inventory or the last run, and nvidia_peermem."""
    part, err = facts_part(facts, "ib")
    if part is None:
        return failed("infiniband", f"InfiniBand facts missing: {err}", [str(err)])
    ports = _ports(facts)
    if not ports:
        if t["ib_ports"]:
            return failed(
                "infiniband",
                "no RDMA device in /sys/class/infiniband",
                [f"expected {', '.join(t['ib_ports'])}"],
            )
        return skipped(
            "infiniband", "no InfiniBand/RoCE device on this host (/sys/class/infiniband is empty)"
        )
    prev = _previous(facts)
    if t["ib_ports"]:
        required = list(t["ib_ports"])
    else:
        was_up = {n for n, p in prev.items() if isinstance(p, Mapping) and p.get("state_num") == ACTIVE}
        required = sorted(n for n, p in ports.items() if p.get("link_layer") == "InfiniBand" or n in was_up)
    reasons = []
    for name in required:
        p = ports.get(name)
        got = prev.get(name)
        before: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
        was = " (ACTIVE at the last run)" if before.get("state_num") == ACTIVE else ""
        if p is None:
            reasons.append(f"{name}: no such port{was}")
            continue
        if p.get("state_num") != ACTIVE or p.get("phys_num") != LINK_UP:
            reasons.append(f"{name}: {p.get('state')} / {p.get('phys_state')}{was}")
            continue
        want = t["ib_rate_min_gbps"] if t["ib_rate_min_gbps"] is not None else before.get("rate_gbps")
        rate = p.get("rate_gbps")
        if want is not None and rate is not None and rate < float(want):
            src = "ib_rate_min_gbps" if t["ib_rate_min_gbps"] is not None else "its rate at the last run"
            reasons.append(f"{name}: rate {p.get('rate')} < {float(want):g} Gb/sec ({src})")
    for name, p in sorted(ports.items()):
        now = (p.get("counters") or {}).get("link_downed")
        was_n = (prev.get(name) or {}).get("link_downed") if isinstance(prev.get(name), Mapping) else None
        if not isinstance(now, int) or not prev:
            continue
        grew = now - was_n if isinstance(was_n, int) and now >= was_n else now
        if grew > int(t["ib_link_downed_max"]):
            reasons.append(f"{name}: link went down {grew} time(s) since the last run (counters/link_downed)")
    active = [n for n, p in ports.items() if p.get("state_num") == ACTIVE]
    gpus, _ = facts_gpus(facts)
    if active and gpus and t["ib_peermem_required"] and not part.get("peermem"):
        reasons.append(
            "nvidia_peermem is not loaded: no GPUDirect RDMA over these ports (modprobe nvidia_peermem)"
        )
    state = {"ports": dict(ports), "required": required, "peermem": part.get("peermem")}
    if reasons:
        return failed("infiniband", reasons[0], reasons, state=state)
    shown = ", ".join(f"{n} {ports[n].get('rate')}" for n in required if n in ports)
    return Verdict(
        "infiniband", True, f"{len(required)} RDMA port(s) active: {shown or 'none required'}", state=state
    )

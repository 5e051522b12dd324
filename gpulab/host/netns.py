"""Network namespaces and veth links of lab hosts and their containers.

Host ``NAME`` with index ``I`` lives in netns ``gl-NAME``: veth ``glI-r`` (root side,
``198.18.I.1/24``) to ``eth0`` (host side, ``198.18.I.2/24``, default route via .1). A container
``ID`` of that host lives in netns ``gl-NAME-ID`` with ``eth0`` at ``198.19.I.(10+k)/24``, its peer
``ctID`` sits in the host's netns at ``198.19.I.1/24``; the root namespace routes ``198.19.I.0/24``
via the host, which forwards. Only 198.18.0.0/15 addresses are ever used.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from gpulab.errors import LabError

__all__ = [
    "add_container_link",
    "add_host_link",
    "delete_netns",
    "host_netns",
    "lab_netns_names",
    "link_up",
    "set_netem",
]

NETNS_DIR = Path("/run/netns")
LAB_RANGE = "198.18.0.0/15"


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip"] + (["-n", netns] if netns else []) + list(args)
    return (
        subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        if not check
        else _checked(argv)
    )


def _checked(argv: list[str]) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    if p.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {p.stderr.strip() or p.stdout.strip()}")
    return p


def host_netns(name: str) -> str:
    """Return the netns name of lab host ``name``."""
    return f"gl-{name}"


def root_veth(index: int) -> str:
    """Return the root-side veth name of host index ``index`` (at most 15 characters)."""
    return f"gl{index}-r"


def host_address(index: int) -> str:
    """Return the lab host's address (no prefix length)."""
    return f"198.18.{index}.2"


def container_address(index: int, k: int) -> str:
    """Return the address of the k-th container (0-based) of host ``index``."""
    return f"198.19.{index}.{10 + k}"


def add_host_link(name: str, index: int, delay_ms: int = 0, loss_pct: float = 0) -> None:
    """Create netns ``gl-NAME`` and its veth link to the root namespace; apply netem if asked."""
    ns = host_netns(name)
    rv = root_veth(index)
    _ip("netns", "add", ns)
    _ip("link", "add", rv, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _ip("addr", "add", f"198.18.{index}.1/24", "dev", rv)
    _ip("link", "set", rv, "up")
    _ip("link", "set", "lo", "up", netns=ns)
    _ip("addr", "add", f"{host_address(index)}/24", "dev", "eth0", netns=ns)
    _ip("link", "set", "eth0", "up", netns=ns)
    _ip("route", "add", "default", "via", f"198.18.{index}.1", netns=ns)
    if delay_ms or loss_pct:
        set_netem(name, index, delay_ms=delay_ms, loss_pct=loss_pct)


def add_container_link(name: str, index: int, cid: int, k: int) -> str:
    """Create netns ``gl-NAME-CID`` linked to the host's netns; return the netns name."""
    hns = host_netns(name)
    cns = f"{hns}-{cid}"
    peer = f"ct{cid}"
    _ip("netns", "add", cns)
    _ip("link", "add", peer, "netns", hns, "type", "veth", "peer", "name", "eth0", "netns", cns)
    if k == 0:
        _ip("addr", "add", f"198.19.{index}.1/24", "dev", peer, netns=hns)
    _ip("link", "set", peer, "up", netns=hns)
    if k > 0:
        # Further containers share the /24: route each one's address to its own veth.
        _ip("route", "add", f"{container_address(index, k)}/32", "dev", peer, netns=hns)
    _ip("link", "set", "lo", "up", netns=cns)
    _ip("addr", "add", f"{container_address(index, k)}/24", "dev", "eth0", netns=cns)
    _ip("link", "set", "eth0", "up", netns=cns)
    _ip("route", "add", "default", "via", f"198.19.{index}.1", netns=cns)
    _checked(["ip", "netns", "exec", hns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    _ip("route", "replace", f"198.19.{index}.0/24", "via", host_address(index))
    return cns


def _tc(*args: str, netns: str | None = None, check: bool = True) -> None:
    argv = ["tc"] + (["-n", netns] if netns else []) + list(args)
    if check:
        _checked(argv)
    else:
        subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)


def set_netem(name: str, index: int, delay_ms: int = 0, loss_pct: float = 0) -> None:
    """Set (or clear, with zeros) netem delay and loss on both ends of the host's link."""
    for dev, ns in ((root_veth(index), None), ("eth0", host_netns(name))):
        _tc("qdisc", "del", "dev", dev, "root", netns=ns, check=False)
        if delay_ms or loss_pct:
            args = ["qdisc", "add", "dev", dev, "root", "netem"]
            if delay_ms:
                args += ["delay", f"{int(delay_ms)}ms"]
            if loss_pct:
                args += ["loss", f"{float(loss_pct):g}%"]
            _tc(*args, netns=ns)


def link_up(name: str, index: int, up: bool) -> None:
    """Cut the host's link (its end goes down) or heal it.

    Only the host's end goes down: the root side stays up with its route, so packets to the host
    are dropped by the veth (connections hang, as with a pulled cable) and lab traffic never
    follows the default route off this machine.
    """
    ns = host_netns(name)
    _ip("link", "set", "eth0", "up" if up else "down", netns=ns)
    if up:
        _ip("route", "replace", "default", "via", f"198.18.{index}.1", netns=ns, check=False)


def netem_available() -> bool:
    """Say whether this kernel has the netem qdisc (delay and loss emulation)."""
    probe = subprocess.run(
        ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"],
        capture_output=True, text=True, timeout=10, check=False,
    )  # fmt: skip
    if probe.returncode == 0:
        subprocess.run(
            ["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, timeout=10, check=False
        )
        return True
    return False


def ensure_blackhole() -> None:
    """Route the whole lab range nowhere unless a lab link is more specific (no leaks when a host is down)."""
    _ip("route", "replace", "blackhole", LAB_RANGE, "metric", "4000", check=False)


def remove_blackhole() -> None:
    """Remove the lab range's blackhole route (when no lab host is left)."""
    _ip("route", "del", "blackhole", LAB_RANGE, "metric", "4000", check=False)


def lab_netns_names() -> list[str]:
    """Return every netns whose name starts with ``gl-``."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith("gl-"))


def delete_netns(ns: str) -> None:
    """Delete a netns (its veths go with it); ignore one that is already gone."""
    _ip("netns", "del", ns, check=False)


def delete_route(index: int) -> None:
    """Remove the root namespace's route to a host's containers, if present."""
    _ip("route", "del", f"198.19.{index}.0/24", check=False)

"""Emulated InfiniBand/RoCE ports in a lab host: /sys/class/infiniband as the kernel shows it.

A lab host's /sys is this machine's sysfs (read-only), which has no RDMA device, and sysfs cannot
gain a directory. `install` covers the host's /sys/class with a tmpfs that binds back every real
class directory and adds `infiniband/DEV/ports/N/` with the files the kernel's RDMA core creates
there (drivers/infiniband/core/sysfs.c; Documentation/ABI/stable/sysfs-class-infiniband):

    state       "4: ACTIVE"            (state_show: "%d: %s", IB_PORT_DOWN 1 .. ACTIVE 4)
    phys_state  "5: LinkUp"            (phys_state_show: 2 Polling, 3 Disabled, 5 LinkUp, ...)
    rate        "400 Gb/sec (4X NDR)"  (rate_show: "%d Gb/sec (%dX%s)")
    link_layer  "InfiniBand" or "Ethernet" (RoCE)
    counters/link_downed, link_error_recovery, symbol_error  (show_pma_counter: "%u")

`set_port` changes one port the way a pulled cable or a retrained link does (state, phys_state,
rate, link_downed + 1 on each drop). It all lives in the host's mount namespace until `remove` or
the host's next boot.
"""

from __future__ import annotations

import shlex
from typing import Any

__all__ = ["install", "remove", "set_port"]

BASE = "/run/gpulab-ib"
ROOT = "/sys/class/infiniband"


def _run(host: Any, script: str) -> None:
    r = host.ssh(["sh", "-c", script])
    if r.returncode != 0:
        raise RuntimeError(f"gpulab.kernel.infiniband on {host.name}: {r.stderr.strip() or r.stdout.strip()}")


def _port_script(name: str, **values: Any) -> str:
    dev, num = name.split("/")
    d = f"{ROOT}/{dev}/ports/{num}"
    lines = [f"mkdir -p {shlex.quote(d)}/counters"]
    for key, text in values.items():
        if text is not None:
            lines.append(f"printf '%s\\n' {shlex.quote(str(text))} > {shlex.quote(d + '/' + key)}")
    return "\n".join(lines)


def install(host: Any, ports: dict[str, dict[str, Any]]) -> None:
    """Give the host RDMA ports: {"mlx5_0/1": {"state", "phys_state", "rate", "link_layer"}}."""
    script = [
        "set -e",
        f"mkdir -p {BASE}/orig {BASE}/class",
        f"mountpoint -q {BASE}/orig || mount --bind /sys/class {BASE}/orig",
        f"mountpoint -q {BASE}/class || mount -t tmpfs -o mode=755,size=4m gpulab-ib {BASE}/class",
        f"for d in {BASE}/orig/*; do mkdir -p {BASE}/class/$(basename $d); done",
        f"mkdir -p {BASE}/class/infiniband",
        f"if ! mountpoint -q /sys/class/infiniband 2>/dev/null && [ ! -d {ROOT} ]; then",
        f"  mount --bind {BASE}/class /sys/class",
        f"  for d in {BASE}/orig/*; do mount --bind $d /sys/class/$(basename $d); done",
        "fi",
    ]
    for name, p in ports.items():
        script.append(
            _port_script(
                name,
                state=p.get("state", "4: ACTIVE"),
                phys_state=p.get("phys_state", "5: LinkUp"),
                rate=p.get("rate", "400 Gb/sec (4X NDR)"),
                link_layer=p.get("link_layer", "InfiniBand"),
                **{
                    f"counters/{c}": p.get(c, 0)
                    for c in ("link_downed", "link_error_recovery", "symbol_error")
                },
            )
        )
    _run(host, "\n".join(script))


def set_port(host: Any, name: str, *, up: bool, rate: str | None = None) -> None:
    """Take a port down (as a pulled cable: DOWN / Polling, link_downed + 1) or bring it up."""
    dev, num = name.split("/")
    d = shlex.quote(f"{ROOT}/{dev}/ports/{num}")
    state, phys = ("4: ACTIVE", "5: LinkUp") if up else ("1: DOWN", "2: Polling")
    script = [f"printf '%s\\n' '{state}' > {d}/state", f"printf '%s\\n' '{phys}' > {d}/phys_state"]
    if not up:
        script.append(f"echo $(( $(cat {d}/counters/link_downed) + 1 )) > {d}/counters/link_downed")
    if rate is not None:
        script.append(f"printf '%s\\n' {shlex.quote(rate)} > {d}/rate")
    _run(host, "set -e\n" + "\n".join(script))


def remove(host: Any) -> None:
    """Put the host's /sys/class back."""
    _run(
        host,
        f"umount -R /sys/class 2>/dev/null || true; umount {BASE}/class 2>/dev/null || true; "
        f"umount {BASE}/orig 2>/dev/null || true; rm -rf {BASE}",
    )

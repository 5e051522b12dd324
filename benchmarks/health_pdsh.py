"""The fast operator's fleet sweep, as a baseline: `pdsh -R ssh -w HOSTS ONE_SHOT`.

One SSH login per host, every host at once (pdsh's fan-out, -f 32 by default), one round trip:
the one-shot script below reads what our probe reads (the same four nvidia-smi runs, the kernel
log, the service units) and judges nothing. pdsh runs the OpenSSH client with the suite's key and
known_hosts, through an ssh_config written per run (the delay proxy gives each host a port of its
own, which `-w` cannot say). pdsh is Debian's `pdsh` package (scripts/setup.sh installs it).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The one-shot script, published: what one pdsh sweep runs on every host.
ONE_SHOT = " ; ".join(
    [
        "nvidia-smi --query-gpu=index,pci.bus_id,name,uuid,driver_version,persistence_mode,temperature.gpu,"
        "ecc.errors.uncorrected.volatile.total,pstate,pcie.link.gen.current,pcie.link.width.current "
        "--format=csv,noheader",
        "nvidia-smi --query-remapped-rows=gpu_bus_id,remapped_rows.correctable,remapped_rows.uncorrectable,"
        "remapped_rows.pending,remapped_rows.failure --format=csv,noheader",
        "nvidia-smi nvlink -s",
        "nvidia-smi topo -p2p r",
        "dmesg --time-format iso | grep -E 'NVRM: Xid|SXid' | tail -n 50",
        "systemctl show -p ActiveState -p SubState sglang-qwen.service nvidia-persistenced.service",
    ]
)
GPUS = 4  # health-ok has 4 GPUs: each host's answer must hold a line for each


def available() -> str | None:
    """Return pdsh's path, or None when it is not installed."""
    return shutil.which("pdsh")


def write_ssh_config(path: Path, endpoints: Sequence[Any], identity: Path, known: Path) -> None:
    """Write an ssh_config with one Host block per lab host (name -> address and port), strict keys."""
    blocks = []
    for e in endpoints:
        blocks.append(
            f"Host {e.host.name}\n  HostName {e.address}\n  Port {e.port}\n  User root\n"
            f"  IdentityFile {identity}\n  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n"
            "  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
            "  LogLevel ERROR\n  ConnectTimeout 10\n  ControlMaster no\n  ControlPath none\n"
        )
    path.write_text("".join(blocks))


def sweep(
    tmp: Path,
    endpoints: Sequence[Any],
    identity: Path,
    known: Path,
    run: Callable[..., tuple[float, str, int, Any]],
) -> dict[str, Any]:
    """Run one pdsh sweep over `endpoints`; return its wall time and CPU account (as `run` gives)."""
    cfg = tmp / f"pdsh-ssh-{len(endpoints)}.conf"
    write_ssh_config(cfg, endpoints, identity, known)
    # pdsh's ssh module runs `ssh PDSH_SSH_ARGS COMMAND`: %h is the host, the rest from the config.
    env = dict(os.environ, PDSH_SSH_ARGS=f"-F {cfg} %h", PDSH_SSH_ARGS_APPEND="")
    names = ",".join(e.host.name for e in endpoints)
    took, out, rc, cpu = run(
        ["pdsh", "-R", "ssh", "-S", "-w", names, ONE_SHOT], env=env, hosts=[e.host for e in endpoints]
    )
    per_host = {e.host.name: 0 for e in endpoints}
    for line in out.splitlines():
        name, _, rest = line.partition(": ")
        if name in per_host and rest.count(",") >= 10 and rest.split(",")[0].strip().isdigit():
            per_host[name] += 1  # a --query-gpu line of this host
    short = {h: n for h, n in per_host.items() if n != GPUS}
    if rc != 0 or short:
        print(out[-3000:])
        raise SystemExit(f"pdsh sweep failed: rc={rc}, hosts without {GPUS} GPU lines: {short}")
    return {"wall": took, "cpu": cpu, "at": time.time()}


def _per_host(v: float | None, n: int) -> str:
    return "?" if v is None else f"{v / n * 1000:.0f}"


def compare(n: int, medians: dict[str, dict[str, Any]], goals: list[tuple[str, bool]]) -> None:
    """Print ours (with reports where measured) beside pdsh for `n` hosts; add the goals to `goals`.

    CPU per host: the controller's (pytest's processes; pdsh and its ssh clients) and the node's
    (the lab host's cgroup: sshd, the agent or the script, the tools, systemd; and, apart, its FUSE
    sysfs daemon, which stands in for the kernel's sysfs). Goals: 16 or more hosts within 1.5x of
    pdsh's time, fewer within 2x; CPU per host within 2x of pdsh's, controller and node.
    """
    p = medians["p"]
    walls = ", ".join(f"{w:.2f}" for w in p["walls"])
    print(f"hosts={n:<3} pdsh {p['wall']:6.2f} s (runs {walls}); CPU s {p['cpu'].line()}")
    pc, pn = p["cpu"].pytest / n, (p["cpu"].lab or 0) / n
    for k, label in (("o", "ours"), ("r", "ours with reports"), ("i", "ours with reports, on workers")):
        if k not in medians:
            continue
        o = medians[k]
        oc, on = o["cpu"].pytest / n, (o["cpu"].lab or 0) / n
        print(
            f"          {label} {o['wall']:.2f} s = {o['wall'] / p['wall']:.2f}x pdsh | CPU ms per host: "
            f"controller {oc * 1000:.0f} vs {pc * 1000:.0f} ({oc / pc:.1f}x), node {on * 1000:.0f} vs "
            f"{pn * 1000:.0f} ({on / pn if pn else float('nan'):.1f}x), sysfs {_per_host(o['cpu'].sysfs, n)} vs "
            f"{_per_host(p['cpu'].sysfs, n)}"
        )
    # The goals: ours as a nightly run runs it (with reports, the scheduling the plugin chooses).
    k = "r" if "r" in medians else "o"
    o = medians.get(k)
    if o is None:
        return
    label = {"r": "with reports", "o": "without reports"}[k]
    limit = 1.5 if n >= 16 else 2.0
    ratio = o["wall"] / p["wall"]
    goals.append((f"{n} hosts within {limit}x of pdsh ({label}: {ratio:.2f}x)", ratio <= limit))
    oc, on = o["cpu"].pytest / n, (o["cpu"].lab or 0) / n
    goals.append((f"{n} hosts: controller CPU per host within 2x of pdsh's ({oc / pc:.1f}x)", oc <= 2 * pc))
    if pn:
        goals.append(
            (
                f"{n} hosts: node CPU per host within 2x of the one-shot script's ({on / pn:.1f}x)",
                on <= 2 * pn,
            )
        )

"""Run inside a gpulab.vm guest: the kernel behaviours through the project's own agent and modules.

``python -m gpulab.vm.guest behaviours`` opens the project's connection to ``local://`` (the
agent started as on any target) and drives the real kernel with the code paths suites/p2p uses
on real hosts: ``modules.iommu.set_type`` (the watched write, its errno explained per kernel
era, the read-back), ``modules.pci.bind``/``unbind``, the agent's watched ``write_file`` for
``driver_override``, ``drivers_probe``, ``remove`` and ``rescan``, ``read_files`` of
``/sys/module``, and the ``gpu_holders`` fact with ``modules.gpu.open_counts`` and
``kernel_holders`` for module references. It prints ``topology JSON`` (every PCI function with
its parent, IOMMU group, driver and the bridges' ACS state as the agent's ``pci_paths`` probe
reads it) and one ``KEY VALUE`` line per behaviour; ``says KEY MESSAGE`` lines carry the
modules' messages.

The devices are QEMU's e1000e and e1000, found by where they sit (gpulab.vm.TOPOLOGY), never
passed off as GPUs: only the generic PCI and IOMMU paths run here.

``python -m gpulab.vm.guest boot-unit`` is the systemd guest's driver (see ``boot_unit``).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pytest_gpuhost.exec.agent.probe_pci_path import port
from pytest_gpuhost.exec.connect import connect as agent_connect
from pytest_gpuhost.exec.connection import Connection, ConnectionOptions
from pytest_gpuhost.exec.launch import LocalLauncher
from pytest_gpuhost.modules import gpu, iommu, pci

__all__ = ["behaviours", "boot_unit", "connect", "main", "roles", "topology"]

SYS_PCI = Path("/sys/bus/pci/devices")
TUN = "/dev/net/tun"
E1000E, E1000 = "0x8086:0x10d3", "0x8086:0x100e"
# what modules/gpu.py reads under /sys/module/M/ besides parameters/ and version
SUITE_MODULE_FILES = ("holders", "initstate", "refcnt")


def connect() -> Connection:
    """The project's connection to this machine, as ``--host=local://`` opens it, with bounds for TCG.

    exec.targets.open_connection() for ``local://`` is this call; the URL parsing and the SSH
    transports it would import cost seconds of a TCG guest's CPU and are not under test.
    """
    return agent_connect(
        "vm", LocalLauncher(), ConnectionOptions(command_timeout=60.0, connect_timeout=120.0)
    )


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return ""


def _link(p: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(p))
    except OSError:
        return None


def topology() -> dict[str, dict[str, Any]]:
    """Every PCI function: vendor:device, class, parent bridge, group, driver, and a bridge's port and ACS."""
    out: dict[str, dict[str, Any]] = {}
    for d in sorted(SYS_PCI.iterdir()):
        parent = Path(os.path.realpath(d)).parent.name
        klass = _read(d / "class")
        entry: dict[str, Any] = {
            "id": f"{_read(d / 'vendor')}:{_read(d / 'device')}",
            "class": klass,
            "parent": parent if pci.BDF_RE.match(parent) else None,
            "group": int(g) if (g := _link(d / "iommu_group")) else None,
            "driver": _link(d / "driver"),
        }
        if klass.startswith("0x0604"):
            p = port(d.name)  # the agent's own reader of the PCIe type and the ACS capability
            entry["port"], entry["acs"] = p["type"], p["acs"]
        out[d.name] = entry
    return out


def roles(topo: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Name the devices of gpulab.vm.TOPOLOGY by where they sit (bus numbers are the firmware's)."""
    found: dict[str, str] = {}
    e1000e = sorted(b for b, f in topo.items() if f["id"] == E1000E)
    for b in e1000e:
        up = topo.get(topo[b]["parent"] or "", {})
        if up.get("port") == "downstream":
            found["switch_a" if "switch_a" not in found else "switch_b"] = b
        elif up.get("port") == "root" and (up.get("acs") or {}).get("present"):
            found["single"] = b
        elif up.get("port") == "root":
            found["noacs"] = b
    for i, b in enumerate(sorted(b for b, f in topo.items() if f["id"] == E1000)):
        found[f"bridged_{i}"] = b
    return found


def _errname(code: int | None) -> str:
    return errno.errorcode.get(code or 0, str(code)) if code else "ok"


class _Rows:
    """KEY VALUE rows, and the modules' messages, in the order they were taken."""

    def __init__(self) -> None:
        self.rows: dict[str, str] = {}
        self.says: dict[str, str] = {}

    def take(self, key: str, fn: Callable[[], object]) -> None:
        try:
            self.rows[key] = str(fn())
        except Exception as e:  # a behaviour that breaks is a row, not the end of the run
            self.rows[key] = f"error:{type(e).__name__}"
            self.says[key] = str(e)


def behaviours(conn: Connection, topo: dict[str, dict[str, Any]]) -> _Rows:
    """Run every behaviour of the differential table on this kernel, through ``conn``'s agent."""
    kernel = str(conn.hello.get("kernel") or os.uname().release)
    r = _Rows()
    role = roles(topo)
    dev = {k: b for k, b in role.items()}
    group = {k: topo[b]["group"] for k, b in dev.items()}

    def members(g: int) -> iommu.IommuGroup:
        names = sorted(os.listdir(f"{iommu.GROUPS}/{g}/devices"))
        fns = [pci.PciFunction(bdf=b, driver=_link(SYS_PCI / b / "driver"), iommu_group=g) for b in names]
        return iommu.IommuGroup(g, _read(Path(iommu.type_path(g))), fns)

    def set_type(key: str, g: int, value: str) -> str:
        try:
            now = iommu.set_type(conn, members(g), value, kernel=kernel)
        except iommu.TypeReadBack as e:
            r.says[key] = str(e)
            return f"readback:{e.now}"
        except iommu.IommuError as e:
            r.says[key] = str(e)
            return _errname(e.args[0])
        return f"ok {now}"

    def write(path: str, data: str) -> str:
        res = conn.write_file(path, data, timeout=10)
        return "timeout" if res.timed_out else _errname(None if res.ok else res.errno)

    def bind(key: str, bdf: str, drv: str, verb: Callable[..., None]) -> str:
        try:
            verb(conn, bdf, drv, timeout=10)
        except pci.PciError as e:
            r.says[key] = str(e)
            return _errname(e.args[0])
        return "ok"

    def size(k: str) -> int:
        return len(members(group[k]).members)

    def has_driver(bdf: str) -> str:
        return "present" if _link(SYS_PCI / bdf / "driver") else "absent"

    one, b0, b1 = dev["single"], dev["bridged_0"], dev["bridged_1"]
    g1, gb = group["single"], group["bridged_0"]
    r.take("single_bound_initial", lambda: members(g1).type)
    r.take("single_bound_identity", lambda: set_type("single_bound_identity", g1, "identity"))
    r.take("single_bound_readback", lambda: members(g1).type)
    for b in (b0, b1):
        if not _link(SYS_PCI / b / "driver"):
            pci.bind(conn, b, "e1000", timeout=10)
    r.take("multi_members", lambda: len(members(gb).members))
    r.take("multi_members_bound", lambda: len(members(gb).bound))
    r.take("multi_bound_identity", lambda: set_type("multi_bound_identity", gb, "identity"))
    # one member unbound, the other still bound (a GPU unbound while its audio function keeps its driver)
    r.take("multi_one_unbind", partial(bind, "multi_one_unbind", b0, "e1000", pci.unbind))
    r.take("multi_one_bound_identity", lambda: set_type("multi_one_bound_identity", gb, "identity"))
    r.take("multi_one_rebind", partial(bind, "multi_one_rebind", b0, "e1000", pci.bind))
    for b in (b0, b1):
        r.take(f"multi_unbind_{b == b1:d}", partial(bind, "multi_unbind", b, "e1000", pci.unbind))
    r.take("multi_unbound_identity", lambda: set_type("multi_unbound_identity", gb, "identity"))
    r.take("unbind", lambda: bind("unbind", one, "e1000e", pci.unbind))
    r.take("unbind_driver_link", lambda: has_driver(one))
    r.take("unbind_unbound", lambda: bind("unbind_unbound", one, "e1000e", pci.unbind))
    for v in ("identity", "DMA", "DMA-FQ", "auto"):
        r.take(f"single_unbound_{v}", partial(set_type, f"single_unbound_{v}", g1, v))
    r.take("bind_write", lambda: bind("bind_write", one, "e1000e", pci.bind))
    r.take("bind_driver_link", lambda: has_driver(one))
    r.take("bind_driver_name", lambda: _link(SYS_PCI / one / "driver"))
    r.take("bind_bound", lambda: bind("bind_bound", one, "e1000e", pci.bind))
    r.take("bind_wrong_driver", lambda: bind("bind_wrong_driver", b0, "e1000e", pci.bind))
    pci.unbind(conn, one, "e1000e", timeout=10)
    r.take("override_write", lambda: write(f"{pci.DEVICES}/{one}/driver_override", "e1000e"))
    r.take("override_probe", lambda: f"{write('/sys/bus/pci/drivers_probe', one)} {has_driver(one)}")
    r.take("override_driver_name", lambda: _link(SYS_PCI / one / "driver"))
    r.take("override_clear", lambda: write(f"{pci.DEVICES}/{one}/driver_override", "\n"))
    r.take("remove_write", lambda: f"{write(f'{pci.DEVICES}/{b1}/remove', '1')} {has_path(b1)}")
    r.take("rescan_write", lambda: f"{write('/sys/bus/pci/rescan', '1')} {has_path(b1)}")
    # a group whose only member is a root port on pcieport, a driver that manages its own DMA
    r.take(
        "port_group_identity",
        lambda: set_type("port_group_identity", topo[topo[one]["parent"]]["group"], "identity"),
    )
    for k in ("switch_a", "switch_b", "noacs"):
        r.take(f"{k}_group_size", partial(size, k))
    r.take("switch_shared_group", lambda: "yes" if group["switch_a"] == group["switch_b"] else "no")
    _module_rows(conn, r)
    return r


def has_path(bdf: str) -> str:
    return "present" if (SYS_PCI / bdf).exists() else "absent"


def _module_rows(conn: Connection, r: _Rows) -> None:
    """References a character device's module takes per open file, and what the suite decides from them."""
    refcnt = "/sys/module/tun/refcnt"

    def count() -> int:
        text = conn.read_files([refcnt])[refcnt]
        return int(text) if isinstance(text, str) else -1

    def descriptors() -> int:
        held = gpu.open_counts(gpu.parse_holders(conn.facts("gpu_holders", prefix=TUN).get("gpu_holders")))
        return held.get(TUN, 0)

    def verdict(n: int, fds: int) -> str:  # the uvm rule, fed tun's numbers
        found = gpu.kernel_holders({gpu.UVM_REFCNT: str(n)}, {"/dev/nvidia-uvm": fds})
        return "kernel-holder" if found else "none"

    base = count()
    r.take("refcnt_0", lambda: count() - base)
    fd1 = os.open(TUN, os.O_RDWR)
    r.take("refcnt_open1", lambda: count() - base)
    fd2 = os.open(TUN, os.O_RDWR)
    r.take("refcnt_open2", lambda: count() - base)
    dup = os.dup(fd1)
    r.take("refcnt_dup", lambda: count() - base)
    os.close(dup)
    rfd, wfd = os.pipe()
    child = os.fork()
    if child == 0:  # holds the inherited descriptors until killed
        os.close(rfd)
        os.write(wfd, b"x")
        time.sleep(120)
        os._exit(0)
    os.close(wfd)
    os.read(rfd, 1)
    r.take("refcnt_fork", lambda: count() - base)
    r.take("descriptors_fork", descriptors)
    r.take("holder_verdict_fork", lambda: verdict(count(), descriptors()))
    os.kill(child, 9)
    os.waitpid(child, 0)
    os.close(rfd)
    r.take("holder_verdict_open2", lambda: verdict(count(), descriptors()))
    os.close(fd1)
    os.close(fd2)
    r.take("refcnt_closed", lambda: count() - base)
    r.take("node_type", lambda: conn.run(["stat", "-c", "%F", TUN]).stdout.strip().replace(" ", "_"))
    r.take(
        "module_files",
        lambda: ",".join(
            sorted(
                {Path(p).name for p in conn.call("glob", pattern="/sys/module/tun/*")}
                & set(SUITE_MODULE_FILES)
            )
        ),
    )
    r.take(
        "module_files_all",
        lambda: ",".join(Path(p).name for p in conn.call("glob", pattern="/sys/module/tun/*")),
    )
    version = (
        "/sys/module/8139too/version"  # MODULE_VERSION("0.9.28") in drivers/net/ethernet/realtek/8139too.c
    )
    r.take("module_version", lambda: str(conn.read_files([version])[version]).strip())
    r.take(
        "module_version_file",
        lambda: "present" if isinstance(conn.read_files([version])[version], str) else "absent",
    )


STATE = Path("/var/lib/gpuhost-vm")  # on the systemd guest's disk: survives its reboot
STANDINS = ("lxc.service", "pve-guests.service")  # GPU users the boot unit orders itself before
UNIT_GROUPS = ("single", "noacs", "bridged_0")


def _plan(conn: Connection, topo: dict[str, dict[str, Any]], kernel: str) -> Any:
    """A suites/p2p plan for the guest's groups: each bound member recorded with its driver.

    Built from the plan's own dataclasses, with ``is_gpu`` false: the script's code paths are
    the generic ones (unbind, type write, EXIT-trap rebind), nothing takes an e1000e for a GPU.
    The bridge's second e1000 is unbound first, as a GPU's audio function may have no driver when
    the suite runs: the script then records only the first, and at boot the second is bound again
    by its driver, so that group's identity write fails on the real kernel.
    """
    from pytest_gpuhost.modules.p2p_plan import FunctionPlan, GroupPlan, P2PPlan

    role = roles(topo)
    pci.unbind(conn, role["bridged_1"], "e1000", timeout=10)
    groups = []
    for k in UNIT_GROUPS:
        g = topo[role[k]]["group"]
        members = sorted(os.listdir(f"{iommu.GROUPS}/{g}/devices"))
        fns, kept = [], []
        for b in members:
            drv = _link(SYS_PCI / b / "driver")
            if drv and iommu.blocks_type_change(drv, kernel):
                fns.append(FunctionPlan(bdf=b, driver=drv, current=drv, is_gpu=False))
            elif drv:
                kept.append(b)
        t = _read(Path(iommu.type_path(g)))
        groups.append(GroupPlan(number=g, type=t, original_type=t, functions=fns, kept=kept, members=members))
    return P2PPlan(gpus=[], groups=groups, excluded={}, errors=[], kernel=kernel)


def _install(conn: Connection, plan: Any, say: Callable[[str], None]) -> None:
    """Install the boot unit as suites/p2p's step 8 does (suites/p2p/restore.py, step_persisted's fix)."""
    from pytest_gpuhost.modules import p2p_boot as persist

    for path, text in ((persist.SCRIPT, persist.script_text(plan)), (persist.UNIT, persist.unit_text())):
        w = conn.write_file(path, text, timeout=15)
        say(f"write {path} {'ok' if w.ok else w.error}")
    for argv in (
        ["chmod", "0755", persist.SCRIPT],
        ["systemctl", "daemon-reload"],
        ["systemctl", "reenable", persist.UNIT_NAME],
    ):
        res = conn.run(argv, timeout=60)
        say(f"run {argv[0]}_{argv[1]} rc={res.rc}")


def _show(conn: Connection, unit: str, props: str) -> dict[str, str]:
    res = conn.run(["systemctl", "show", "-p", props, *([unit] if unit else [])], timeout=30)
    return dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)


def _analyze(conn: Connection, say: Callable[[str], None]) -> None:
    """Where this boot's time went (seconds since the kernel started), for the CI budget.

    systemd-analyze answers only once the boot has finished, which it has not while this runs.
    """
    show = _show(conn, "", "UserspaceTimestampMonotonic")  # the manager itself
    marks = {"userspace": show.get("UserspaceTimestampMonotonic", "0")}
    for unit in ("sysinit.target", "basic.target", "systemd-udev-trigger.service"):
        marks[unit] = _show(conn, unit, "ActiveEnterTimestampMonotonic").get(
            "ActiveEnterTimestampMonotonic", "0"
        )
    for key, value in marks.items():
        say(f"timing {key} {int(value or 0) / 1e6:.1f}")


def boot_unit() -> str:
    """The systemd guest's driver, run at each boot by a unit ordered after the boot unit and its users.

    Boot 1: plan the guest's groups, install suites/p2p's boot unit for them, reboot for real.
    Boot 2: report what the boot unit left (group types, drivers, its result and journal) and what
    the stand-in GPU users saw when systemd started them, then power off. Lines go to ttyS1 as
    ``bootN KEY VALUE``. Returns the action ("reboot", "poweroff") for ``main`` to start once the
    agent is closed: a driver still running when the reboot stops units would be killed.
    """
    from pytest_gpuhost.modules import p2p_boot as persist

    out = open("/dev/ttyS1", "w")  # noqa: SIM115 (held until the guest goes down)
    phase = _read(STATE / "phase") or "1"

    def say(line: str) -> None:
        out.write(f"boot{phase} {line}\n")
        out.flush()

    say(f"boot_id {_read(Path('/proc/sys/kernel/random/boot_id'))}")
    say(f"pid1 {_read(Path('/proc/1/comm'))}")
    say(f"uptime {_read(Path('/proc/uptime')).split()[0]}")
    with connect() as conn:
        topo = topology()
        role = roles(topo)
        kernel = str(conn.hello.get("kernel") or os.uname().release)
        for k in (*UNIT_GROUPS, "bridged_1"):
            say(f"role {k} {role[k]} {topo[role[k]]['group']}")
        if phase == "1":
            plan = _plan(conn, topo, kernel)
            for g in plan.groups:
                say(f"plan group {g.number} {g.type} {' '.join(f.bdf + '=' + f.driver for f in g.functions)}")
            _install(conn, plan, say)
            STATE.mkdir(parents=True, exist_ok=True)
            (STATE / "phase").write_text("2\n")
            os.sync()
            _analyze(conn, say)
            say("@@END@@")
            return "reboot"
        for k in (*UNIT_GROUPS, "bridged_1"):
            g = topo[role[k]]["group"]
            say(f"group {k} {_read(Path(iommu.type_path(g)))}")
            say(f"driver {k} {_link(SYS_PCI / role[k] / 'driver')}")
        for key, value in _show(
            conn, persist.UNIT_NAME, "Result,ExecMainStatus,ExecMainExitTimestampMonotonic"
        ).items():
            say(f"unit {key} {value}")
        for name in STANDINS:
            for key, value in _show(conn, name, "ExecMainStartTimestampMonotonic").items():
                say(f"standin {name} {key} {value}")
            for line in _read(STATE / f"seen-{name}").splitlines():
                say(f"seen {name} {line}")
        kmsg = conn.run(["dmesg"], timeout=30)  # the drivers' and the IOMMU's lines, for a failure's reader
        for line in kmsg.stdout.splitlines():
            if any(w in line for w in ("e1000", "DMAR", "AMD-Vi", "iommu", "Freeing initrd")):
                say(f"kmsg {' '.join(line.split())}")
        log = conn.run(["journalctl", "-b", "-u", persist.UNIT_NAME, "-o", "cat", "--no-pager"], timeout=30)
        for line in log.stdout.splitlines():
            say(f"journal {line}")
        _analyze(conn, say)
        say("@@END@@")
    return "poweroff"


def _emit(out: Any, topo: dict[str, Any], r: _Rows) -> None:
    out.write(f"topology {json.dumps(topo, sort_keys=True)}\n")
    for k, v in r.rows.items():
        out.write(f"{k} {v}\n")
    for k, v in r.says.items():
        out.write(f"says {k} {' '.join(v.split())}\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m gpulab.vm.guest")
    ap.add_argument("what", choices=("behaviours", "boot-unit"))
    args = ap.parse_args(argv)
    if args.what == "boot-unit":
        action = boot_unit()
        os.execv("/bin/systemctl", ["systemctl", "--no-block", action])
    t = time.monotonic()
    with connect() as conn:
        sys.stdout.write(f"timing agent_start_s {time.monotonic() - t:.1f}\n")
        topo = topology()
        r = behaviours(conn, topo)
    _emit(sys.stdout, topo, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())

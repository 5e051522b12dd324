"""The FUSE lab against Debian's real 6.1 and 6.12 kernels under QEMU (Intel and AMD IOMMU).

Each VM boots once per session and runs gpulab/vm/guest.py: the project's agent (``local://``
inside the guest) and modules drive the real kernel, one ``KEY VALUE`` line per behaviour. The
lab side runs the same operations on a standalone sysfs mount of proxmox-rtx6000 at the same
kernel version (GPU group 30 for the multi-device rows, GPU 1 for bind and unbind, root port
group 10 for a group whose only driver manages its own DMA), module references on the lab's
``nvidia_uvm`` (the VM's are on ``tun``), the suite's holder count through a ``local://`` agent
on this machine, and device nodes from the lab host's ``/dev`` (gpulab.host.boot.make_dev). IOMMU
grouping is compared by giving ``gpulab.kernel.acs.kernel_group_partition()`` the PCI tree and
ACS bits each guest read and holding its answer to the guest's own groups.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gpulab import vm
from gpulab.kernel.acs import kernel_group_partition
from gpulab.profiles.types import PciFunction, Profile
from gpulab.vm import guest

StandaloneMount = pytest.importorskip(
    "gpulab.kernel.sysfs", reason="the lab's sysfs needs mfusepy and libfuse", exc_type=ImportError
).StandaloneMount

pytestmark = pytest.mark.realkernel
VMS = [("6.1", "intel"), ("6.1", "amd"), ("6.12", "intel"), ("6.12", "amd")]

# Rows the lab cannot show, and why (every other row has a lab value compared with each VM of
# its kernel series).
NO_LAB = {
    "single_bound_identity": "the lab has no single-device group with a DMA-API driver (GPUs have an audio function)",
    "single_bound_readback": "as above",
    "single_unbound_identity": "as above",
    "single_unbound_DMA": "as above",
    "single_unbound_DMA-FQ": "as above",
    "single_unbound_auto": "as above",
    "multi_members": "QEMU's bridge group holds 3 functions, the lab's GPU group 2",
    "switch_a_group_size": "compared by kernel_group_partition() (test_grouping_matches_the_lab_rules)",
    "switch_b_group_size": "as above",
    "noacs_group_size": "as above",
    "switch_shared_group": "as above",
    "module_version": "the value is the module's own (8139too 0.9.28; the lab's nvidia shows its driver version)",
    "module_files_all": "tun's own files; the suite reads holders, initstate and refcnt (module_files)",
    "bind_driver_name": "the device's own driver (e1000e; nvidia on the lab)",
    "override_driver_name": "as above",
    "remove_write": "the lab refuses removal (EPERM): no suite removes a device, and nobody may rehearse it",
    "rescan_write": "as above (the lab's rescan is a no-op)",
}
# Rows whose value depends on QEMU's IOMMU model rather than the kernel: compared on Intel only.
INTEL_ONLY = {
    "single_bound_initial": "Intel only: QEMU's AMD-Vi starts groups in DMA (strict), a real EPYC in DMA-FQ",
}


def _w(p: Path, v: str) -> str:
    try:
        fd = os.open(p, os.O_WRONLY)
        try:
            os.write(fd, (v + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))
    return "ok"


def _type(mnt: Path, g: int) -> str:
    return (mnt / f"iommu_groups/{g}/type").read_text().strip()


def _set(mnt: Path, g: int, v: str) -> str:
    r = _w(mnt / f"iommu_groups/{g}/type", v)
    return f"ok {_type(mnt, g)}" if r == "ok" else r


def _lab_holders(dev: Path) -> int:
    """Descriptors of ``dev/nvidia-uvm`` as the suite counts them: the agent's ``gpu_holders`` fact."""
    from pytest_gpuhost.exec.targets import open_connection, parse_host_url
    from pytest_gpuhost.modules import gpu

    with open_connection(parse_host_url("local://", name="lab")) as conn:
        raw = conn.facts("gpu_holders", prefix=str(dev)).get("gpu_holders")
    return gpu.open_counts(gpu.parse_holders(raw)).get(str(dev / "nvidia-uvm"), 0)


def _verdict(refcnt: int, fds: int) -> str:
    from pytest_gpuhost.modules import gpu

    found = gpu.kernel_holders({gpu.UVM_REFCNT: str(refcnt)}, {"/dev/nvidia-uvm": fds})
    return "kernel-holder" if found else "none"


def lab_rows(kernel: str, tmp: Path) -> dict[str, str]:
    """The behaviours the lab can show, on proxmox-rtx6000 at ``kernel``, keyed like the guest's rows."""
    rows: dict[str, str] = {}
    with StandaloneMount("proxmox-rtx6000", tmp, kernel=kernel) as m:
        mnt, dev = Path(m.mnt), Path(m.dev)
        drv = mnt / "pci/drivers"
        # the lab's links are absolute (/sys/bus/pci/drivers/...): they resolve only inside a lab host
        has = lambda b: "present" if (mnt / f"pci/devices/{b}/driver").is_symlink() else "absent"  # noqa: E731
        rows["single_bound_initial"] = _type(mnt, 30)  # the profile's starting type (a real host's)
        rows["multi_members_bound"] = str(sum(has(f"0000:17:00.{i}") == "present" for i in (0, 1)))
        rows["multi_bound_identity"] = _set(mnt, 30, "identity")
        rows["multi_one_unbind"] = _w(
            drv / "nvidia/unbind", "0000:17:00.0"
        )  # the audio function keeps its driver
        rows["multi_one_bound_identity"] = _set(mnt, 30, "identity")
        rows["multi_one_rebind"] = _w(drv / "nvidia/bind", "0000:17:00.0")
        rows["multi_unbind_0"] = _w(drv / "nvidia/unbind", "0000:17:00.0")
        rows["multi_unbind_1"] = _w(drv / "snd_hda_intel/unbind", "0000:17:00.1")
        rows["multi_unbound_identity"] = _set(mnt, 30, "identity")
        rows["unbind"] = _w(drv / "nvidia/unbind", "0000:18:00.0")
        rows["unbind_driver_link"] = has("0000:18:00.0")
        rows["unbind_unbound"] = _w(drv / "nvidia/unbind", "0000:18:00.0")
        rows["bind_write"] = _w(drv / "nvidia/bind", "0000:18:00.0")
        rows["bind_driver_link"] = has("0000:18:00.0")
        rows["bind_bound"] = _w(drv / "nvidia/bind", "0000:18:00.0")
        rows["bind_wrong_driver"] = _w(drv / "nvidia/bind", "0000:17:00.1")  # the audio function, unbound
        _w(drv / "nvidia/unbind", "0000:18:00.0")
        rows["override_write"] = _w(mnt / "pci/devices/0000:18:00.0/driver_override", "nvidia")
        rows["override_probe"] = f"{_w(mnt / 'pci/drivers_probe', '0000:18:00.0')} {has('0000:18:00.0')}"
        rows["override_clear"] = _w(mnt / "pci/devices/0000:18:00.0/driver_override", "")
        rows["port_group_identity"] = _set(mnt, 10, "identity")
        # module references: open, a second open, dup, fork, close of the lab's /dev/nvidia-uvm
        refcnt = mnt / "module/nvidia_uvm/refcnt"
        count = lambda: int(refcnt.read_text())  # noqa: E731
        base = count()
        rows["refcnt_0"] = str(count() - base)
        fd1 = os.open(dev / "nvidia-uvm", os.O_RDWR)
        rows["refcnt_open1"] = str(count() - base)
        fd2 = os.open(dev / "nvidia-uvm", os.O_RDWR)
        rows["refcnt_open2"] = str(count() - base)
        d = os.dup(fd1)
        rows["refcnt_dup"] = str(count() - base)
        os.close(d)
        child = subprocess.Popen(["sleep", "60"], pass_fds=(fd1, fd2))  # inherits both open files
        try:
            rows["refcnt_fork"] = str(count() - base)
            rows["descriptors_fork"] = str(_lab_holders(dev))
            rows["holder_verdict_fork"] = _verdict(count(), _lab_holders(dev))
        finally:
            child.kill()
            child.wait()
        rows["holder_verdict_open2"] = _verdict(count(), _lab_holders(dev))
        os.close(fd1)
        os.close(fd2)
        rows["refcnt_closed"] = str(count() - base)
        files = set(os.listdir(mnt / "module/nvidia_uvm"))
        rows["module_files"] = ",".join(sorted(files & set(guest.SUITE_MODULE_FILES)))
        rows["module_version_file"] = "present" if (mnt / "module/nvidia/version").exists() else "absent"
    from gpulab.host import boot

    nodes = tmp / "dev"
    boot.make_dev(nodes, [0])
    try:
        mode = os.stat(nodes / "nvidia-uvm").st_mode
        rows["node_type"] = "character_special_file" if stat.S_ISCHR(mode) else "regular_file"
    finally:
        subprocess.run(["umount", str(nodes)], check=False)
    return rows


def _parse(body: str) -> dict[str, Any]:
    import json

    rows: dict[str, str] = {}
    says: dict[str, str] = {}
    topo: dict[str, Any] = {}
    timing: dict[str, str] = {}
    for line in body.splitlines():
        key, _, value = line.partition(" ")
        if key == "topology":
            topo = json.loads(value)
        elif key == "timing":
            k, _, v = value.partition(" ")
            timing[k] = v
        elif key == "says":
            k, _, msg = value.partition(" ")
            says[k] = msg
        elif value:
            rows[key] = value
    return {"rows": rows, "says": says, "topology": topo, "timing": timing}


@pytest.fixture(scope="session")
def real() -> dict[str, dict[str, Any]]:
    why = vm.available()
    if why:
        pytest.skip(why)
    out = {}
    for k, iommu in VMS:
        t = time.monotonic()
        body, boot_s = vm.run(k, iommu, vm.guest_command("behaviours"))
        got = _parse(body)
        print(
            f"{k}/{iommu}: kernel to command {boot_s:.1f} s (guest uptime), agent start "
            f"{got['timing'].get('agent_start_s')} s, boot + behaviours {time.monotonic() - t:.1f} s"
        )
        assert got["rows"], f"{k}/{iommu}: no rows: {body[-3000:]}"
        out[f"{k}/{iommu}"] = got
    return out


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    return {
        k: lab_rows(f"{k}.0", tmp_path_factory.mktemp(f"lab{k.replace('.', '_')}")) for k in ("6.1", "6.12")
    }


def test_differential_table(real: dict[str, dict[str, Any]], lab: dict[str, dict[str, str]]) -> None:
    cols = [f"{k}/{i}" for k, i in VMS]
    keys = list(real["6.12/intel"]["rows"])
    print("\n| behaviour | lab 6.1 | lab 6.12 | " + " | ".join(cols) + " | lab compared |")
    print("|---" * (len(cols) + 4) + "|")
    bad = []
    for key in keys:
        vals = [real[c]["rows"].get(key, "-") for c in cols]
        lv = {k: lab[k].get(key) for k in lab}
        cells = [lv["6.1"] or "-", lv["6.12"] or "-"]
        note = NO_LAB.get(key) or INTEL_ONLY.get(key) or "yes"
        print(f"| `{key}` | " + " | ".join(cells + vals) + f" | {note} |")
        if key in NO_LAB:
            continue
        for c, v in zip(cols, vals, strict=True):
            series = c.split("/")[0]
            if lv[series] is None:
                bad.append(f"{key}: no lab value (add it, or say why in NO_LAB)")
            elif (key not in INTEL_ONLY or c.endswith("intel")) and lv[series] != v:
                bad.append(f"{key} on {c}: lab {lv[series]!r}, kernel {v!r}")
    assert not bad, "the lab disagrees with the real kernel:\n" + "\n".join(dict.fromkeys(bad))


def _profile(topo: dict[str, dict[str, Any]], kernel: str) -> Profile:
    """A lab profile of the guest's PCI tree, with the ACS capability and control bits it read."""
    pci = tuple(
        PciFunction(
            bdf=b,
            vendor=f["id"].split(":")[0],
            device=f["id"].split(":")[1],
            klass=f["class"],
            driver=f["driver"],
            iommu_group=f["group"],
            numa_node=0,
            parent=f["parent"],
            link=None,
            subsystem_vendor="",
            subsystem_device="",
            acs=tuple((f.get("acs") or {}).get("ctl") or ()),
            acs_cap=tuple((f.get("acs") or {}).get("cap") or ()),
        )
        for b, f in sorted(topo.items())
    )
    return Profile(
        name="qemu",
        hostname="qemu",
        kernel=kernel,
        cmdline="",
        default_domain="DMA-FQ",
        driver_version="",
        cuda_version="",
        pci=pci,
        gpus=(),
        links=(),
        link_default=None,
        kernel_log=(),
        containers=(),
        services=(),
        files=(),
    )


def test_grouping_matches_the_lab_rules(real: dict[str, dict[str, Any]]) -> None:
    """kernel_group_partition(), given each guest's PCI tree and ACS bits, gives the guest's own groups."""
    for col, got in real.items():
        topo = got["topology"]
        prof = _profile(topo, col.split("/")[0])
        want = sorted(sorted(s) for s in kernel_group_partition(prof))  # acs: the control bits read
        have: dict[int, list[str]] = {}
        for b, f in topo.items():
            if f["group"] is not None:
                have.setdefault(f["group"], []).append(b)
        assert sorted(sorted(m) for m in have.values()) == want, col
        role = guest.roles(topo)
        # a switch whose downstream ports have no ACS: each endpoint shares its port's group only
        assert got["rows"]["switch_shared_group"] == "no", col
        for k in ("switch_a", "switch_b"):
            members = {b for b, f in topo.items() if f["group"] == topo[role[k]]["group"]}
            assert members == {role[k], topo[role[k]]["parent"]}, (col, k, members)


def test_real_kernel_facts(real: dict[str, dict[str, Any]]) -> None:
    """What the issue measured, and what the modules say about it, on every VM."""
    for col, got in real.items():
        r, says = got["rows"], got["says"]
        old = col.startswith("6.1/")
        assert r["refcnt_open1"] == "2" and r["refcnt_open2"] == "4", col  # cdev_get + fops_get
        assert r["refcnt_dup"] == "4" and r["refcnt_fork"] == "4", col  # dup and fork share the file
        assert r["holder_verdict_fork"] == "none" and r["holder_verdict_open2"] == "none", col
        assert r["node_type"] == "character_special_file", col
        assert r["single_bound_identity"] == ("EBUSY" if old else "EPERM"), col
        assert ("EBUSY: device still bound" if old else "6.4+) refuses while group->owner_cnt") in says[
            "single_bound_identity"
        ], col
        assert r["multi_members"] == "3" and r["multi_members_bound"] == "2", col
        assert r["multi_bound_identity"] == ("EINVAL" if old else "EPERM"), col
        assert r["multi_unbound_identity"] == ("EINVAL" if old else "ok identity"), col
        if old:
            assert "cannot change the type of a group with 3 devices" in says["multi_unbound_identity"], col
        assert r["port_group_identity"] == ("EBUSY" if old else "ok identity"), col
        assert r["unbind_driver_link"] == "absent" and r["bind_driver_link"] == "present", col
        assert r["unbind_unbound"] == "ENODEV" and r["bind_bound"] == "EBUSY", col
        assert r["bind_wrong_driver"] == "ENODEV", col
        assert r["override_probe"] == "ok present" and r["rescan_write"] == "ok present", col
        assert r["module_version"] == "0.9.28", col
        initial = "DMA-FQ" if col.endswith("intel") else "DMA"  # QEMU's AMD-Vi: strict (see LAB-SOURCES.md)
        assert r["single_bound_initial"] == initial and r["single_unbound_auto"] == f"ok {initial}", col

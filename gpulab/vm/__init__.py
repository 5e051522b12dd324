"""Real-kernel tier of the lab: Debian kernels booted under QEMU with an emulated IOMMU.

Everything comes from Debian packages (``apt-get download`` of the unsigned kernel images,
busybox-static, cpio); nothing else is downloaded. ``build(kernel)`` extracts one kernel and
the few modules a behaviour needs into a busybox initramfs cached under ``CACHE``;
``run(kernel, iommu, script)`` boots it under TCG with a q35 topology of root ports (one with
ACS, one with ``disable-acs=on``) and e1000e devices, runs a busybox shell ``script`` as PID 1's
child and returns its console output between markers.

The sysfs operations run as a busybox script, not the project's agent: the agent needs
python3, which means sharing the host's tree over 9p, and 9p under TCG was not built in the
time this tier had (see docs/LAB-SOURCES.md).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["BEHAVIOURS", "CACHE", "KERNELS", "VmUnavailable", "available", "build", "run"]

BEHAVIOURS = Path(__file__).with_name("behaviours.sh")

CACHE = Path(os.environ.get("GPUHOST_VM_CACHE", "/var/cache/gpuhost-vm"))

# name -> glob of the unsigned Debian image package fetched by scripts/setup.sh
KERNELS = {
    "6.1": "linux-image-6.1.0-*-amd64-unsigned_*.deb",
    "6.12": "linux-image-6.12.*+deb12-amd64-unsigned_*.deb",
}
MODULES = ("e1000e", "e1000", "i2c-dev", "tun")
BEGIN, END = "@@BEGIN@@", "@@END@@"


class VmUnavailable(RuntimeError):
    """Why a VM cannot be built or booted here (a test skips with this text)."""


def _deb(kernel: str) -> Path:
    hits = sorted(glob.glob(str(CACHE / "debs" / KERNELS[kernel])))
    if not hits:
        raise VmUnavailable(f"no {KERNELS[kernel]} in {CACHE / 'debs'} (scripts/setup.sh fetches it)")
    return Path(hits[-1])


def available() -> str | None:
    """None when VMs can run here, else the reason."""
    for tool in ("qemu-system-x86_64", "cpio", "dpkg-deb", "/sbin/depmod", "xz"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (scripts/setup.sh installs it)"
    if not Path("/bin/busybox").exists():
        return "busybox-static not installed (scripts/setup.sh installs it)"
    try:
        for k in KERNELS:
            _deb(k)
    except VmUnavailable as e:
        return str(e)
    return None


INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /lib/modules/$m 2>/dev/null; done
echo @@BEGIN@@
sh /script.sh 2>&1
echo @@END@@
poweroff -f
"""


def build(kernel: str) -> tuple[Path, Path]:
    """(vmlinuz, initramfs base cpio) for ``kernel``, built once into CACHE."""
    deb = _deb(kernel)
    key = hashlib.sha256(repr((MODULES, INIT)).encode()).hexdigest()[:12]
    out = CACHE / "build" / f"{deb.stem}-{key}"  # rebuilt when the module list or init changes
    vmlinuz, initrd = out / "vmlinuz", out / "base.cpio"
    if vmlinuz.exists() and initrd.exists():
        return vmlinuz, initrd
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        x = Path(tmp) / "x"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(x)], check=True)
        (kver,) = os.listdir(x / "lib/modules")
        mods = x / "lib/modules" / kver
        if not (mods / "modules.dep").exists():  # made by depmod at install time
            subprocess.run(["/sbin/depmod", "-b", str(x), kver], check=True)
        dep: dict[str, list[str]] = {}
        for line in (mods / "modules.dep").read_text().splitlines():
            path, _, deps = line.partition(":")
            dep[Path(path).name.split(".ko")[0].replace("_", "-")] = [path, *deps.split()]
        order: list[str] = []
        for m in MODULES:
            if m.replace("_", "-") not in dep:
                continue  # built in
            paths = dep[m.replace("_", "-")]
            for p in reversed(paths):
                if p not in order:
                    order.append(p)
        root = Path(tmp) / "root"
        for d in ("bin", "proc", "sys", "dev", "lib/modules", "tmp"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy("/bin/busybox", root / "bin/busybox")
        names = []
        for p in order:
            src = mods / p
            name = Path(p).name
            if name.endswith(".xz"):
                subprocess.run(["xz", "-dk", str(src)], check=True)
                src, name = src.with_suffix(""), name[:-3]
            elif name.endswith(".zst"):
                subprocess.run(["zstd", "-dq", str(src)], check=True)
                src, name = src.with_suffix(""), name[:-4]
            shutil.copy(src, root / "lib/modules" / name)
            names.append(name)
        (root / "modules.order").write_text("\n".join(names) + "\n")
        (root / "init").write_text(INIT)
        (root / "init").chmod(0o755)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(x / "boot" / f"vmlinuz-{kver}", vmlinuz)
        _cpio(root, initrd)
    return vmlinuz, initrd


def _cpio(root: Path, dest: Path) -> None:
    files = subprocess.run(["find", "."], cwd=root, check=True, capture_output=True).stdout
    with open(dest, "wb") as f:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files, stdout=f, check=True)


# Topology: rp1 has ACS (own group), rp2 disable-acs=on, a pcie-pci-bridge with two e1000
# behind it (one multi-device group).
TOPOLOGY = [
    "-device",
    "pcie-root-port,id=rp1,chassis=1,slot=1",
    "-device",
    "e1000e,bus=rp1,netdev=n1",
    "-netdev",
    "user,id=n1,restrict=on",
    "-device",
    "pcie-root-port,id=rp2,chassis=2,slot=2,disable-acs=on",
    "-device",
    "e1000e,bus=rp2,netdev=n2",
    "-netdev",
    "user,id=n2,restrict=on",
    "-device",
    "pcie-root-port,id=rp3,chassis=3,slot=3",
    "-device",
    "pcie-pci-bridge,id=br,bus=rp3",
    "-device",
    "e1000,bus=br,addr=1,netdev=n3",
    "-netdev",
    "user,id=n3,restrict=on",
    "-device",
    "e1000,bus=br,addr=2,netdev=n4",
    "-netdev",
    "user,id=n4,restrict=on",
]


class _BootFailed(VmUnavailable):
    """The guest died before the script began."""


def run(kernel: str, iommu: str, script: str, timeout: float = 120) -> str:
    """Boot ``kernel`` with ``iommu`` ('intel' or 'amd'), run ``script``, return its output.

    A boot that dies before the script starts (a panic in early boot under a loaded TCG host)
    is tried once more; a second failure is raised.
    """
    try:
        return _run_once(kernel, iommu, script, timeout)
    except _BootFailed:
        return _run_once(kernel, iommu, script, timeout)


def _run_once(kernel: str, iommu: str, script: str, timeout: float) -> str:
    vmlinuz, base = build(kernel)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "r"
        root.mkdir()
        (root / "script.sh").write_text(script)
        extra = Path(tmp) / "extra.cpio"
        _cpio(root, extra)
        initrd = Path(tmp) / "initrd"
        initrd.write_bytes(base.read_bytes() + extra.read_bytes())
        dev = "intel-iommu,intremap=on" if iommu == "intel" else "amd-iommu,intremap=on"
        opt = "intel_iommu=on" if iommu == "intel" else "amd_iommu=on"
        cmd = [
            "qemu-system-x86_64",
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            os.environ.get("GPUHOST_VM_CPU", "qemu64"),
            "-m",
            "512",
            "-smp",
            "2",
            "-M",
            "q35,kernel-irqchip=split",
            "-device",
            dev,
            "-nographic",
            "-no-reboot",
            "-kernel",
            str(vmlinuz),
            "-initrd",
            str(initrd),
            "-append",
            # no_timer_check: under TCG on a loaded host the IO-APIC timer probe can miss its
            # window and panic ("timer doesn't work through Interrupt-remapped IO-APIC");
            # arch/x86/kernel/apic/io_apic.c skips the probe with this option.
            f"console=ttyS0 {opt} iommu.strict=0 quiet panic=-1 no_timer_check",
            *TOPOLOGY,
        ]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise VmUnavailable(f"{kernel}/{iommu} did not finish in {timeout} s") from e
    text = p.stdout.replace("\r", "")
    if BEGIN not in text:
        raise _BootFailed(
            f"{kernel}/{iommu}: the script never started (rc {p.returncode}): {text[-2000:]}{p.stderr[-500:]}"
        )
    if END not in text:
        raise VmUnavailable(
            f"{kernel}/{iommu}: no script output (rc {p.returncode}): {text[-2000:]}{p.stderr[-500:]}"
        )
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return "\n".join(x for x in body.splitlines() if x and not x.startswith("["))  # no kernel log lines

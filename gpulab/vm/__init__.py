"""Real-kernel tier of the lab: Debian kernels booted under QEMU with an emulated IOMMU.

Everything comes from Debian packages (``apt-get download`` of the unsigned kernel images,
busybox-static, cpio, e2fsprogs); nothing else is downloaded. ``build(kernel)`` extracts one
kernel and the few modules the guest needs into a busybox initramfs cached under ``CACHE``. The
initramfs mounts this machine's root read-only over virtio-9p (``-virtfs ... readonly=on``) under
an overlay with a writable upper layer, as virtme-ng does, so the guest runs this machine's
python3 and this checkout: the project's own agent and modules, not a shell imitation of them.

- ``run(kernel, iommu, command)`` boots, runs ``command`` in the overlay root (upper layer in
  tmpfs) and returns what it wrote to the second serial port (``/dev/ttyS1``).
- ``run_systemd(kernel, iommu, disk)`` boots this machine's systemd as PID 1 on the overlay, with
  the upper layer on ``disk`` (an ext4 image made by ``make_disk``), and lets the guest reboot for
  real (no ``-no-reboot``) until it powers off.

The topology (``TOPOLOGY``): an e1000e on a root port with ACS (its own group), an e1000e on a
root port with ``disable-acs=on`` (it shares the port's group), two e1000 behind a
``pcie-pci-bridge`` (one group of three), and a switch (``x3130-upstream`` with two
``xio3130-downstream`` ports, an e1000e behind each) on a root port with ACS. QEMU 7.2's
xio3130 ports have no ACS capability at all (no ``disable-acs``): both downstream ports are
ports without ACS.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CACHE",
    "KERNELS",
    "TOPOLOGY",
    "Boot",
    "VmUnavailable",
    "available",
    "build",
    "guest_command",
    "make_disk",
    "run",
    "run_systemd",
    "systemd_layer",
    "whiteout",
]

CACHE = Path(os.environ.get("GPUHOST_VM_CACHE", "/var/cache/gpuhost-vm"))
CHECKOUT = Path(__file__).resolve().parents[2]

# name -> glob of the unsigned Debian image package fetched by scripts/setup.sh
KERNELS = {
    "6.1": "linux-image-6.1.0-*-amd64-unsigned_*.deb",
    "6.12": "linux-image-6.12.*+deb12-amd64-unsigned_*.deb",
}
# Drivers and modules the behaviours use, then what the root needs: virtio-9p for this machine's
# tree (9p, 9pnet_virtio, and netfs on 6.12 through modules.dep), overlay, and ext4 on virtio-blk
# for the systemd guest's disk (DISK_MODULES).
MODULES = (
    "e1000e",
    "e1000",
    "tun",
    "8139too",  # a module with MODULE_VERSION and parameters, for /sys/module/M/version
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "overlay",
)
# and for the systemd guest's disk only (ext4 asks for crc32c by a softdep modules.dep omits)
DISK_MODULES = ("virtio_blk", "crc32c_generic", "ext4")
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
    for tool in ("qemu-system-x86_64", "cpio", "dpkg-deb", "/sbin/depmod", "xz", "/sbin/mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (scripts/setup.sh installs it)"
    if not Path("/bin/busybox").exists():
        return "busybox-static not installed (scripts/setup.sh installs it)"
    if os.geteuid() != 0:
        return "the VMs share / over 9p with security_model=none: run as root"
    try:
        for k in KERNELS:
            _deb(k)
    except VmUnavailable as e:
        return str(e)
    return None


# PID 1 of the initramfs. /vm.conf (per boot) sets MODE (run | systemd); /run.sh is the command.
INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs dev /dev
. /vm.conf
mark() { read up rest < /proc/uptime; echo "@@T $1 $up" > /dev/ttyS1; }  # where the boot's time goes
lists=/lib/modules/load.order; [ "$MODE" = systemd ] && lists="$lists /lib/modules/load-disk.order"
for m in $(cat $lists); do insmod /lib/modules/$(uname -r)/$m 2>/dev/null; done
mark modules
die() { echo "@@INIT@@ $*" > /dev/ttyS1; poweroff -f; }
mkdir -p /host /layer /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /host || die "9p mount failed"
if [ -b /dev/vda ]; then mount -t ext4 /dev/vda /layer || die "ext4 mount failed"
else mount -t tmpfs -o size=512m layer /layer; fi
mkdir -p /layer/upper /layer/work
mount -t overlay -o lowerdir=/host,upperdir=/layer/upper,workdir=/layer/work root /newroot || die "overlay failed"
mkdir -p /newroot/lib/modules/$(uname -r)
cp -a /lib/modules/$(uname -r)/. /newroot/lib/modules/$(uname -r)/
mark root
# the checkout under test, where the guest's own /tmp would hide it (a CI clone in /tmp): bound back
bind_checkout() { [ -n "${CHECKOUT:-}" ] && mkdir -p "/newroot$CHECKOUT" && mount --bind "/host$CHECKOUT" "/newroot$CHECKOUT"; }
if [ "$MODE" = systemd ]; then
  bind_checkout
  for d in dev proc sys; do mount --move /$d /newroot/$d; done
  exec switch_root /newroot /lib/systemd/systemd
fi
for d in tmp run; do mount -t tmpfs $d /newroot/$d; done
bind_checkout
for d in dev proc sys; do mount --move /$d /newroot/$d; done
cp /run.sh /newroot/tmp/run.sh
chroot /newroot /bin/sh /tmp/run.sh
poweroff -f
"""


@dataclass(frozen=True)
class Boot:
    """A kernel ready to boot: its image, the base initramfs and the release it reports."""

    vmlinuz: Path
    initrd: Path
    release: str


def build(kernel: str) -> Boot:
    """The kernel image and base initramfs for ``kernel``, built once into CACHE."""
    deb = _deb(kernel)
    key = hashlib.sha256(repr((MODULES, DISK_MODULES, INIT)).encode()).hexdigest()[:12]
    out = CACHE / "build" / f"{deb.stem}-{key}"  # rebuilt when the module list or init changes
    vmlinuz, initrd, rel = out / "vmlinuz", out / "base.cpio", out / "release"
    if vmlinuz.exists() and initrd.exists() and rel.exists():
        return Boot(vmlinuz, initrd, rel.read_text().strip())
    CACHE.mkdir(parents=True, exist_ok=True)
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
        disk_from = 0
        for m in (*MODULES, *DISK_MODULES):
            if m == DISK_MODULES[0]:
                disk_from = len(order)
            for p in reversed(dep.get(m.replace("_", "-"), [])):  # absent: built in
                if p not in order:
                    order.append(p)
        root = Path(tmp) / "root"
        for d in ("bin", "proc", "sys", "dev", "tmp"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy("/bin/busybox", root / "bin/busybox")
        names = []
        for p in order:  # decompressed, in the tree layout depmod and modprobe expect
            src, name = mods / p, p
            for ext, tool in ((".xz", ["xz", "-dk"]), (".zst", ["zstd", "-dq"])):
                if name.endswith(ext):
                    subprocess.run([*tool, str(src)], check=True)
                    src, name = src.with_suffix(""), name[: -len(ext)]
            dest = root / "lib/modules" / kver / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest)
            names.append(name)
        subprocess.run(["/sbin/depmod", "-b", str(root), kver], check=True, capture_output=True)
        (root / "lib/modules/load.order").write_text("\n".join(names[:disk_from]) + "\n")
        (root / "lib/modules/load-disk.order").write_text("\n".join(names[disk_from:]) + "\n")
        (root / "init").write_text(INIT)
        (root / "init").chmod(0o755)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(x / "boot" / f"vmlinuz-{kver}", vmlinuz)
        _cpio(root, initrd)
        rel.write_text(kver + "\n")
    return Boot(vmlinuz, initrd, kver)


def _cpio(root: Path, dest: Path) -> None:
    files = subprocess.run(["find", "."], cwd=root, check=True, capture_output=True).stdout
    with open(dest, "wb") as f:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files, stdout=f, check=True)


def _dev(*args: str) -> list[str]:
    return ["-device", ",".join(args)]


# rp1 has ACS (own group), rp2 disable-acs=on, rp3 a pcie-pci-bridge with two e1000 behind it (one
# multi-device group), rp4 a switch: upstream port, two downstream ports, an e1000e behind each.
TOPOLOGY = [
    *_dev("pcie-root-port", "id=rp1", "chassis=1", "slot=1"),
    *_dev("e1000e", "bus=rp1"),
    *_dev("pcie-root-port", "id=rp2", "chassis=2", "slot=2", "disable-acs=on"),
    *_dev("e1000e", "bus=rp2"),
    *_dev("pcie-root-port", "id=rp3", "chassis=3", "slot=3"),
    *_dev("pcie-pci-bridge", "id=br", "bus=rp3"),
    *_dev("e1000", "bus=br", "addr=1"),
    *_dev("e1000", "bus=br", "addr=2"),
    *_dev("pcie-root-port", "id=rp4", "chassis=4", "slot=4"),
    *_dev("x3130-upstream", "id=up1", "bus=rp4"),
    *_dev("xio3130-downstream", "id=dp1", "bus=up1", "chassis=5", "slot=1"),
    *_dev("e1000e", "bus=dp1"),
    *_dev("xio3130-downstream", "id=dp2", "bus=up1", "chassis=5", "slot=2"),
    *_dev("e1000e", "bus=dp2"),
]


def guest_command(*args: str) -> str:
    """The shell line that runs ``python -m gpulab.vm.guest ARGS`` in the guest with this checkout."""
    py = os.path.realpath(sys.executable)
    script = Path(__file__).with_name("guest.py")
    argv = [py, "-S", "-B", str(script), *args]
    return f"cd / && PYTHONPATH={shlex.quote(str(CHECKOUT))} {shlex.join(argv)}"


def _qemu(boot: Boot, iommu: str, extra: list[str], *, reboot: bool, out: Path, initrd: Path) -> list[str]:
    dev = "intel-iommu,intremap=on" if iommu == "intel" else "amd-iommu,intremap=on"
    opt = "intel_iommu=on" if iommu == "intel" else "amd_iommu=on"
    return [
        "qemu-system-x86_64",
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        os.environ.get("GPUHOST_VM_CPU", "qemu64"),
        "-m",
        "768",
        # one vCPU: on a loaded host a second TCG vCPU thread gets descheduled and the guest
        # stalls on it (soft lockups at boot were seen with two at a load average of 10)
        "-smp",
        os.environ.get("GPUHOST_VM_SMP", "1"),
        "-M",
        "q35,kernel-irqchip=split",
        "-device",
        dev,
        "-display",
        "none",
        "-vga",
        "none",
        "-monitor",
        "none",
        "-nic",
        "none",
        "-serial",
        "stdio",
        "-serial",
        f"file:{out}",
        *([] if reboot else ["-no-reboot"]),
        "-kernel",
        str(boot.vmlinuz),
        "-initrd",
        str(initrd),
        "-append",
        # no_timer_check: under TCG on a loaded host the IO-APIC timer probe can miss its
        # window and panic ("timer doesn't work through Interrupt-remapped IO-APIC");
        # arch/x86/kernel/apic/io_apic.c skips the probe with this option.
        f"console=ttyS0 {opt} iommu.strict=0 quiet loglevel=3 panic=-1 no_timer_check",
        # this machine's tree, read-only; remap: / spans several filesystems (inode numbers)
        "-virtfs",
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        *TOPOLOGY,
        *extra,
    ]


class _BootFailed(VmUnavailable):
    """The guest died before its command began."""


def _boot(
    kernel: str, iommu: str, conf: str, timeout: float, *, extra: list[str], reboot: bool, script: str = ""
) -> tuple[str, str]:
    """Boot once; return (what the guest wrote to ttyS1, the console's tail)."""
    boot = build(kernel)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "r"
        root.mkdir()
        under_tmp = CHECKOUT.is_relative_to("/tmp") or CHECKOUT.is_relative_to("/var/tmp")
        (root / "vm.conf").write_text(
            conf + (f"CHECKOUT={shlex.quote(str(CHECKOUT))}\n" if under_tmp else "")
        )
        (root / "run.sh").write_text(script)
        extra_cpio = Path(tmp) / "extra.cpio"
        _cpio(root, extra_cpio)
        initrd = Path(tmp) / "initrd"
        initrd.write_bytes(boot.initrd.read_bytes() + extra_cpio.read_bytes())
        out = Path(tmp) / "ttyS1"
        cmd = _qemu(boot, iommu, extra, reboot=reboot, out=out, initrd=initrd)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
            console = (p.stdout + p.stderr).replace("\r", "")
        except subprocess.TimeoutExpired as e:
            text = out.read_text(errors="replace") if out.exists() else ""
            tail = (e.stdout or b"")[-3000:] if isinstance(e.stdout, bytes) else str(e.stdout or "")[-3000:]
            raise VmUnavailable(
                f"{kernel}/{iommu} did not finish in {timeout} s; ttyS1: {text[-2000:]!r}; console: {tail!r}"
            ) from e
        text = out.read_text(errors="replace").replace("\r", "") if out.exists() else ""
    if os.environ.get("GPUHOST_VM_CONSOLE"):  # the whole console, for a person reading a slow boot
        Path(os.environ["GPUHOST_VM_CONSOLE"]).write_text(console)
    return text, console[-3000:]


def run(kernel: str, iommu: str, command: str, timeout: float = 180) -> tuple[str, float]:
    """Boot ``kernel`` with ``iommu`` ('intel' or 'amd'), run ``command``; return (its output, boot s).

    The boot time is the guest's uptime when the command starts (kernel, modules, 9p, overlay).

    The command runs as root in the overlay root (this machine's tree read-only, a tmpfs on top),
    its stdout and stderr on the guest's ttyS1. A boot that dies before the command starts (a
    panic in early boot under a loaded TCG host) is tried once more; a second failure is raised.
    """
    script = (
        "exec >/dev/ttyS1 2>&1\nread up rest < /proc/uptime\necho " + BEGIN + " $up\n"
        f"{command}\necho {END} rc=$?\n"
    )
    for attempt in (1, 2):
        text, console = _boot(kernel, iommu, "MODE=run\n", timeout, extra=[], reboot=False, script=script)
        if BEGIN in text:
            break
        if attempt == 2:
            raise _BootFailed(f"{kernel}/{iommu}: the command never started: {text[-1000:]}{console}")
    if END not in text:
        raise VmUnavailable(f"{kernel}/{iommu}: the command did not finish: {text[-3000:]}{console}")
    first, _, body = text.split(BEGIN, 1)[1].split(END, 1)[0].partition("\n")
    return body, float(first.strip() or 0)


def make_disk(path: Path, top: Path, size_mb: int = 256) -> None:
    """Make an ext4 image at ``path`` holding the tree ``top`` (whose ``upper/`` is the overlay's upper layer).

    ``mkfs.ext4 -d`` copies the tree, character devices (overlayfs whiteouts: 0:0) included, as
    the root of the new file system (e2fsprogs 1.43+); ``work/`` is made for overlayfs.
    """
    (top / "work").mkdir(exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size_mb << 20)
    subprocess.run(
        ["/sbin/mkfs.ext4", "-q", "-F", "-L", "gpuhost-vm", "-d", str(top), str(path)],
        check=True,
        capture_output=True,
    )


def whiteout(path: Path) -> None:
    """Hide ``path`` of the lower layer: an overlayfs whiteout (a 0:0 character device) in the upper."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(0, 0))


# The guest's systemd runs this machine's units from the 9p lower layer: every unit this machine
# enables (its /etc/systemd/system/*.wants links) is hidden by a whiteout, and these are masked:
# gettys on the consoles (systemd-getty-generator starts one on console=ttyS0), the clock, and the
# first-boot cache rebuilds (ConditionNeedsUpdate=/etc) of a /usr the guest only reads: under TCG
# the hwdb and ld.so caches alone take minutes.
MASKED = (
    "serial-getty@ttyS0.service",
    "getty@tty1.service",
    "systemd-timesyncd.service",
    "systemd-hwdb-update.service",
    "ldconfig.service",
    "systemd-journal-catalog-update.service",
    "systemd-update-done.service",
    "systemd-sysusers.service",
)
# Directories of this machine the guest must not see: its temporary files (systemd-tmpfiles would
# walk and clean them at boot, over 9p) and the plugin's own state (as the lab's MASKED_DIRS).
OPAQUE = ("tmp", "var/tmp", "var/lib/gpuhost", "etc/gpuhost")


def systemd_layer(dest: Path, units: dict[str, str], enable: list[str]) -> None:
    """Write the systemd guest's upper layer into ``dest``: this machine's root, less its own units.

    ``units`` (name -> text) go to /etc/systemd/system, ``enable`` are wanted by multi-user.target;
    /etc/fstab is empty (this machine's would name its own disks).
    """
    etc = dest / "etc/systemd/system"
    for wants in Path("/etc/systemd/system").glob("*.wants"):
        for link in wants.iterdir():
            whiteout(etc / wants.name / link.name)
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "default.target").symlink_to("/lib/systemd/system/multi-user.target")
    for unit in MASKED:
        (etc / unit).symlink_to("/dev/null")
    for name, text in units.items():
        (etc / name).write_text(text)
    mu = etc / "multi-user.target.wants"
    mu.mkdir(parents=True, exist_ok=True)
    for name in enable:
        (mu / name).symlink_to(f"/etc/systemd/system/{name}")
    if os.path.lexists("/.dockerenv"):  # this machine may be a container: the guest is not one
        whiteout(dest / ".dockerenv")
    for rel in OPAQUE:  # overlayfs: an opaque upper directory hides the lower one's entries
        (dest / rel).mkdir(parents=True, exist_ok=True)
        os.setxattr(dest / rel, "trusted.overlay.opaque", b"y")
    (dest / "tmp").chmod(0o1777)
    (dest / "var/tmp").chmod(0o1777)
    (dest / "etc/fstab").write_text("# gpulab.vm: the guest mounts nothing of this machine's\n")
    (dest / "etc/hostname").write_text("gpuhost-vm\n")
    (dest / "etc/machine-id").write_text(hashlib.sha256(b"gpulab.vm").hexdigest()[:32] + "\n")


def run_systemd(kernel: str, iommu: str, disk: Path, timeout: float = 600) -> tuple[str, str, float]:
    """Boot systemd on ``disk``'s layer, let the guest reboot as it will; return (ttyS1, console tail, s).

    QEMU runs without ``-no-reboot``: a ``systemctl reboot`` in the guest resets the machine,
    which boots the same kernel and initramfs again on the same disk; ``systemctl poweroff``
    ends QEMU.
    """
    t = time.monotonic()
    extra = ["-drive", f"file={disk},if=virtio,format=raw"]
    text, console = _boot(kernel, iommu, "MODE=systemd\n", timeout, extra=extra, reboot=True)
    if "@@INIT@@" in text or not text.strip():
        raise VmUnavailable(f"{kernel}/{iommu}: systemd guest failed: {text[-2000:]}{console}")
    return text, console, time.monotonic() - t

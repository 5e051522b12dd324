"""Prepare a lab machine's root and become its PID 1.

Two halves. ``prepare_root``, ``make_dev`` and friends run in the root namespace on the merged
overlay (writes there land in the overlay's upper dir, so this machine's own files are never
changed). ``main`` runs as PID 1 of fresh PID, mount, UTS and IPC namespaces already joined to the
machine's netns (``python -m gpulab.host.boot --root R ...``): it mounts /proc, a read-only /sys with the
FUSE subtrees bound over /sys/bus/pci, /sys/kernel/iommu_groups and /sys/module (and /proc/modules),
the machine's /dev, the state dir at /var/lib/gpulab, pivots into R and execs systemd; a node
shaped as a rented container (``--init sleep``) gets a read-only /sys throughout (FUSE subtrees
too), starts sshd itself and execs ``sleep infinity`` as its PID 1, as `docker run IMAGE sleep
infinity` with an sshd started in the image's entry point does.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path

__all__ = ["MASKED_UNITS", "main", "make_dev", "own_dirs", "prepare_root"]

# Units that cannot work, or must not run, in a lab machine: udev would act on this machine's real
# devices, sysctl/timesyncd/binfmt would change this machine's kernel, the rest mount or probe
# things a namespace has no business with. Found by booting and reading `systemctl --failed`.
MASKED_UNITS = (
    "systemd-udevd.service",
    "systemd-udevd-control.socket",
    "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service",
    "systemd-udev-settle.service",
    "systemd-sysctl.service",
    "systemd-timesyncd.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount",
    "systemd-modules-load.service",
    "kmod-static-nodes.service",
    "systemd-remount-fs.service",
    "systemd-firstboot.service",
    "systemd-repart.service",
    "systemd-pstore.service",
    "systemd-hwdb-update.service",
    "systemd-pcrphase.service",
    "systemd-pcrphase-sysinit.service",
    "systemd-journald-audit.socket",
    "modprobe@.service",
    "modprobe@drm.service",
    "modprobe@fuse.service",
    "modprobe@configfs.service",
    "modprobe@efi_pstore.service",
    "modprobe@loop.service",
    "modprobe@dm_mod.service",
    "systemd-logind.service",
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "sys-kernel-config.mount",
    "sys-fs-fuse-connections.mount",
    "dev-hugepages.mount",
    "getty@tty1.service",
    "getty-static.service",
    "console-getty.service",
    "serial-getty@ttyS0.service",
    "e2scrub_reap.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "cron.service",
    "postgresql.service",
    "avahi-daemon.service",
    "avahi-daemon.socket",
)

# Directories of this machine that a lab host must not see through its overlay root (lower layer
# `/`): the plugin's own state on the machine that runs the tests (a `local://` run's health cursor
# and journals) would otherwise appear inside every lab host, as if the host had run the plugin
# before. A real host never shares them. Masked with opaque directories in the lab layer
# (Documentation/filesystems/overlayfs.rst, "whiteouts and opaque directories": an upper or middle
# layer directory with the xattr trusted.overlay.opaque="y" hides everything below it).
MASKED_DIRS = ("var/lib/gpuhost", "etc/gpuhost")


def mask_dirs(base: Path, dirs: Iterable[str] = MASKED_DIRS) -> None:
    """Make each of ``dirs`` an empty opaque directory in the lab layer ``base`` (not mounted now)."""
    for rel in dirs:
        p = base / rel
        if p.is_symlink() or (p.exists() and not p.is_dir()):
            p.unlink()  # a whiteout (char device 0:0) left by the build, or a file
        elif p.is_dir():
            shutil.rmtree(p)
        p.mkdir(parents=True)
        os.setxattr(p, "trusted.overlay.opaque", b"y")


# Home directories of this machine that a lab host must not see either (a credential of the
# machine that runs the tests would be one the node "left"): hidden, but what the lab layer put
# there (root's .ssh, .bashrc, a profile's planted files) stays.
OWN_DIRS = ("root", "home")
#: Entries of this machine's home directories a lab host may still see: the pyenv builds of old
#: CPythons that the node-Python shapes run (gpulab/host/pythons.py; their prefix is compiled in).
SHOWN = {"root": (".pyenv",)}


def own_dirs(base: Path, dirs: Iterable[str] = OWN_DIRS) -> None:
    """Hide this machine's own entries of each of ``dirs`` in the lab layer ``base``.

    A directory with nothing to keep is made opaque; one with entries to keep (SHOWN) gets a
    whiteout (overlayfs: a character device 0:0) over each other entry of this machine's, so
    the kept ones show through. What the layer holds itself stays either way.
    """
    for rel in dirs:
        p = base / rel
        if p.is_symlink() or (p.exists() and not p.is_dir()):
            p.unlink()
        p.mkdir(parents=True, exist_ok=True)
        keep = SHOWN.get(rel, ())
        if not keep:
            os.setxattr(p, "trusted.overlay.opaque", b"y")
            continue
        try:
            mine = os.listdir(Path("/") / rel)
        except OSError:
            mine = []
        for name in mine:
            if name in keep or os.path.lexists(p / name):
                continue  # shown through, or the layer's own
            os.mknod(p / name, stat.S_IFCHR | 0o000, os.makedev(0, 0))


SSHD_CONFIG = """\
# gpulab: this lab machine's sshd
Port 22
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AuthorizedKeysFile .ssh/authorized_keys
UseDNS no
X11Forwarding no
PrintMotd no
MaxStartups 200:30:400
MaxSessions 200
AcceptEnv LANG LC_*
Subsystem sftp /usr/lib/openssh/sftp-server
"""

# Capabilities a lab machine's processes never get (as LXC drops them): loading kernel modules,
# setting this machine's clock, reading its real kernel log, MAC policy. CAP_SYS_RAWIO and
# CAP_SYS_ADMIN stay: sysfs writes need them, as on a real host.
DROPPED_CAPS = {
    "CAP_SYS_MODULE": 16,
    "CAP_SYS_TIME": 25,
    "CAP_MAC_OVERRIDE": 32,
    "CAP_MAC_ADMIN": 33,
    "CAP_SYSLOG": 34,
}
PR_CAPBSET_DROP = 24
#: PID 1 of a lab machine (NodeShape.init): systemd, or a rented container's entry point.
INITS = ("systemd", "sleep", "tini", "supervisord")

DEV_NODES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}


def _unlink(p: Path) -> None:
    if p.is_symlink() or p.exists():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _write(p: Path, text: str, mode: int = 0o644) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    _unlink(p)
    p.write_text(text)
    p.chmod(mode)


def _symlink(target: str, p: Path) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    _unlink(p)
    p.symlink_to(target)


def prepare_root(
    root: Path,
    hostname: str,
    host_key: Path,
    client_pubkey: Path,
    enabled_units: Iterable[str] = (),
    listen: str = "0.0.0.0",
) -> None:
    """Strip this machine's enabled units from the merged overlay ``root`` and make it a lab machine.

    Every ``*.wants`` link under /etc/systemd/system goes (PostgreSQL and friends would start), the
    default target becomes multi-user, MASKED_UNITS are masked, ssh.service plus ``enabled_units``
    are wanted by multi-user.target, and sshd gets its own config, host key and the lab client key;
    it listens on ``listen`` (loopback when a delay proxy sits in front of it).
    """
    etc_sd = root / "etc/systemd/system"
    for wants in etc_sd.glob("*.wants"):
        for link in wants.iterdir():
            _unlink(link)
    for sub in ("timers.target.wants", "sockets.target.wants", "getty.target.wants"):
        _unlink(etc_sd / sub)
    _symlink("/lib/systemd/system/multi-user.target", etc_sd / "default.target")
    for unit in MASKED_UNITS:
        _symlink("/dev/null", etc_sd / unit)
    mu = etc_sd / "multi-user.target.wants"
    mu.mkdir(parents=True, exist_ok=True)
    _symlink("/lib/systemd/system/ssh.service", mu / "ssh.service")
    for unit in enabled_units:
        _symlink(f"/etc/systemd/system/{unit}", mu / unit)

    _write(root / "etc/hostname", hostname + "\n")
    _write(root / "etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost\n")
    # machine-id(5): "generated from a random source during system installation or first boot
    # and stays constant for all subsequent boots" (freedesktop.org/software/systemd/man/latest/
    # machine-id.html); an empty file would give every lab host this machine's DMI product UUID.
    # One per host (its overlay's path), the same on every boot of it.
    _write(root / "etc/machine-id", hashlib.sha256(os.fsencode(root.resolve())).hexdigest()[:32] + "\n")
    # No resource accounting: systemd would move services out of this machine's memory/cpu
    # cgroups (its limits) into per-unit v1 cgroups of its own.
    _write(
        root / "etc/systemd/system.conf.d/gpulab.conf",
        "[Manager]\nDefaultCPUAccounting=no\nDefaultMemoryAccounting=no\nDefaultTasksAccounting=no\n"
        "DefaultIOAccounting=no\nDefaultBlockIOAccounting=no\nDefaultIPAccounting=no\n",
    )
    # INTERNALS.md names /run/gpulab/ctl too; the FUSE ctl/ subtree is bound at /var/lib/gpulab/ctl.
    _write(root / "etc/tmpfiles.d/gpulab.conf", "L /run/gpulab/ctl - - - - /var/lib/gpulab/ctl\n")
    ssh = root / "etc/ssh"
    for old in ssh.glob("ssh_host_*"):
        _unlink(old)
    shutil.copyfile(host_key, ssh / "ssh_host_ed25519_key")
    (ssh / "ssh_host_ed25519_key").chmod(0o600)
    shutil.copyfile(str(host_key) + ".pub", ssh / "ssh_host_ed25519_key.pub")
    _write(ssh / "sshd_config", SSHD_CONFIG + f"ListenAddress {listen}\n")
    for d in (ssh / "sshd_config.d",):
        if d.is_dir():
            for f in d.iterdir():
                _unlink(f)
    home = root / "root"
    for dot in (".bashrc", ".profile"):
        skel = Path("/etc/skel") / dot
        if skel.exists():
            _write(home / dot, skel.read_text())
    dot_ssh = home / ".ssh"
    _unlink(dot_ssh)
    dot_ssh.mkdir(mode=0o700)
    _write(dot_ssh / "authorized_keys", client_pubkey.read_text(), 0o600)
    (root / "var/lib/gpulab").mkdir(parents=True, exist_ok=True)
    (root / "etc/gpulab").mkdir(parents=True, exist_ok=True)


def make_dev(dev: Path, nvidia_minors: Iterable[int], driver: bool = True) -> None:
    """Mount a tmpfs at ``dev`` with the usual nodes and the GPU nodes (character devices).

    ``driver=False``: no NVIDIA node at all (a host without the driver has no /dev/nvidia*).
    """
    dev.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(dev):
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "mode=755,size=64m", "gpulab-dev", str(dev)],
            check=True,
            timeout=10,
        )
    for name, (major, minor) in DEV_NODES.items():
        p = dev / name
        if not p.exists():
            os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            p.chmod(0o666)
    for d in ("pts", "shm", "net"):
        (dev / d).mkdir(exist_ok=True)
    (dev / "shm").chmod(0o1777)
    for name, target in (
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        if not (dev / name).is_symlink():
            (dev / name).symlink_to(target)
    # Character devices, as on a real host, but of /dev/null's major:minor (1:3): no nvidia driver is
    # registered here, so NVIDIA's numbers (195:N) would open with ENXIO. Each node is its own inode,
    # so the /proc/*/fd scans still tell them apart; opens and closes go through chrdev_open().
    names = [f"nvidia{m}" for m in nvidia_minors] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
    for name in names if driver else []:
        p = dev / name
        if not p.exists():
            os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            p.chmod(0o666)


def _mount(*args: str) -> None:
    p = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=10)
    if p.returncode != 0:
        raise SystemExit(f"gpulab.host.boot: mount {' '.join(args)}: {p.stderr.strip()}")


def _inner(ns: argparse.Namespace) -> None:
    r = Path(ns.root)
    _mount("--make-rprivate", "/")
    _mount("-t", "proc", "proc", str(r / "proc"))
    # /proc/sys and sysrq-trigger reach this machine's kernel: read-only, as in a real container.
    _mount("--bind", str(r / "proc/sys"), str(r / "proc/sys"))
    _mount("-o", "remount,bind,ro", str(r / "proc/sys"))
    if (r / "proc/sysrq-trigger").exists():
        _mount("--bind", "/dev/null", str(r / "proc/sysrq-trigger"))
    # The lab shares this machine's kernel; what files can say, they say as the profile's kernel
    # (uname(2) cannot be changed: os.uname() still reports this machine's release).
    if ns.procfiles:
        for rel in ("cmdline", "version", "sys/kernel/osrelease"):
            src = os.path.join(ns.procfiles, rel.replace("/", "_"))
            if os.path.exists(src) and (r / "proc" / rel).exists():
                _mount("--bind", src, str(r / "proc" / rel))
                _mount("-o", "remount,bind,ro", str(r / "proc" / rel))
        # A boot id of this boot: the kernel draws one per boot (drivers/char/random.c, proc_do_uuid
        # for kernel.random.boot_id); the shared kernel's would never change on a lab reboot. The
        # host's boot draws it (the lab removes the file before a boot), its containers share it.
        bid = os.path.join(ns.procfiles, "boot_id")
        if not os.path.exists(bid):
            Path(bid).write_text(str(uuid.uuid4()) + "\n")
        _mount("--bind", bid, str(r / "proc/sys/kernel/random/boot_id"))
        _mount("-o", "remount,bind,ro", str(r / "proc/sys/kernel/random/boot_id"))
    _mount("-t", "sysfs", "-o", "ro,nosuid,nodev,noexec", "sysfs", str(r / "sys"))
    if ns.cgroupns:
        # In its own cgroup namespace the machine sees its cgroup as the root; systemd mounts the
        # hierarchies itself on an empty tmpfs, so every path it sees is relative to that root.
        if os.path.exists("/sys/fs/cgroup/cgroup.procs"):  # a pure cgroup2 machine
            _mount("-t", "cgroup2", "-o", "nosuid,nodev,noexec", "cgroup2", str(r / "sys/fs/cgroup"))
        else:
            _mount("-t", "tmpfs", "-o", "mode=755,nosuid,nodev,noexec", "cgroup", str(r / "sys/fs/cgroup"))
    else:
        _mount("--rbind", "/sys/fs/cgroup", str(r / "sys/fs/cgroup"))
    if ns.sysfs:
        _mount("--bind", os.path.join(ns.sysfs, "pci"), str(r / "sys/bus/pci"))
        _mount("--bind", os.path.join(ns.sysfs, "iommu_groups"), str(r / "sys/kernel/iommu_groups"))
        if ns.init != "systemd":
            # A container's /sys is read-only, FUSE subtrees included: a write fails with EROFS
            for sub in ("sys/bus/pci", "sys/kernel/iommu_groups"):
                _mount("-o", "remount,bind,ro", str(r / sub))
        # The NVIDIA modules' use counts and parameters (and kvm_amd's sev_snp) as the profile's
        # kernel shows them: /sys/module/M/{refcnt,holders,parameters} and /proc/modules
        # (kernel/module/sysfs.c, kernel/module/procfs.c m_show(); gpulab/kernel/acs.py). The lab
        # host sees only these modules there, as a host with just them loaded would.
        _mount("--bind", os.path.join(ns.sysfs, "module"), str(r / "sys/module"))
        if (r / "proc/modules").exists():  # absent where this machine's kernel has no module support
            _mount("--bind", os.path.join(ns.sysfs, "proc", "modules"), str(r / "proc/modules"))
    _mount("--rbind", ns.dev, str(r / "dev"))
    _mount("-t", "devpts", "-o", "newinstance,ptmxmode=0666,mode=620,gid=5", "devpts", str(r / "dev/pts"))
    _mount("-t", "tmpfs", "-o", "mode=1777,nosuid,nodev,size=256m", "shm", str(r / "dev/shm"))
    if ns.init != "systemd":
        # systemd mounts its own /run; a container's /run starts empty (no /run/systemd/system)
        _mount("-t", "tmpfs", "-o", "mode=755,nosuid,nodev,size=64m", "run", str(r / "run"))
    # A fresh /tmp per boot (as with tmp.mount); this machine's own /tmp is not the host's business.
    _mount("-t", "tmpfs", "-o", "mode=1777,nosuid,nodev,size=512m", "tmpfs", str(r / "tmp"))
    # The checkout under test is the lab's stand-in for software installed on the host: lab hosts
    # see it (and its .venv) through the overlay of this machine's /, except where the fresh /tmp
    # hides it (a CI clone in /tmp). Bind it back there, read-only, at the same path.
    checkout = Path(__file__).resolve().parents[2]
    if checkout.is_relative_to("/tmp"):
        inside = r / checkout.relative_to("/")
        inside.mkdir(parents=True, exist_ok=True)
        _mount("--bind", str(checkout), str(inside))
        _mount("-o", "remount,bind,ro", str(inside))
    if ns.state:
        _mount("--bind", ns.state, str(r / "var/lib/gpulab"))
        if ns.sysfs:
            ctl = r / "var/lib/gpulab/ctl"
            ctl.mkdir(exist_ok=True)
            _mount("--bind", os.path.join(ns.sysfs, "ctl"), str(ctl))
    os.chdir(r)
    (r / ".oldroot").mkdir(exist_ok=True)
    subprocess.run(["pivot_root", ".", ".oldroot"], check=True, timeout=10)
    os.chdir("/")
    subprocess.run(["umount", "-l", "/.oldroot"], check=True, timeout=10)
    os.rmdir("/.oldroot")
    hostname = Path("/etc/hostname").read_text().strip() or "localhost"
    socket.sethostname(hostname)
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in DROPPED_CAPS.values():
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    if ns.init != "systemd":
        # A rented container: the image's entry point starts sshd, then PID 1 is `sleep infinity`
        # (or `tini -- sleep infinity`); under supervisord, sshd is one of its programs.
        env = {"PATH": path, "HOME": "/root", "LANG": "C.UTF-8", **dict(kv.split("=", 1) for kv in ns.env)}
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        if ns.init == "supervisord":
            conf = "/etc/supervisor/supervisord.conf"
            os.execve("/usr/bin/supervisord", ["/usr/bin/supervisord", "-n", "-c", conf], env)
        subprocess.run(["/usr/sbin/sshd", "-f", "/etc/ssh/sshd_config"], check=True, timeout=10, env=env)
        if ns.init == "tini":
            os.execve("/usr/bin/tini", ["/usr/bin/tini", "--", "sleep", "infinity"], env)
        os.execve("/usr/bin/sleep", ["sleep", "infinity"], env)
    env = {"container": "gpulab", "PATH": path}
    os.execve("/lib/systemd/systemd", ["/lib/systemd/systemd", "--system"], env)


def main(argv: list[str] | None = None) -> None:
    """Run as PID 1 of a new lab machine: mount, pivot, exec systemd."""
    ap = argparse.ArgumentParser(prog="python -m gpulab.host.boot")
    ap.add_argument("--root", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--sysfs", default="")
    ap.add_argument("--state", default="")
    ap.add_argument("--cgroupns", action="store_true", help="the launcher unshared the cgroup namespace")
    ap.add_argument("--procfiles", default="", help="dir with cmdline, version, sys_kernel_osrelease")
    ap.add_argument("--init", default="systemd", choices=INITS, help="PID 1 (NodeShape.init)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for PID 1 without systemd")
    ns = ap.parse_args(argv)
    if os.getpid() != 1:
        raise SystemExit("gpulab.host.boot: must run as PID 1 of a new PID namespace")
    try:
        _inner(ns)
    except Exception as e:  # a failed boot must say why on the launcher's log, then end the namespace
        print(f"gpulab.host.boot: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()

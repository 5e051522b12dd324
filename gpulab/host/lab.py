"""Bring lab hosts up and down: namespaces, overlay roots, FUSE sysfs, systemd, sshd, containers.

Layout in the root namespace for host ``NAME`` (index ``I``)::

    /run/gpulab/.lock                 index allocation (flock)
    /run/gpulab/id_ed25519[.pub]      the lab's SSH client key
    /run/gpulab/NAME/meta.json        name, index, profile, options (what the CLI reloads)
    /run/gpulab/NAME/pids/            pidfiles of every process the lab started (nothing else is killed)
    /run/gpulab/NAME/fs/              a size-limited tmpfs: base/ (the lab's layer: tools, units,
                                      config, data), upper/ + work/ (what the host changes), and the
                                      same per container under ct/ID/
    /run/gpulab/NAME/root             overlay lowerdir=fs/base:/ upperdir=fs/upper (the host's /)
    /run/gpulab/NAME/dev              tmpfs: the host's /dev (nvidiaN are regular files)
    /run/gpulab/NAME/sysfs            the FUSE daemon's mount: pci/ iommu_groups/ ctl/
    /run/gpulab/NAME/state            bound at /var/lib/gpulab in the host and its containers
    /run/gpulab/NAME/known_hosts      host keys of the host and its containers

The lab layer (base) holds whiteouts for every unit this machine has enabled, so the host's
systemd only starts ssh and the profile's units. ``reset`` drops upper (a pristine host);
``reboot`` keeps it (what was installed survives). A reboot asked for inside the host
(``systemctl reboot``) boots it again the same way: ``gpulab.host.supervise``, the launcher's parent.

Each machine runs in its own PID, mount, UTS, IPC, cgroup and network namespaces, PID 1 a real
systemd, in cgroup ``gpulab/NAME`` (containers: ``gpulab/NAME/lxc/ID``) of the systemd, pids,
devices and freezer hierarchies; memory and cpu stay this machine's. Link delay uses netem where
the kernel has it, else ``gpulab.host.delayproxy`` in front of the host's sshd; loss needs netem.

The parts, by concept: ``gpulab.host.cgroups`` (a machine's cgroups, freezing), ``gpulab.host.procs``
(processes and mounts seen from this machine), ``gpulab.host.layer`` (the files put under a host's
root before it boots), ``gpulab.host.boot`` (its /etc and /dev), ``gpulab.host.netns`` (its link).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulab.errors import LabError
from gpulab.host import boot, cgroups, layer, netns, procs, pythons, units
from gpulab.profiles.load import ProfileError, load_profile
from gpulab.profiles.types import Profile, Service

__all__ = ["CLIENT_KEY", "RUN", "Lab", "LabError", "LabHost"]

RUN = Path("/run/gpulab")
CLIENT_KEY = RUN / "id_ed25519"
PKG = Path(__file__).resolve().parents[1]  # gpulab/
REPO = PKG.parent
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
BOOT_TIMEOUT = 90.0
FS_SIZE = {"small": "2g", "bench": "4g"}
#: Per-GPU runtime faults (faults.json) a reboot clears: a reboot resets every GPU, so all that
#: a GPU reset clears (gpulab_tools.nvidia_smi_reset.CLEARED_BY_RESET), and ``reset_sticks``, a GPU
#: that a reset leaves in error until the node reboots.
CLEARED_BY_REBOOT = ("reset_required", "drain_and_reset", "remapped_rows_pending", "reset_sticks")
NETEM_MISSING = (
    "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so link delay and loss cannot be emulated"
)


def _is_ours(pid: int, name: str) -> bool:
    """Say whether live ``pid`` is a lab process of host ``name`` (guards against reused PIDs)."""
    if not procs.alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return (
        f"{RUN}/{name}/" in cmdline
        or f":/gpulab/{name}/" in cgroups
        or cgroups.rstrip().endswith(f"/gpulab/{name}")
    )


def _py_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def ensure_client_key() -> Path:
    """Create the lab's SSH client key once (``/run/gpulab/id_ed25519``); return its path."""
    RUN.mkdir(parents=True, exist_ok=True)
    if not CLIENT_KEY.exists():
        tmp = RUN / f".id_ed25519.{os.getpid()}"
        procs.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpulab-client", "-f", str(tmp)])
        os.replace(str(tmp) + ".pub", str(CLIENT_KEY) + ".pub")
        os.replace(tmp, CLIENT_KEY)
    return CLIENT_KEY


@dataclass
class _Machine:
    """One systemd machine of the lab: the host itself (cid None) or one of its containers."""

    cid: int | None
    name: str
    hostname: str
    kind: str
    address: str
    dir: Path  # holds root/, dev/, ssh_host_ed25519_key


class LabHost:
    """A running (or recorded) lab host; reload one by name with ``Lab().get(name)``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = RUN / name
        meta = json.loads((self.dir / "meta.json").read_text())
        self.index: int = meta["index"]
        self.meta: dict[str, Any] = meta
        self.profile: Profile = load_profile(self.dir / "profile.json")
        self.address: str = netns.host_address(self.index)
        self.netns = netns.host_netns(name)
        self.state_dir = self.dir / "state"
        self.known_hosts = self.dir / "known_hosts"
        self.cgroup = f"gpulab/{name}"

    # ---- identity -------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"<LabHost {self.name} {self.address} profile={self.profile.name}>"

    def container_address(self, cid: int) -> str:
        """Return the address of container ``cid`` (its own sshd listens there)."""
        for k, c in enumerate(self.profile.containers):
            if c.id == cid:
                return netns.container_address(self.index, k)
        raise LabError(f"{self.name}: profile {self.profile.name} has no container {cid}")

    def machines(self) -> list[_Machine]:
        """Return the host and its containers, host first."""
        out = [_Machine(None, self.name, self.profile.hostname, "host", self.address, self.dir)]
        for k, c in enumerate(self.profile.containers):
            out.append(
                _Machine(
                    c.id,
                    c.name,
                    c.hostname,
                    c.kind,
                    netns.container_address(self.index, k),
                    self.dir / "ct" / str(c.id),
                )
            )
        return out

    def pytest_args(self) -> list[str]:
        """Return the plugin options that point a run at this host (and its container)."""
        args = [
            f"--host=ssh://root@{self.address}",
            f"--ssh-identity={CLIENT_KEY}",
            f"--known-hosts={self.known_hosts}",
        ]
        if self.profile.containers:
            c = self.profile.containers[0]
            args.append(f"--container=pct:{c.id}" if c.kind == "pct" else f"--container=lxc:{c.name}")
        return args

    # ---- pids -----------------------------------------------------------------------------

    def _pidfile(self, what: str) -> Path:
        return self.dir / "pids" / what

    def _pid(self, what: str) -> int | None:
        try:
            pid = int(self._pidfile(what).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _is_ours(pid, self.name) else None

    def _set_pid(self, what: str, pid: int) -> None:
        self._pidfile(what).parent.mkdir(parents=True, exist_ok=True)
        self._pidfile(what).write_text(f"{pid}\n")

    def init_pid(self, cid: int | None = None) -> int:
        """Return the root-namespace PID of the host's (or container ``cid``'s) systemd."""
        pid = self._pid("init" if cid is None else f"ct{cid}-init")
        if pid is None:
            raise LabError(f"{self.name}: {'host' if cid is None else f'container {cid}'} is not running")
        return pid

    # ---- running commands -----------------------------------------------------------------

    def nsenter_argv(self, cid: int | None = None) -> list[str]:
        """Return the argv prefix that runs a command inside the host (or container) as root."""
        return [
            "nsenter",
            "-t",
            str(self.init_pid(cid)),
            "-m",
            "-u",
            "-i",
            "-n",
            "-p",
            "-C",
            "-r",
            "-w",
            "--",
        ]

    def exec(
        self, argv: Sequence[str], timeout: float = 30, cid: int | None = None, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside the host (or container) through nsenter; works when ssh does not."""
        env = {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8"}
        return subprocess.run(
            [*self.nsenter_argv(cid), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            input=input,
            check=False,
            preexec_fn=lambda: cgroups.join_cgroup(self._cg(cid, "lab-exec")),
        )

    def _cg(self, cid: int | None, leaf: str) -> str:
        base = self.cgroup if cid is None else f"{self.cgroup}/lxc/{cid}"
        return f"{base}/{leaf}"

    def ssh_argv(self, address: str | None = None, connect_timeout: float = 5) -> list[str]:
        """Return the ssh argv prefix (lab key, this host's known_hosts, strict checking)."""
        return [
            "ssh", "-i", str(CLIENT_KEY),
            "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
            "-o", f"ConnectTimeout={max(1, int(connect_timeout))}", "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=2", "-o", "ControlMaster=no", "-o", "ControlPath=none",
            f"root@{address or self.address}",
        ]  # fmt: skip

    def ssh(
        self,
        cmd: str | Sequence[str],
        timeout: float = 30,
        input: str | None = None,
        cid: int | None = None,
        via: str = "ssh",
    ) -> subprocess.CompletedProcess[str]:
        """Run a command on the host (or container ``cid``) over real SSH, or via nsenter.

        ``cmd`` as a string is a shell command line (as ssh sends it); a list is quoted first.
        A timeout raises subprocess.TimeoutExpired; ssh's own failures come back as exit 255.
        """
        line = cmd if isinstance(cmd, str) else shlex.join(cmd)
        if via == "nsenter":
            return self.exec(["/bin/sh", "-c", line], timeout=timeout, cid=cid, input=input)
        addr = self.address if cid is None else self.container_address(cid)
        return subprocess.run(
            [*self.ssh_argv(addr), line],
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            check=False,
        )

    def record(self) -> list[dict[str, Any]]:
        """Return the host's record (sysfs writes, bind/unbind, signals), oldest first."""
        path = self.state_dir / "record.jsonl"
        out: list[dict[str, Any]] = []
        if not path.exists():
            return out
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    # ---- state --------------------------------------------------------------------------------

    def is_running(self) -> bool:
        """Say whether the host's systemd is alive."""
        return self._pid("init") is not None

    def system_state(self, cid: int | None = None, timeout: float = 10) -> str:
        """Return ``systemctl is-system-running`` of the host (or container).

        ``down`` when its systemd is not running, ``no-answer`` when systemctl did not answer in time.
        """
        try:
            p = self.exec(["systemctl", "is-system-running"], timeout=timeout, cid=cid)
        except LabError:
            return "down"
        except subprocess.TimeoutExpired:
            return "no-answer"
        return p.stdout.strip() or "unknown"

    # ---- faults ---------------------------------------------------------------------------

    def cut_link(self) -> None:
        """Cut the host's link (every packet dropped, both ends): connections hang, new ones time out."""
        netns.link_up(self.name, self.index, False)

    def heal_link(self) -> None:
        """Bring the host's link back up."""
        netns.link_up(self.name, self.index, True)

    def set_netem(self, delay_ms: int = 0, loss_pct: float = 0) -> None:
        """Set netem delay/loss on the host's link (zeros clear it)."""
        if (delay_ms or loss_pct) and not netns.netem_available():
            raise LabError(NETEM_MISSING)
        netns.set_netem(self.name, self.index, delay_ms=delay_ms, loss_pct=loss_pct)

    def freeze(self) -> None:
        """Freeze every process of the host and its containers (cgroup freezer)."""
        cgroups.set_frozen(self.cgroup, True)

    def thaw(self) -> None:
        """Thaw a frozen host."""
        cgroups.set_frozen(self.cgroup, False)

    def kill_sshd(self, cid: int | None = None) -> None:
        """Stop the host's sshd (as if it died and stayed dead): new SSH connections are refused."""
        p = self.exec(
            ["systemctl", "kill", "--signal=KILL", "--kill-whom=main", "ssh.service"], cid=cid, timeout=10
        )
        if p.returncode != 0:
            raise LabError(f"{self.name}: killing sshd failed: {p.stderr.strip()}")
        # Restart=on-failure would bring it back; make it stay down as the fault intends.
        self.exec(["systemctl", "stop", "ssh.service"], cid=cid, timeout=10)

    def start_sshd(self, cid: int | None = None) -> None:
        """Start the host's sshd again after kill_sshd."""
        p = self.exec(["systemctl", "start", "ssh.service"], cid=cid, timeout=15)
        if p.returncode != 0:
            raise LabError(f"{self.name}: starting sshd failed: {p.stderr.strip()}")

    def fill_disk(self) -> None:
        """Fill the host's root filesystem: shrink its tmpfs to what is used, then fill the rest."""
        fs = self.dir / "fs"
        st = os.statvfs(fs)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        procs.run(["mount", "-o", f"remount,size={used + (16 << 20)}", str(fs)])
        target = self.dir / "root" / "var" / "tmp" / "gpulab-fill"
        with open(target, "wb") as f:
            chunk = b"\0" * (1 << 20)
            with contextlib.suppress(OSError):
                while True:
                    f.write(chunk)
                    f.flush()

    def free_disk(self) -> None:
        """Undo fill_disk."""
        target = self.dir / "root" / "var" / "tmp" / "gpulab-fill"
        target.unlink(missing_ok=True)
        procs.run(
            [
                "mount",
                "-o",
                f"remount,size={FS_SIZE.get(self.meta.get('data_scale', 'small'), '2g')}",
                str(self.dir / "fs"),
            ]
        )

    def reboot(self, timeout: float = BOOT_TIMEOUT, start_by_hand: bool = False) -> float:
        """Kill the host's PID 1, put sysfs back to the profile's boot state, boot again.

        The overlay's upper dir stays, so units installed and enabled before the reboot start
        at boot. Services the profile starts by hand (``manager: none``) stay down, as after a
        real reboot, unless ``start_by_hand``. The kernel log starts over, as a new kernel
        starts its ring buffer: nothing logged before the reboot is in the new boot's dmesg.
        Returns the seconds until SSH answered again.
        """
        t0 = time.monotonic()
        self._halt()
        _clear_reboot_faults(self.state_dir)
        (self.state_dir / "kmsg").write_text("")
        self._start_sysfs(reset_record=False)
        self._boot_all(timeout, start_by_hand=start_by_hand)
        return time.monotonic() - t0

    def reboot_from_inside(self, timeout: float = BOOT_TIMEOUT) -> float:
        """Boot the host again after its own PID 1 ended in a reboot (run by its supervisor).

        As ``reboot`` (which starts the kernel log over, as a new kernel starts its ring buffer).
        """
        launcher = self._pidfile("launcher")
        with contextlib.suppress(OSError, ValueError):
            if int(launcher.read_text().strip()) == os.getpid():
                launcher.unlink()  # this process: ``_halt`` would wait for it to end
        return self.reboot(timeout)

    def reset(self, timeout: float = BOOT_TIMEOUT) -> float:
        """Reboot into a pristine host: the overlay's upper dir and the sysfs state are wiped."""
        t0 = time.monotonic()
        self._halt()
        for m in self.machines():
            procs.umount_under(m.dir / "root")
            for sub in ("upper", "work"):
                d = self._fs(m) / sub
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
            self._mount_root(m)
        procs.stop_pid(self._pid("sysfs"))
        procs.umount_under(self.dir / "sysfs")
        for p in self.state_dir.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        self._write_state()
        self._start_sysfs(reset_record=True)
        self._boot_all(timeout)
        return time.monotonic() - t0

    def set_profile(self, profile: Profile) -> None:
        """Give the host other hardware from its next ``reboot()`` on (a part reseated or swapped in
        maintenance): the profile the sysfs daemon and the in-host tools read at boot."""
        for path in (self.dir / "profile.json", self.state_dir / "profile.json"):
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(profile.to_json())
            os.replace(tmp, path)
        self.profile = profile

    def down(self) -> None:
        """Stop the host and remove everything the lab made for it (the last host: the lab's route too)."""
        _teardown(self.dir, self.name, self.meta.get("index"))
        if not Lab().names():
            netns.remove_blackhole()

    # ---- boot machinery (used by Lab.up and reboot) ------------------------------------------

    def _fs(self, m: _Machine) -> Path:
        return self.dir / "fs" if m.cid is None else self.dir / "fs" / "ct" / str(m.cid)

    def _mount_root(self, m: _Machine) -> None:
        fs = self._fs(m)
        root = m.dir / "root"
        root.mkdir(parents=True, exist_ok=True)
        opts = f"lowerdir={fs / 'base'}:/,upperdir={fs / 'upper'},workdir={fs / 'work'}"
        procs.run(["mount", "-t", "overlay", f"gpulab-{self.name}", "-o", opts, str(root)])

    def _write_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "ctl").mkdir(exist_ok=True)
        (self.state_dir / "profile.json").write_text(self.profile.to_json())
        (self.state_dir / "kmsg").touch()

    def _start_sysfs(self, reset_record: bool) -> None:
        """(Re)start the FUSE daemon with the profile's boot state."""
        procs.stop_pid(self._pid("sysfs"))
        mnt = self.dir / "sysfs"
        procs.umount_under(mnt)
        mnt.mkdir(exist_ok=True)
        if reset_record:
            (self.state_dir / "record.jsonl").unlink(missing_ok=True)
        log = open(self.dir / "sysfs.log", "ab")  # noqa: SIM115 - handed to the daemon
        argv = [
            sys.executable, "-m", "gpulab.kernel.sysfs", "--profile", str(self.dir / "profile.json"),
            "--state", str(self.state_dir), "--mount", str(mnt), "--devdir", str(self.dir / "dev"),
        ]  # fmt: skip
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=_py_env(),
            start_new_session=True,
            cwd=str(REPO),
        )
        log.close()
        self._set_pid("sysfs", p.pid)
        deadline = time.monotonic() + 40
        while not (mnt / "pci").is_dir() or not os.path.ismount(mnt):
            if p.poll() is not None:
                tail = (self.dir / "sysfs.log").read_text(errors="replace").strip().splitlines()[-1:]
                raise LabError(f"{self.name}: sysfs daemon exited ({p.returncode}): {tail}")
            if time.monotonic() > deadline:
                raise LabError(f"{self.name}: sysfs daemon did not mount {mnt} within 40 s")
            time.sleep(0.02)

    def _launch(self, m: _Machine) -> None:
        """Start the machine's PID 1 (python -m gpulab.host.boot, which execs systemd)."""
        root = m.dir / "root"
        boot_argv = [
            sys.executable, "-m", "gpulab.host.boot", "--root", str(root), "--dev", str(m.dir / "dev"),
            "--sysfs", str(self.dir / "sysfs"), "--state", str(self.state_dir), "--procfiles", str(self.dir / "proc"),
        ]  # fmt: skip
        unshare = [
            "unshare",
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--ipc",
            "--cgroup",
            "--propagation",
            "private",
        ]
        boot_argv.append("--cgroupns")
        if m.cid is None:
            argv = ["nsenter", f"--net=/run/netns/{self.netns}", *unshare, *boot_argv]
            argv = [sys.executable, "-m", "gpulab.host.supervise", self.name, "--", *argv]
            cg = self.cgroup
        else:
            host_pid = self.init_pid()
            argv = [
                "nsenter", "-t", str(host_pid), "--pid", f"--net=/run/netns/{self.netns}-{m.cid}",
                *unshare, *boot_argv,
            ]  # fmt: skip
            cg = f"{self.cgroup}/lxc/{m.cid}"
        cgroups.make_cgroup(cg)
        log = open(m.dir / "boot.log", "ab")  # noqa: SIM115 - handed to the launcher
        p = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=_py_env(), start_new_session=True,
            cwd="/", preexec_fn=lambda: cgroups.join_cgroup(cg),
        )  # fmt: skip
        log.close()
        key = "launcher" if m.cid is None else f"ct{m.cid}-launcher"
        self._set_pid(key, p.pid)
        init = procs.find_init(p.pid, timeout=10)
        if init is None:
            raise LabError(f"{m.name}: PID 1 did not start; see {m.dir / 'boot.log'}")
        self._set_pid("init" if m.cid is None else f"ct{m.cid}-init", init)

    def _wait_booted(self, m: _Machine, deadline: float) -> str:
        """Wait until systemd says running/degraded and sshd sends its banner."""
        state = "starting"
        while time.monotonic() < deadline:
            state = self.system_state(m.cid)
            if state in ("running", "degraded"):
                break
            if state == "down":
                raise LabError(f"{m.name}: systemd died while booting; see {m.dir / 'boot.log'}")
            time.sleep(0.05)
        else:
            raise LabError(f"{m.name}: systemd still {state!r} after boot timeout")
        while time.monotonic() < deadline:
            if _ssh_banner(m.address):
                return state
            time.sleep(0.05)
        raise LabError(f"{m.name}: sshd on {m.address}:22 did not answer")

    def _write_containers_json(self) -> None:
        data = {}
        for m in self.machines()[1:]:
            pid = self._pid(f"ct{m.cid}-init")
            if pid is not None:
                data[str(m.cid)] = {
                    "name": m.name,
                    "kind": m.kind,
                    "pid": procs.nspid(pid, 1),
                    "hostname": m.hostname,
                }
        tmp = self.state_dir / ".containers.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.state_dir / "containers.json")

    def _boot_all(self, timeout: float, start_by_hand: bool = True) -> dict[str, float]:
        """Boot the host and its containers, then start the hand-started services; return timings."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        ms = self.machines()
        timings: dict[str, float] = {}
        (self.dir / "proc" / "boot_id").unlink(missing_ok=True)  # a boot id per boot (gpulab.host.boot)
        # Containers start once the host's boot is done, as Proxmox starts guests from
        # pve-guests.service after the boot units (a boot-time IOMMU fix runs before any guest).
        self._launch(ms[0])
        states = {ms[0].name: self._wait_booted(ms[0], deadline)}
        timings[ms[0].name] = round(time.monotonic() - t0, 3)
        for m in ms[1:]:
            self._launch(m)
        self._write_containers_json()
        for m in ms[1:]:
            states[m.name] = self._wait_booted(m, deadline)
            timings[m.name] = round(time.monotonic() - t0, 3)
        for m in ms:
            state = states[m.name]
            if state == "degraded":
                failed = self.exec(
                    ["systemctl", "--failed", "--no-legend", "--plain"], cid=m.cid, timeout=5
                ).stdout
                (m.dir / "failed-units").write_text(failed)
        for svc in self.profile.services:
            if svc.manager == "none" and start_by_hand:
                self._start_by_hand(svc)
        timings["total"] = round(time.monotonic() - t0, 3)
        self.meta["boot_timings"] = timings
        (self.dir / "meta.json").write_text(json.dumps(self.meta, indent=1))
        return timings

    def _start_by_hand(self, svc: Service) -> None:
        """Start a ``manager: none`` service inside its machine, detached, as an operator would."""
        cid = svc.container_id
        env = {
            "PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8", "GPULAB_SERVICE": svc.name,
            "GPULAB_IGNORE_SIGTERM": svc.ignore_sigterm,
        }  # fmt: skip
        if svc.gpus:
            env["GPULAB_GPUS"] = ",".join(svc.gpus)
        argv = units.service_argv(svc)
        if svc.kind == "decoy":
            env["GPULAB_ARGV"] = json.dumps(argv)
            argv = ["/usr/bin/python3", "/usr/local/lib/gpulab/ptyhold.py"]
        logdir = self.dir / "logs"
        logdir.mkdir(exist_ok=True)
        with open(logdir / f"{svc.name}.log", "ab") as log:
            p = subprocess.Popen(
                [*self.nsenter_argv(cid), "setsid", "-f", *argv], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env=env, preexec_fn=lambda: cgroups.join_cgroup(self._cg(cid, "by-hand")), cwd="/",
            )  # fmt: skip
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            raise LabError(f"{self.name}: starting {svc.name} by hand hung") from None

    def _halt(self) -> None:
        """SIGKILL the host's PID 1 (which ends its containers too) and wait for the launchers."""
        cgroups.thaw(self.cgroup)  # a frozen task does not die of SIGKILL until it is thawed
        for what in ["init"] + [f"ct{m.cid}-init" for m in self.machines()[1:]]:
            pid = self._pid(what)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for what in ["launcher"] + [f"ct{m.cid}-launcher" for m in self.machines()[1:]]:
            pid = self._pid(what)
            if pid is not None and not procs.wait_gone(pid, 10):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                procs.wait_gone(pid, 5)
        for d in cgroups.cgroup_dirs(self.cgroup):
            for sub in cgroups.cgroup_tree(d):
                with contextlib.suppress(OSError):
                    for pid_s in (sub / "cgroup.procs").read_text().split():
                        if int(pid_s) != os.getpid():  # the supervisor, rebooting the host
                            os.kill(int(pid_s), signal.SIGKILL)
        cgroups.remove_cgroup(self.cgroup)


def _clear_reboot_faults(state_dir: Path) -> None:
    """Drop the per-GPU runtime faults a reboot clears (CLEARED_BY_REBOOT) from faults.json."""
    path = state_dir / "faults.json"
    try:
        faults = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    gpus = faults.get("gpus") if isinstance(faults, dict) else None
    if not isinstance(gpus, dict):
        return
    for bdf, mine in list(gpus.items()):
        if not isinstance(mine, dict):
            continue
        for key in CLEARED_BY_REBOOT:
            mine.pop(key, None)
        if mine.get("nvml_error") == "GPU requires reset":
            del mine["nvml_error"]
        if not mine:
            del gpus[bdf]
    tmp = path.with_name(".faults.json.tmp")
    tmp.write_text(json.dumps(faults))
    os.replace(tmp, path)


def _ssh_banner(address: str, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, 22), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _teardown(d: Path, name: str, index: int | None) -> None:
    """Remove host ``name``: processes (by recorded PID only), mounts, netns, cgroups, files."""
    pids = d / "pids"
    recorded: dict[str, int] = {}
    if pids.is_dir():
        for f in pids.iterdir():
            with contextlib.suppress(ValueError, OSError):
                pid = int(f.read_text().strip())
                if _is_ours(pid, name):
                    recorded[f.name] = pid
    cg = f"gpulab/{name}"
    cgroups.thaw(cg)  # a frozen task does not die of SIGKILL until it is thawed
    inits = [pid for what, pid in recorded.items() if what.endswith("init")]
    for pid in inits:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in inits:
        procs.wait_gone(pid, 5)
    for what, pid in recorded.items():
        if what.endswith("launcher") and not procs.wait_gone(pid, 5):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for cgd in cgroups.cgroup_dirs(cg):
        if cgd.is_dir():
            for sub in cgroups.cgroup_tree(cgd):
                with contextlib.suppress(OSError):
                    for pid_s in (sub / "cgroup.procs").read_text().split():
                        os.kill(int(pid_s), signal.SIGKILL)
    for what, pid in recorded.items():
        if not what.endswith(("init", "launcher")):  # the FUSE daemon, a delay proxy
            procs.stop_pid(pid)
    procs.umount_under(d)
    for ns in netns.lab_netns_names():
        if ns == f"gl-{name}" or ns.startswith(f"gl-{name}-"):
            netns.delete_netns(ns)
    if index is not None:
        netns.delete_route(int(index))
    time.sleep(0.05)
    cgroups.remove_cgroup(cg)
    if not procs.mounts_under(d):
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    RUN.mkdir(parents=True, exist_ok=True)
    with open(RUN / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Lab:
    """The set of lab hosts on this machine (state under /run/gpulab)."""

    def check(self) -> None:
        """Raise LabError unless this process can run lab hosts (root, /dev/fuse, systemd)."""
        if os.geteuid() != 0:
            raise LabError("the lab needs root (namespaces, mounts, FUSE); run it as root")
        if not os.path.exists("/dev/fuse"):
            raise LabError("the lab needs /dev/fuse (FUSE sysfs); none on this machine")
        if not os.path.exists("/lib/systemd/systemd"):
            raise LabError("the lab needs systemd installed (/lib/systemd/systemd) to boot hosts")

    def names(self) -> list[str]:
        """Return the names of the lab hosts recorded under /run/gpulab."""
        if not RUN.is_dir():
            return []
        return sorted(p.name for p in RUN.iterdir() if (p / "meta.json").exists())

    def get(self, name: str) -> LabHost:
        """Return the recorded host ``name`` (LabError when there is none)."""
        if not (RUN / name / "meta.json").exists():
            raise LabError(f"no lab host named {name!r} (running: {', '.join(self.names()) or 'none'})")
        return LabHost(name)

    def up(
        self,
        profile: str | Path | Profile,
        name: str | None = None,
        delay_ms: int = 0,
        loss_pct: float = 0,
        data_scale: str = "small",
    ) -> LabHost:
        """Boot a lab host from a profile (name, path or Profile) and return it once SSH answers."""
        self.check()
        try:
            prof = profile if isinstance(profile, Profile) else load_profile(profile)
        except ProfileError as e:
            raise LabError(str(e)) from None
        name = name or prof.name
        if not NAME_RE.match(name):
            raise LabError(f"bad host name {name!r}: use lower-case letters, digits and '-', at most 40")
        netem = netns.netem_available() if (delay_ms or loss_pct) else True
        if loss_pct and not netem:
            raise LabError(NETEM_MISSING)
        if data_scale not in FS_SIZE:
            raise LabError(f"bad data scale {data_scale!r}: use one of {', '.join(FS_SIZE)}")
        t0 = time.monotonic()
        ensure_client_key()
        netns.ensure_blackhole()
        with _locked():
            d = RUN / name
            if (d / "meta.json").exists():
                raise LabError(f"lab host name {name!r} is taken; `python -m gpulab down {name}` first")
            used = set()
            for other in self.names():
                with contextlib.suppress(OSError, ValueError, KeyError):
                    used.add(json.loads((RUN / other / "meta.json").read_text())["index"])
            index = next((i for i in range(1, 251) if i not in used), None)
            if index is None:
                raise LabError("no free lab index (250 hosts are up)")
            if d.exists():
                _teardown(d, name, None)
            d.mkdir(parents=True)
            (d / "profile.json").write_text(prof.to_json())
            meta = {
                "name": name, "index": index, "profile": prof.name, "delay_ms": delay_ms, "loss_pct": loss_pct,
                "data_scale": data_scale, "created": time.time(), "owner_pid": os.getpid(),
                "delay_mode": "netem" if netem else "proxy",
            }  # fmt: skip
            (d / "meta.json").write_text(json.dumps(meta, indent=1))
        host = LabHost(name)
        try:
            self._build(host, delay_ms, loss_pct, data_scale)
            t_build = time.monotonic() - t0
            timings = host._boot_all(BOOT_TIMEOUT)
            host.meta["build_s"] = round(t_build, 3)
            host.meta["up_s"] = round(time.monotonic() - t0, 3)
            (d / "meta.json").write_text(json.dumps(host.meta, indent=1))
            del timings
        except BaseException:
            if not os.environ.get("GPULAB_KEEP_FAILED"):
                host.down()
            raise
        return host

    def _build(self, host: LabHost, delay_ms: int, loss_pct: float, data_scale: str) -> None:
        """Create the host's network, filesystems, keys and lab layer (everything but the boot)."""
        d = host.dir
        prof = host.profile
        proxy = bool(delay_ms) and host.meta.get("delay_mode") == "proxy"
        if proxy:
            netns.add_host_link(host.name, host.index)
            self._start_delay_proxy(host, delay_ms)
        else:
            netns.add_host_link(host.name, host.index, delay_ms=delay_ms, loss_pct=loss_pct)
        fs = d / "fs"
        fs.mkdir()
        procs.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"mode=755,size={FS_SIZE[data_scale]}",
                f"gpulab-{host.name}-fs",
                str(fs),
            ]
        )
        host._write_state()
        layer.write_procfiles(d / "proc", prof)
        nvidia_minors = [g.minor for g in prof.gpus if prof.function(g.bdf).driver == "nvidia"]
        known = []
        for k, m in enumerate(host.machines()):
            mfs = host._fs(m)
            for sub in ("base", "upper", "work", "work0"):
                (mfs / sub).mkdir(parents=True, exist_ok=True)
            m.dir.mkdir(parents=True, exist_ok=True)
            key = m.dir / "ssh_host_ed25519_key"
            procs.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{m.hostname}", "-f", str(key)]
            )
            known.append(f"{m.address} {' '.join(Path(str(key) + '.pub').read_text().split()[:2])}")
            self._build_layer(host, m, key, mfs)
            host._mount_root(m)
            if m.cid is None:
                boot.make_dev(m.dir / "dev", nvidia_minors)
            else:
                boot.make_dev(m.dir / "dev", [])
                for f in sorted((d / "dev").iterdir()):
                    if f.name.startswith("nvidia") and (f.is_char_device() or f.is_file()):
                        (m.dir / "dev" / f.name).touch()
                        procs.run(["mount", "--bind", str(f), str(m.dir / "dev" / f.name)])
                netns.add_container_link(host.name, host.index, m.cid, k - 1)
        (d / "known_hosts").write_text("\n".join(known) + "\n")
        host._start_sysfs(reset_record=True)

    def _start_delay_proxy(self, host: LabHost, delay_ms: int) -> None:
        """Put a user-space delay in front of the host's sshd (this kernel has no netem)."""
        pidfile = host.dir / "pids" / "delayproxy"
        pidfile.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            "ip", "netns", "exec", host.netns, sys.executable, "-m", "gpulab.host.delayproxy",
            "--listen", f"{host.address}:22", "--to", "127.0.0.1:22", "--delay-ms", str(delay_ms),
            "--pidfile", str(pidfile),
        ]  # fmt: skip
        with open(host.dir / "delayproxy.log", "ab") as log:
            p = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=_py_env(), start_new_session=True,
                cwd=str(REPO),
            )  # fmt: skip
        host._set_pid("delayproxy", p.pid)

    def _build_layer(self, host: LabHost, m: _Machine, key: Path, mfs: Path) -> None:
        """Write the lab layer of one machine: a temporary overlay whose upper dir becomes ``base``."""
        prof = host.profile
        tmp = m.dir / "build"
        tmp.mkdir(exist_ok=True)
        procs.run(["mount", "-t", "overlay", "gpulab-build", "-o",
              f"lowerdir=/,upperdir={mfs / 'base'},workdir={mfs / 'work0'}", str(tmp)])  # fmt: skip
        try:
            mine = [s for s in prof.services if s.container_id == m.cid]
            enabled = []
            for svc in mine:
                if svc.manager != "systemd":
                    continue
                extra = {"Environment": layer.service_env(svc)}
                (tmp / "etc/systemd/system" / units.unit_name(svc)).write_text(units.unit_text(svc, extra))
                if svc.enabled:
                    enabled.append(units.unit_name(svc))
            listen = (
                "127.0.0.1"
                if m.cid is None and host.meta.get("delay_mode") == "proxy" and host.meta.get("delay_ms")
                else "0.0.0.0"
            )
            boot.prepare_root(tmp, m.hostname, key, Path(str(CLIENT_KEY) + ".pub"), enabled, listen=listen)
            (tmp / "etc/gpulab/profile.json").write_text(prof.to_json())
            (tmp / "etc/gpulab/machine").write_text(
                json.dumps({"host": host.name, "container": m.cid}) + "\n"
            )
            layer.install_tools(tmp, container=m.cid is not None)
            if m.cid is None:
                pythons.install_node_python(tmp, prof.node_python)
            if m.cid is None:
                layer.populate_files(tmp, prof, host.meta.get("data_scale", "small"))
            for svc in mine:
                if svc.kind == "sglang":
                    (tmp / "var/log/sglang").mkdir(parents=True, exist_ok=True)
        finally:
            procs.run(["umount", str(tmp)], check=False)
            with contextlib.suppress(OSError):
                tmp.rmdir()
        shutil.rmtree(mfs / "work0", ignore_errors=True)
        boot.mask_dirs(mfs / "base")

    def down(self, name: str) -> None:
        """Tear down host ``name`` (also one whose up failed half-way)."""
        d = RUN / name
        index = None
        with contextlib.suppress(OSError, ValueError, KeyError):
            index = json.loads((d / "meta.json").read_text())["index"]
        if not d.exists() and f"gl-{name}" not in netns.lab_netns_names():
            raise LabError(f"no lab host named {name!r}")
        _teardown(d, name, index)

    def down_all(self, match: str = "") -> list[str]:
        """Tear down every lab host and any leftover of a crashed run; return what was removed.

        With ``match``, only hosts (and leftovers) whose name starts with it: tests use this so
        they never touch hosts that other runs on the same machine are using.
        """
        removed = []
        if RUN.is_dir():
            for p in sorted(RUN.iterdir()):
                if p.is_dir() and not p.name.startswith(".") and p.name.startswith(match):
                    self.down(p.name)
                    removed.append(p.name)
        for ns in netns.lab_netns_names():
            if ns.startswith(f"gl-{match}"):
                netns.delete_netns(ns)
                removed.append(ns)
        for mp in procs.mounts_under(RUN):
            rel = Path(mp).relative_to(RUN).parts
            if rel and rel[0].startswith(match) and procs.mounts_under(RUN / rel[0]):
                procs.umount_under(RUN / rel[0])
                removed.append(f"mounts of {rel[0]}")
        for d in cgroups.cgroup_dirs("gpulab"):
            if d.is_dir():
                for sub in d.iterdir():
                    if sub.is_dir() and sub.name.startswith(match):
                        cgroups.remove_cgroup(f"gpulab/{sub.name}")
        if not match:
            cgroups.remove_cgroup("gpulab")
        if not self.names():
            netns.remove_blackhole()
        return removed

"""A real Slurm cluster over lab hosts: slurmctld on this machine, slurmd and munged in each host.

Debian's ``slurm-wlm`` (22.05) and ``munge`` packages, installed by ``scripts/setup.sh``. Nothing
in this machine's ``/etc`` is written: every file lives under one temporary directory
``D`` (``/tmp/gpuhost-slurm-XXXX``), the same path on the controller and, inside each host's own
``/tmp`` tmpfs, on every node, so one ``slurm.conf`` serves all of them (slurm.conf(5): the file
must be the same on every node)::

    D/slurm.conf          the cluster's configuration (SLURM_CONF for the clients)
    D/hosts               the cluster's hosts file (controller and node names -> lab addresses)
    D/munge/munge.key     the cluster's own munge key (munged(8) --key-file), 0600
    D/munge/munge.socket  munged's socket on that side (slurm.conf AuthInfo=socket=...)
    D/ctl/                slurmctld's state, pid file and log (controller only)
    D/spool, D/slurmd.log slurmd's spool and log (nodes only)
    D/bin/slurm-ctl       runs a client command (srun, sinfo, scontrol, sbatch) the controller's way

Addresses. Lab hosts reach this machine only at the root-side end of their links (198.18.I.1;
this machine does not forward between links), so slurmctld binds the root-side address of the
cluster's first host, which every lab host reaches by local delivery. Slurm binds to any address
unless ``CommunicationParameters=NoCtldInAddrAny`` (slurmctld) / ``NoInAddrAny`` (every other
daemon and srun), when it binds the address its own host name resolves to (slurm.conf(5),
CommunicationParameters; src/common/slurm_protocol_api.c ``slurm_setup_addr``: gethostname(),
then getaddrinfo()). So slurmctld and the client commands run in a private mount and UTS
namespace whose host name is the controller's and whose ``/etc/hosts`` is ``D/hosts``
(``unshare --mount --uts``, then ``mount --bind``); slurmd runs under the node's systemd with
``BindReadOnlyPaths=D/hosts:/etc/hosts`` (systemd.exec(5)), and its host name (the node name) then
resolves to the host's lab address. Nothing listens on any address outside 198.18.0.0/15. slurmd
sends a step's I/O back to the address srun's launch request came from, so a /32 route per node
makes this machine's connections to the nodes leave from the controller's address (``_add_routes``).
The nodes reach one another (and nothing else) through this machine by a routing table and rules of
the cluster's own (``_link_nodes``), as a cluster's nodes do.

Node names are the hosts' host names (slurmd takes its NodeName from gethostname(); slurmd(8)
``-N``), so the hosts of one cluster must have distinct ones: boot them from a profile loaded with
``load_profile(name, overrides={"hostname": ...})``. No cgroups: ``ProctrackType=proctrack/linuxproc``
(process tree from /proc), ``TaskPlugin=task/none``, ``JobAcctGatherType=jobacct_gather/none``;
``SlurmdParameters=config_overrides`` lets a node with more CPUs than configured register
(slurm.conf(5)). munged and slurmd run in each node as two enabled units of the node's systemd
(``gpuhost-slurm-munged``, ``gpuhost-slurm-slurmd``), as on a real node: a node that reboots comes
back into the cluster by itself, D put back from the node's own copy (``NODE_KEEP``) before munged
starts. Teardown stops exactly what start started: those two units in each node (stopped and
removed; a unit's processes, job steps included, are stopped with it: systemd.kill(5)
KillMode=control-group), slurmctld and munged on this machine by the PIDs it started them with,
and the routes. ``reconfigure()`` changes slurm.conf everywhere and runs ``scontrol reconfigure``
(how the test turns on a HealthCheckProgram); ``files`` are extra files under ``D`` on every side.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpulab.errors import LabError
from gpulab.host.lab import PATH, LabHost

__all__ = ["NEEDED", "SlurmCluster", "SlurmError", "slurm_unavailable"]

# The programs the cluster needs, and the Debian packages that ship them.
NEEDED = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "srun": "slurm-client",
    "sinfo": "slurm-client",
    "scontrol": "slurm-client",
    "munged": "munge",
    "unshare": "util-linux",
}
CTL_NAME = "gpuhost-slurmctld"
MUNGE_UNIT = "gpuhost-slurm-munged"
SLURMD_UNIT = "gpuhost-slurm-slurmd"
#: A node's copy of its cluster files (key, slurm.conf, hosts, extra files), on its persistent
#: root: D is in the node's /tmp, which every boot starts empty; munged's unit puts D back from
#: here before it starts, so a node that reboots (``systemctl reboot`` inside it, as a repair
#: does) comes back into the cluster by itself, as a real node whose daemons are enabled does.
NODE_KEEP = "/var/lib/gpulab-slurm"
START_TIMEOUT = 60.0
TABLE_BASE = 30000  # routing table of a cluster: TABLE_BASE + its first host's lab index
RULE_PRIORITY = 1000


class SlurmError(LabError):
    """Slurm could not be started or a Slurm command failed; the message is one line."""


def slurm_unavailable() -> str | None:
    """Return why this machine cannot run the lab's Slurm (a missing program), or None."""
    missing = sorted({pkg for prog, pkg in NEEDED.items() if shutil.which(prog, path=PATH) is None})
    if missing:
        return (
            f"Slurm is not installed (missing Debian packages: {', '.join(missing)}); "
            "run ./scripts/setup.sh or apt-get install slurmctld slurmd slurm-client munge"
        )
    return None


class SlurmCluster:
    """slurmctld on this machine and slurmd on each of ``hosts``; ``start()``, then ``stop()``.

    ``extra_conf`` lines go into slurm.conf before the node lines (HealthCheckProgram, Prolog,
    ...). Use ``run()`` for client commands (srun, sinfo, scontrol, sbatch) from the controller,
    ``node_exec()`` for a command inside a node with the cluster's SLURM_CONF.
    """

    def __init__(
        self,
        hosts: Sequence[LabHost],
        extra_conf: Sequence[str] = (),
        partition: str = "gpu",
        files: Mapping[str, str] | None = None,
    ) -> None:
        if not hosts:
            raise SlurmError("a Slurm cluster needs at least one lab host")
        names = [h.profile.hostname for h in hosts]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SlurmError(
                f"lab hosts share the host name(s) {', '.join(dup)}: Slurm node names come from host names; "
                "boot them with load_profile(NAME, overrides={'hostname': ...})"
            )
        self.hosts = list(hosts)
        self.nodes = {h.profile.hostname: h for h in hosts}
        self.extra_conf = list(extra_conf)
        self.files = dict(files or {})  # path under D -> text, on the controller and every node
        self.partition = partition
        self.ctl_address = f"198.18.{hosts[0].index}.1"
        self.dir = Path(tempfile.mkdtemp(prefix="gpuhost-slurm-", dir="/tmp"))
        self.conf = self.dir / "slurm.conf"
        self.ctl_exec = self.dir / "bin" / "slurm-ctl"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._started_nodes: list[LabHost] = []
        self._routes: list[tuple[str, str]] = []
        self._rules: list[str] = []
        self.table = (
            TABLE_BASE + hosts[0].index
        )  # a routing table of its own (the first host's index is unique)

    # ---- files ----------------------------------------------------------------------------

    def node_names(self) -> list[str]:
        """Return the Slurm node names (the hosts' host names), in the order the hosts were given."""
        return list(self.nodes)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Return a clean environment for client commands (SLURM_CONF set; srun passes it to the tasks)."""
        env = {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8", "SLURM_CONF": str(self.conf)}
        env.update(extra or {})
        return env

    def hosts_text(self) -> str:
        """Return the cluster's /etc/hosts: localhost, the controller and every node by lab address."""
        lines = ["127.0.0.1\tlocalhost", f"{self.ctl_address}\t{CTL_NAME}"]
        lines += [f"{h.address}\t{name}" for name, h in self.nodes.items()]
        return "\n".join(lines) + "\n"

    def conf_text(self) -> str:
        """Return slurm.conf (slurm.conf(5) of Slurm 22.05)."""
        d = self.dir
        lines = [
            "# written by gpulab.slurm.cluster for one lab cluster; every path is under this directory",
            "ClusterName=gpulab",
            f"SlurmctldHost={CTL_NAME}({self.ctl_address})",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d}/munge/munge.socket",
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d}/ctl/state",
            f"SlurmctldPidFile={d}/ctl/slurmctld.pid",
            f"SlurmctldLogFile={d}/ctl/slurmctld.log",
            f"SlurmdSpoolDir={d}/spool",
            f"SlurmdPidFile={d}/slurmd.pid",
            f"SlurmdLogFile={d}/slurmd.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SlurmdTimeout=60",
            "MailProg=/bin/true",
            "InactiveLimit=0",
            "KillWait=5",
            # A step whose processes outlive SIGKILL this long drains its node ("Kill task failed");
            # on a loaded machine a lab host's tools can take a while (slurm.conf(5), default 60 s).
            "UnkillableStepTimeout=180",
            "MinJobAge=30",
            *self.extra_conf,
        ]
        for name, h in self.nodes.items():
            lines.append(f"NodeName={name} NodeAddr={h.address} CPUs=1 RealMemory=100 State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _ctl_exec_text(self) -> str:
        # A private mount and UTS namespace: the controller's host name, and D/hosts as /etc/hosts,
        # so NoCtldInAddrAny/NoInAddrAny bind the lab-side address (module docstring).
        inner = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        return (
            "#!/bin/sh\n"
            "# Run a Slurm command (slurmctld, srun, sinfo, scontrol, sbatch) as this lab cluster's controller.\n"
            f"export SLURM_CONF={shlex.quote(str(self.conf))}\n"
            f"exec unshare --mount --uts --propagation private -- /bin/sh -c {shlex.quote(inner)} "
            f'slurm-ctl {shlex.quote(str(self.dir / "hosts"))} {CTL_NAME} "$@"\n'
        )

    def _write_files(self) -> str:
        """Write the controller's files; return the munge key (text: munged takes any bytes)."""
        d = self.dir
        d.chmod(0o755)  # munged: every directory above its socket must be searchable by all
        for sub in ("munge", "ctl/state", "bin"):
            (d / sub).mkdir(parents=True, exist_ok=True)
            (d / sub).chmod(0o755)
        (d / "ctl").chmod(0o700)
        key = secrets.token_hex(64)
        fd = os.open(d / "munge" / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        self.conf.write_text(self.conf_text())
        (d / "hosts").write_text(self.hosts_text())
        self.ctl_exec.write_text(self._ctl_exec_text())
        self.ctl_exec.chmod(0o755)
        self._write_extra_here()
        return key

    def _write_extra_here(self) -> None:
        for rel, text in self.files.items():
            path = self._file_path(rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            path.chmod(0o755 if text.startswith("#!") else 0o644)

    def _file_path(self, rel: str) -> Path:
        path = (self.dir / rel).resolve()
        if not str(path).startswith(str(self.dir) + "/"):
            raise SlurmError(f"cluster file {rel!r} is outside the cluster's directory {self.dir}")
        return path

    @property
    def node_keep(self) -> str:
        """Where each node keeps its copy of the cluster files (``NODE_KEEP``)."""
        return f"{NODE_KEEP}/{self.dir.name}"

    def _write_node_files(self, h: LabHost) -> None:
        files = {"slurm.conf": self.conf.read_text(), "hosts": (self.dir / "hosts").read_text(), **self.files}
        for rel, text in files.items():
            path = self._file_path(rel)
            mode = "755" if text.startswith("#!") else "644"
            for p in (str(path), f"{self.node_keep}/{path.relative_to(self.dir)}"):
                cmd = f"mkdir -p {shlex.quote(os.path.dirname(p))} && cat > {shlex.quote(p)} && chmod {mode} {shlex.quote(p)}"
                self._node_ok(h, h.exec(["/bin/sh", "-c", cmd], input=text, timeout=30), f"write {rel}")

    def _unit_texts(self) -> dict[str, str]:
        """The two units of a node: munged (which puts D back from the node's copy first), slurmd."""
        d, keep = self.dir, self.node_keep
        restore = shlex.quote(f"umask 022; mkdir -p {d}/munge {d}/spool && cp -an {keep}/. {d}/")
        munged = (
            "[Unit]\nDescription=munged of a gpulab Slurm cluster\n\n[Service]\nType=simple\n"
            f"ExecStartPre=/bin/sh -c {restore}\n"
            f"ExecStart=/usr/sbin/munged -F --key-file={d}/munge/munge.key --socket={d}/munge/munge.socket "
            f"--pid-file={d}/munge/munged.pid --seed-file={d}/munge/munged.seed\n"
            "TimeoutStopSec=10\n\n[Install]\nWantedBy=multi-user.target\n"
        )
        # no "$" in an Exec line: systemd expands it (systemd.service(5), "Command lines")
        wait = shlex.quote(f"until test -S {d}/munge/munge.socket; do sleep 0.1; done")
        slurmd = (
            f"[Unit]\nDescription=slurmd of a gpulab Slurm cluster\nRequires={MUNGE_UNIT}.service\n"
            f"After={MUNGE_UNIT}.service\n\n[Service]\nType=simple\n"
            f"BindReadOnlyPaths={d}/hosts:/etc/hosts\nEnvironment=SLURM_CONF={self.conf}\n"
            f"ExecStartPre=/usr/bin/timeout 20 /bin/sh -c {wait}\n"
            f"ExecStart=/usr/sbin/slurmd -D -f {self.conf}\nTimeoutStopSec=10\n\n"
            "[Install]\nWantedBy=multi-user.target\n"
        )
        return {MUNGE_UNIT: munged, SLURMD_UNIT: slurmd}

    # ---- start ----------------------------------------------------------------------------

    def _spawn(self, what: str, argv: list[str]) -> None:
        log = open(self.dir / "ctl" / f"{what}.out", "ab")  # noqa: SIM115 - handed to the daemon
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=self.env(),
            start_new_session=True,
            cwd="/",
        )
        log.close()
        self._procs[what] = p

    def _wait(self, what: str, ready: object, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        p = self._procs.get(what)
        while time.monotonic() < deadline:
            if callable(ready) and ready():
                return
            if p is not None and p.poll() is not None:
                raise SlurmError(f"{what} exited ({p.returncode}): {self._tail(what)}")
            time.sleep(0.1)
        raise SlurmError(f"{what} not ready within {timeout:.0f} s: {self._tail(what)}")

    def _tail(self, what: str) -> str:
        for f in (self.dir / "ctl" / f"{what}.log", self.dir / "ctl" / f"{what}.out"):
            with contextlib.suppress(OSError):
                lines = [ln for ln in f.read_text(errors="replace").splitlines() if "error" in ln.lower()]
                if lines:
                    return lines[-1].strip()
        return f"see {self.dir / 'ctl'}"

    def start(self, timeout: float = START_TIMEOUT) -> SlurmCluster:
        """Start munged and slurmctld here, munged and slurmd in every node; wait until all are idle."""
        why = slurm_unavailable()
        if why:
            raise SlurmError(why)
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        key = self._write_files()
        d = self.dir
        sock = d / "munge" / "munge.socket"
        self._spawn(
            "munged",
            ["munged", "-F", f"--key-file={d}/munge/munge.key", f"--socket={sock}",
             f"--pid-file={d}/munge/munged.pid", f"--seed-file={d}/munge/munged.seed"],
        )  # fmt: skip
        self._wait("munged", sock.exists, 20)
        self._add_routes()
        self._link_nodes()
        self._spawn("slurmctld", [str(self.ctl_exec), "slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._wait("slurmctld", lambda: "is UP" in self.run(["scontrol", "ping"], timeout=10).stdout, timeout)
        for h in self.hosts:
            self._start_node(h, key)
        try:
            self.wait_idle(timeout)
        except SlurmError as exc:
            raise SlurmError(f"{exc} (logs: {d}/slurmd.log in each node)") from None

    def _start_node(self, h: LabHost, key: str) -> None:
        d = self.dir
        keep = self.node_keep
        setup = (
            f"set -e; umask 022; rm -rf {d} {keep}; mkdir -p {d}/munge {d}/spool {keep}/munge; "
            f"(umask 077; cat > {d}/munge/munge.key; cp -a {d}/munge/munge.key {keep}/munge/)"
        )
        self._node_ok(h, h.exec(["/bin/sh", "-c", setup], input=key, timeout=30), "write the munge key")
        self._write_node_files(h)
        self._started_nodes.append(h)
        # enabled units, not transient ones: they start again at the node's next boot
        for unit, text in self._unit_texts().items():
            path = f"/etc/systemd/system/{unit}.service"
            self._node_ok(
                h, h.exec(["/bin/sh", "-c", f"cat > {path}"], input=text, timeout=30), f"write {unit}"
            )
        # `enable` reloads the manager itself (systemctl(1)); slurmd's ExecStartPre waits for
        # munged's socket
        units = [f"{MUNGE_UNIT}.service", f"{SLURMD_UNIT}.service"]
        self._node_ok(
            h, h.exec(["systemctl", "enable", "--now", *units], timeout=60), "start munged and slurmd"
        )
        deadline = time.monotonic() + 20
        while h.exec(["test", "-S", f"{d}/munge/munge.socket"], timeout=10).returncode != 0:
            if time.monotonic() > deadline:
                raise SlurmError(f"{h.name}: munged did not create its socket within 20 s")
            time.sleep(0.1)

    @staticmethod
    def _node_ok(h: LabHost, r: subprocess.CompletedProcess[str], what: str) -> None:
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit {r.returncode}"]
            raise SlurmError(f"{h.name}: cannot {what}: {tail[0]}")

    # ---- use --------------------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 60,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (srun, sinfo, scontrol, sbatch) as the controller; never raises on exit status.

        ``env`` adds to the clean environment; srun hands that environment to its tasks.
        """
        return subprocess.run(
            [str(self.ctl_exec), *argv], capture_output=True, text=True, timeout=timeout, env=self.env(env),
            cwd=cwd or "/", check=False,
        )  # fmt: skip

    def node_exec(
        self, host: LabHost, argv: Sequence[str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside a node with SLURM_CONF set (as slurmd's children have it)."""
        return host.exec(["env", f"SLURM_CONF={self.conf}", *argv], timeout=timeout)

    def node_states(self) -> dict[str, str]:
        """Return ``{node: state}`` from ``sinfo -N`` (idle, alloc, drain, down, ... as sinfo -t names them)."""
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=20)
        out: dict[str, str] = {}
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = parts[1].lower()
        return out

    def node_reasons(self) -> dict[str, str]:
        """Return ``{node: reason}`` for nodes with a reason set (``sinfo -N -o '%N|%E'``)."""
        r = self.run(["sinfo", "-h", "-N", "-o", "%N|%E"], timeout=20)
        out: dict[str, str] = {}
        for line in r.stdout.splitlines():
            name, _, reason = line.partition("|")
            if name and reason and reason != "none":
                out[name] = reason
        return out

    def node_status(self) -> tuple[dict[str, str], dict[str, str]]:
        """Return (``node_states()``, ``node_reasons()``) from one ``sinfo`` answer: one snapshot.

        Two calls can straddle a change (a drain between them reads as "idle" with its reason).
        """
        r = self.run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], timeout=20)
        states: dict[str, str] = {}
        reasons: dict[str, str] = {}
        for line in r.stdout.splitlines():
            name, _, rest = line.partition("|")
            state, _, reason = rest.partition("|")
            if name and state:
                states[name] = state.lower()
            if name and reason and reason != "none":
                reasons[name] = reason
        return states, reasons

    def reconfigure(
        self, extra_conf: Sequence[str] | None = None, files: Mapping[str, str] | None = None
    ) -> None:
        """Change slurm.conf's extra lines (and add files), everywhere, then ``scontrol reconfigure``.

        As an operator enables a HealthCheckProgram: the same slurm.conf on every node, then
        slurmctld and every slurmd read it again (scontrol(1) reconfigure).
        """
        if extra_conf is not None:
            self.extra_conf = list(extra_conf)
        self.files.update(files or {})
        self.conf.write_text(self.conf_text())
        self._write_extra_here()
        for h in self._started_nodes:
            self._write_node_files(h)
        r = self.run(["scontrol", "reconfigure"], timeout=60)
        if r.returncode != 0:
            raise SlurmError(f"scontrol reconfigure: {(r.stderr or r.stdout).strip()}")

    def wait_idle(self, timeout: float = 120) -> None:
        """Wait until every node is idle again (a finished job's nodes stay 'completing' until its
        processes are gone); raise SlurmError with the states and reasons when they are not."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if states and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.3)
        raise SlurmError(f"nodes not idle within {timeout:.0f} s: {states}, reasons {self.node_reasons()}")

    def restart_node(self, host: LabHost) -> None:
        """Start munged and slurmd again in a node (after its reboot) and wait until it registers."""
        key = (self.dir / "munge" / "munge.key").read_text()
        if host in self._started_nodes:
            self._started_nodes.remove(host)
        self._stop_node(host)
        self._start_node(host, key)
        name = host.profile.hostname
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            state = self.node_states().get(name, "")
            if state and not state.startswith(("down", "unknown")) and not state.endswith("*"):
                return
            time.sleep(0.3)
        raise SlurmError(f"{name}: slurmd did not register within {START_TIMEOUT:.0f} s")

    # ---- routes -----------------------------------------------------------------------------

    def _add_routes(self) -> None:
        """Make this machine's connections to every node leave from the controller's address.

        slurmd sends a step's I/O and replies to the address the launch request came from (the
        peer address of srun's connection: src/slurmd/slurmd/req.c ``_rpc_launch_tasks``, the
        request's ``orig_addr``), and srun listens only on the controller's address
        (NoInAddrAny). The kernel picks a connection's source address from the route's
        ``src`` (ip-route(8)), by default the root-side address of each host's own link, so a
        /32 route per node with ``src`` the controller's address makes both ends agree. The
        routes go with the nodes' links, and stop() deletes them.
        """
        for h in self.hosts[1:]:
            dev = f"gl{h.index}-r"
            p = subprocess.run(
                ["ip", "route", "replace", f"{h.address}/32", "dev", dev, "src", self.ctl_address],
                capture_output=True, text=True, timeout=10, check=False,
            )  # fmt: skip
            if p.returncode != 0:
                raise SlurmError(f"ip route replace {h.address}/32 dev {dev}: {p.stderr.strip()}")
            self._routes.append((h.address, dev))

    def _link_nodes(self) -> None:
        """Let the cluster's nodes reach one another through this machine, and nothing else.

        Slurm's nodes talk to each other: a step's completion goes up a tree of its nodes to the
        first one (src/slurmd/slurmstepd/mgr.c, ``_wait_for_children_slurmstepd``: "Rank 0 timed
        out waiting for N children" when they cannot, and the job's nodes stay COMPLETING for
        about 80 s), and messages fan out through nodes (slurm.conf(5) TreeWidth). This machine
        does not forward, so packets arriving from the nodes' links are routed by a table of
        their own (ip-rule(8) ``iif``) that holds only the cluster's nodes and an unreachable
        default, and only those links forward (``net.ipv4.conf.DEV.forwarding``, per device for
        IPv4: ip-sysctl.rst): a node reaches the other nodes and this machine's own addresses
        (the local table comes first), never another lab host or anything off this machine.
        stop() removes the rules, the table and the forwarding.
        """
        table = str(self.table)
        for h in self.hosts:
            self._ip(["route", "replace", f"{h.address}/32", "dev", f"gl{h.index}-r", "table", table])
        self._ip(["route", "replace", "unreachable", "default", "table", table])
        for h in self.hosts:
            dev = f"gl{h.index}-r"
            self._ip(["rule", "add", "iif", dev, "lookup", table, "priority", str(RULE_PRIORITY)])
            self._rules.append(dev)
            Path(f"/proc/sys/net/ipv4/conf/{dev}/forwarding").write_text("1\n")

    def _unlink_nodes(self) -> None:
        table = str(self.table)
        for dev in self._rules:
            with contextlib.suppress(OSError):
                Path(f"/proc/sys/net/ipv4/conf/{dev}/forwarding").write_text("0\n")
            self._ip(
                ["rule", "del", "iif", dev, "lookup", table, "priority", str(RULE_PRIORITY)], check=False
            )
        self._rules.clear()
        self._ip(["route", "flush", "table", table], check=False)

    @staticmethod
    def _ip(args: list[str], check: bool = True) -> None:
        p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
        if check and p.returncode != 0:
            raise SlurmError(f"ip {' '.join(args)}: {p.stderr.strip()}")

    def _del_routes(self) -> None:
        for addr, dev in self._routes:
            subprocess.run(
                ["ip", "route", "del", f"{addr}/32", "dev", dev, "src", self.ctl_address],
                capture_output=True, text=True, timeout=10, check=False,
            )  # fmt: skip
        self._routes.clear()
        self._unlink_nodes()

    # ---- stop -------------------------------------------------------------------------------

    def _stop_node(self, h: LabHost) -> None:
        if not h.is_running():
            return
        units = [f"{SLURMD_UNIT}.service", f"{MUNGE_UNIT}.service"]
        with contextlib.suppress(subprocess.TimeoutExpired, LabError):
            h.exec(["systemctl", "stop", *units], timeout=30)
            h.exec(["systemctl", "reset-failed", *units], timeout=10)
            # what `disable` would remove, without the manager reload it costs: the next boot (or
            # the next cluster's `enable`, which reloads) finds no unit
            wants = "/etc/systemd/system/multi-user.target.wants"
            h.exec(
                ["rm", "-f", *(f"/etc/systemd/system/{u}" for u in units), *(f"{wants}/{u}" for u in units)],
                timeout=10,
            )
            h.exec(["rm", "-rf", str(self.dir), self.node_keep], timeout=30)

    def stop(self) -> None:
        """Stop what start() started (nodes' units, then slurmctld and munged here); remove the files."""
        for h in self._started_nodes:
            self._stop_node(h)
        self._started_nodes.clear()
        for what in ("slurmctld", "munged"):
            p = self._procs.pop(what, None)
            if p is None:
                continue
            if p.poll() is None:  # our unreaped child: its PID cannot have been reused
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)
                    p.wait(timeout=5)
            else:
                p.poll()
        self._del_routes()
        if os.environ.get("GPULAB_KEEP_SLURM"):
            return
        shutil.rmtree(self.dir, ignore_errors=True)

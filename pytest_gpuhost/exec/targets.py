"""Target descriptions (URLs, container specs) and the pool of open connections.

`parse_host_url` accepts `ssh://[user@]host[:port]`, `paramiko://` (same), `local://`, and the
testinfra container schemes that can carry our agent: `docker://[user@]NAME`,
`podman://[user@]NAME`, `kubectl://POD?container=C&namespace=N`, `lxc://NAME` (LXD's `lxc exec`).
Query options on any URL: `sudo=1`, `python=python3.11` (the only interpreter the agent may
use; without it the agent finds one: exec/pythons.py), `identity=PATH`, `timeout=S`;
`?path=/a:/b` replaces PATH for programs started on this machine (local://, docker:// ...;
tests use it to hide python3 or to put stand-in tools first).

`--container` values: `pct:ID` (`pct exec ID --` through the host), `lxc:NAME`
(`lxc-attach -n NAME --`), `docker:NAME` (`docker exec -i NAME`), `ssh://...` (its own SSH).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.connect import connect
from pytest_gpuhost.exec.connection import Connection, ConnectionOptions
from pytest_gpuhost.exec.launch import Launcher, LocalLauncher, PrefixLauncher
from pytest_gpuhost.exec.nodename import local_node_name
from pytest_gpuhost.exec.ssh.openssh import OpenSSHLauncher, OpenSSHTransport, ssh_client
from pytest_gpuhost.exec.ssh.paramiko import HOST_KEY_POLICIES, SSHLauncher, SSHTransport

__all__ = [
    "SCHEMES",
    "ContainerSpec",
    "TargetOptions",
    "TargetPool",
    "TargetSpec",
    "open_connection",
    "open_container",
    "parse_container",
    "parse_host_url",
]

SCHEMES = ("ssh", "paramiko", "local", "docker", "podman", "kubectl", "lxc")
_UNSUPPORTED = {
    "ansible": "it runs modules, not commands; use ssh:// to the same host",
    "salt": "it has no interactive channel; use ssh:// to the minion",
    "winrm": "Windows targets have no POSIX agent",
    "openshift": "use kubectl://",
    "chroot": "use local:// inside the chroot",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.:@/+-]*$")


@dataclass(frozen=True)
class ContainerSpec:
    """Where a service's container is: `kind` pct | lxc | docker | ssh."""

    kind: str
    name: str
    text: str
    target: TargetSpec | None = None  # for kind "ssh"

    def prefix(self) -> list[str]:
        """Return the argv prefix that runs a program inside the container from its host."""
        if self.kind == "pct":
            return ["pct", "exec", self.name, "--"]
        if self.kind == "lxc":
            return ["lxc-attach", "-n", self.name, "--"]
        if self.kind == "docker":
            return ["docker", "exec", "-i", self.name]
        raise TargetError(f"container {self.text} is reached by its own SSH, not through the host")


@dataclass
class TargetSpec:
    """One target as given on the command line or in an inventory."""

    url: str
    scheme: str
    user: str | None = None
    hostname: str = ""
    port: int | None = None
    name: str = ""
    vars: dict[str, Any] = field(default_factory=dict)
    container: ContainerSpec | None = None
    query: dict[str, str] = field(default_factory=dict)


@dataclass
class TargetOptions:
    """Connection settings shared by every target of a run (the plugin fills it from options).

    SSH targets go through the system's OpenSSH client where `ssh` is on PATH (ssh/openssh.py),
    else through paramiko (ssh/paramiko.py); both read `ssh_config` (None: the user's and the system's).
    """

    command_timeout: float = 60.0
    connect_timeout: float = 10.0  # the one default: both SSH transports take it from here
    identity: str | None = None
    known_hosts: str | None = None
    host_key_policy: str = "strict"
    sudo: bool = False
    ssh_config: str | None = None


def _bad(url: str, why: str) -> TargetError:
    return TargetError(f"bad target URL {url!r}: {why}")


#: The longest timeout any option or URL accepts: a week. Longer ones overflow the platform's
#: timers (select, sleep) and are never what an operator meant.
MAX_TIMEOUT = 7 * 86400.0


def check_timeout(raw: object) -> float:
    """Return `raw` as seconds in (0, MAX_TIMEOUT]; raise ValueError saying what to give instead."""
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{raw!r} is not a number of seconds; give e.g. 60") from None
    if not 0 < value <= MAX_TIMEOUT:  # also false for NaN
        raise ValueError(f"{raw!r}: give seconds greater than 0 and at most {MAX_TIMEOUT:.0f} (a week)")
    return value


def parse_host_url(url: str, *, name: str | None = None, node_name: str | None = None) -> TargetSpec:
    """Parse a `--host` URL; raise TargetError (one line, with what to type) when it is wrong.

    A `local://` target is named after this machine (exec/nodename.py: its host name, made safe)
    unless `node_name` (`--node-name`) or `name` (an inventory's) names it.
    """
    text = url.strip()
    if not text:
        raise _bad(url, "empty")
    if "://" not in text:
        raise _bad(url, "no scheme; write ssh://user@host:port, local:// or docker://NAME")
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    if scheme in _UNSUPPORTED:
        raise TargetError(f"target scheme {scheme}:// is not supported: {_UNSUPPORTED[scheme]}")
    if scheme not in SCHEMES:
        raise TargetError(
            f"unknown target scheme {scheme!r} in {url!r}: use one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError as exc:  # e.g. "Invalid IPv6 URL" for an unclosed '['
        raise _bad(url, f"{exc} (unclosed '[' or ']'?)") from None
    query = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items()}
    if "timeout" in query:
        try:
            check_timeout(query["timeout"])
        except ValueError as exc:
            raise _bad(url, f"timeout={exc}") from None
    if scheme == "local":
        if parts.netloc not in ("", "localhost") or parts.path not in ("", "/"):
            raise _bad(url, "local:// takes no host or path (options go after '?')")
        return TargetSpec(
            url=text,
            scheme="local",
            hostname="localhost",
            name=name or local_node_name(node_name),
            query=query,
        )
    netloc = parts.netloc
    if not netloc:
        raise _bad(url, f"{scheme}:// needs a host or container name")
    user = None
    if "@" in netloc:
        user, _, netloc = netloc.rpartition("@")
        user = urllib.parse.unquote(user)
        if not user:
            raise _bad(url, "empty user before '@'")
        if ":" in user:
            raise _bad(url, "passwords in URLs are not accepted; use an SSH key (--ssh-identity)")
    port: int | None = None
    host = netloc
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            raise _bad(url, "unclosed '[' in IPv6 address")
        host, rest_port = host[1:end], host[end + 1 :]
        if rest_port:
            if not rest_port.startswith(":"):
                raise _bad(url, "junk after IPv6 address")
            port = _port(url, rest_port[1:])
    elif ":" in host:
        host, _, p = host.rpartition(":")
        port = _port(url, p)
    host = urllib.parse.unquote(host)
    if not host:
        raise _bad(url, "empty host")
    if scheme in ("ssh", "paramiko"):
        if not _valid_hostname(host):
            raise _bad(url, f"{host!r} is not a host name or address")
        if parts.path not in ("", "/"):
            raise _bad(url, "ssh:// URLs take no path")
        port = port or 22
    elif not _NAME_RE.match(host):
        raise _bad(url, f"{host!r} is not a container name")
    return TargetSpec(
        url=text,
        scheme="ssh" if scheme == "paramiko" else scheme,
        user=user,
        hostname=host,
        port=port,
        name=name or host,
        query=query,
    )


def _port(url: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _bad(url, f"port {text!r} is not a number from 1 to 65535")
    return int(text)


def _valid_hostname(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    if len(host) > 253:
        return False
    return all(
        re.match(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$", label)
        for label in host.rstrip(".").split(".")
    )


def parse_container(text: str) -> ContainerSpec:
    """Parse a `--container` value: pct:ID, lxc:NAME, docker:NAME or ssh://..."""
    raw = text.strip()
    if raw.startswith(("ssh://", "paramiko://")):
        spec = parse_host_url(raw)
        return ContainerSpec("ssh", spec.hostname, raw, spec)
    kind, sep, name = raw.partition(":")
    if not sep or not name:
        raise TargetError(f"bad container {text!r}: write pct:ID, lxc:NAME, docker:NAME or ssh://user@host")
    kind = kind.lower()
    if kind == "pct":
        if not name.isdigit():
            raise TargetError(f"bad container {text!r}: a Proxmox container ID is a number (pct:101)")
    elif kind in ("lxc", "docker"):
        if not _NAME_RE.match(name) or "/" in name:
            raise TargetError(f"bad container {text!r}: {name!r} is not a container name")
    else:
        raise TargetError(f"unknown container kind {kind!r} in {text!r}: use pct:, lxc:, docker: or ssh://")
    return ContainerSpec(kind, name, raw)


def _launcher(spec: TargetSpec, options: TargetOptions) -> Launcher:
    q = spec.query
    if spec.scheme == "local":
        env = {"PATH": q["path"]} if "path" in q else None
        return LocalLauncher(env)
    if spec.scheme == "ssh":
        policy = options.host_key_policy
        if policy not in HOST_KEY_POLICIES:
            raise TargetError(
                f"unknown host key policy {policy!r}: use one of {', '.join(HOST_KEY_POLICIES)}"
            )
        port = spec.port if _explicit_port(spec) else None  # else ssh_config's Port (or 22)
        user = spec.user or spec.vars.get("ansible_user")
        identity = q.get("identity") or options.identity
        ssh = ssh_client()
        if ssh is not None:
            return OpenSSHLauncher(
                OpenSSHTransport(
                    spec.hostname,
                    port,
                    user,
                    identity=identity,
                    known_hosts=options.known_hosts,
                    host_key_policy=policy,
                    connect_timeout=float(options.connect_timeout),
                    ssh_config=options.ssh_config,
                    ssh=ssh,
                )
            )
        transport = SSHTransport(
            spec.hostname,
            port,
            user,
            identity=identity,
            known_hosts=options.known_hosts,
            host_key_policy=policy,
            connect_timeout=float(options.connect_timeout),
            ssh_config=options.ssh_config,
        )
        return SSHLauncher(transport)
    local = LocalLauncher({"PATH": q["path"]} if "path" in q else None)
    if spec.scheme in ("docker", "podman"):
        prefix = [spec.scheme, "exec", "-i"] + (["-u", spec.user] if spec.user else []) + [spec.hostname]
        return PrefixLauncher(local, prefix, f"{spec.scheme} {spec.hostname}", owns_base=True)
    if spec.scheme == "kubectl":
        prefix = ["kubectl", "exec", "-i", spec.hostname]
        if q.get("container"):
            prefix += ["-c", q["container"]]
        if q.get("namespace"):
            prefix += ["-n", q["namespace"]]
        if q.get("context"):
            prefix += ["--context", q["context"]]
        return PrefixLauncher(local, prefix + ["--"], f"kubectl {spec.hostname}", owns_base=True)
    if spec.scheme == "lxc":
        return PrefixLauncher(
            local, ["lxc", "exec", spec.hostname, "--"], f"lxc {spec.hostname}", owns_base=True
        )
    raise TargetError(f"unknown target scheme {spec.scheme!r}")


def open_connection(spec: TargetSpec, options: TargetOptions | None = None) -> Connection:
    """Open a Connection to `spec` with its agent started (or the fallback, without a usable Python).

    Raise `ConnectError` (an `Unreachable`) when the target cannot be reached.
    """
    options = options or TargetOptions()
    launcher = _launcher(spec, options)
    if _truthy(spec.query.get("sudo")) or options.sudo:
        launcher = PrefixLauncher(
            launcher, ["sudo", "-n", "--"], f"sudo on {launcher.description}", owns_base=True
        )
    timeout = spec.query.get("timeout") or options.command_timeout
    opts = ConnectionOptions(
        command_timeout=float(timeout),
        python=spec.query.get("python") or _python_var(spec.vars.get("ansible_python_interpreter")),
        connect_timeout=float(options.connect_timeout),
    )
    conn = connect(spec.name or spec.hostname, launcher, opts)
    conn.container_opener = lambda host, cs: open_container(host, cs, options)
    return conn


def open_container(
    host: Connection, container: ContainerSpec | str, options: TargetOptions | None = None
) -> Connection:
    """Open a connection into `container`: through `host`'s launcher, or by its own SSH for ssh://.

    `Connection.container()` calls this (through the opener `open_connection` gives it), which
    also closes the container's connection with the host's.
    """
    cs = container if isinstance(container, ContainerSpec) else parse_container(str(container))
    if cs.kind == "ssh":
        assert cs.target is not None
        return open_connection(cs.target, options)
    launcher = PrefixLauncher(host.launcher, cs.prefix(), f"{cs.kind}:{cs.name} via {host.name}")
    conn = connect(f"{host.name}/{cs.name}", launcher, dataclasses.replace(host.opts))
    conn.container_opener = lambda inner, spec: open_container(inner, spec, options)
    return conn


def _python_var(value: Any) -> str:
    """`ansible_python_interpreter` as ours: Ansible's `auto*` values mean "find one", as here."""
    text = str(value or "")
    return "" if text.startswith("auto") else text


def _explicit_port(spec: TargetSpec) -> bool:
    """Whether the port was written (the URL's, or a spec built by hand), not parse_host_url's 22."""
    if spec.port not in (None, 22):
        return True
    try:
        return urllib.parse.urlsplit(spec.url).port is not None
    except ValueError:
        return False


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("1", "yes", "true", "on")


class TargetPool:
    """Open connections lazily, one per target name, reused; `close_all` at session end."""

    def __init__(self, options: TargetOptions | None = None) -> None:
        self.options = options if options is not None else TargetOptions()
        self._conns: dict[tuple[str, str], Connection] = {}
        self._containers: dict[tuple[str, str, str], Connection] = {}
        self._lock = threading.Lock()
        self._opening: dict[object, threading.Lock] = {}  # one lock per target: hosts connect in parallel

    def _key_lock(self, key: object) -> threading.Lock:
        with self._lock:
            return self._opening.setdefault(key, threading.Lock())

    def get(self, spec: TargetSpec) -> Connection:
        """Return the open connection for `spec`, opening it on first use.

        Keyed by name and URL: `ssh://h:2222` and `ssh://h:2223` are both named `h` yet are two
        targets.
        """
        key = (spec.name, spec.url)
        with self._key_lock(key):
            conn = self._conns.get(key)
            if conn is None:
                conn = open_connection(spec, self.options)
                with self._lock:
                    self._conns[key] = conn
            return conn

    def container(self, spec: TargetSpec, container: ContainerSpec | None = None) -> Connection | None:
        """Return the connection to the target's container (the spec's own, or `container`)."""
        cs = container or spec.container
        if cs is None:
            return None
        key = (spec.name, spec.url, cs.text)
        host = self.get(spec)
        with self._key_lock(key):
            conn = self._containers.get(key)
            if conn is None:
                conn = host.container(cs)
                with self._lock:
                    self._containers[key] = conn
            return conn

    def connections(self) -> list[Connection]:
        return list(self._conns.values())

    def close_all(self) -> None:
        """Close every connection (containers first); errors while closing are ignored."""
        with self._lock:
            conns = list(self._containers.values()) + list(self._conns.values())
            n_hosts = len(self._conns)
            self._containers.clear()
            self._conns.clear()

        def close(conn: Connection) -> None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing must reach every connection
                pass

        # containers first, then hosts; each group in parallel, since closing waits up to a
        # second for the agent to exit (a round trip each: 16 hosts 25 ms away took 1 s in series)
        for group in (conns[: len(conns) - n_hosts], conns[len(conns) - n_hosts :]):
            if len(group) < 2:
                for conn in group:
                    close(conn)
                continue
            with ThreadPoolExecutor(max_workers=min(32, len(group)), thread_name_prefix="close") as pool:
                list(pool.map(close, group))

"""The run's targets and their connection pool, kept in `config.stash` under the keys below.

`plugin.py` fills `targets_key` at configure time (`load_targets`) and closes the pool at the end
of the session (`close_pool`); the fixtures (`run/fixtures.py`), the suites and the report layer
read them through `get_target` and `get_pool`. Connections open lazily, on a target's first use.
"""

from __future__ import annotations

import functools
import shutil
from typing import Any

import pytest

from pytest_gpuhost.errors import AgentError, ConnectError, GpuhostError, Unreachable
from pytest_gpuhost.exec.ssh.client_facts import client_facts
from pytest_gpuhost.exec.targets import (
    TargetOptions,
    TargetPool,
    TargetSpec,
    parse_container,
    parse_host_url,
)
from pytest_gpuhost.redact import printable
from pytest_gpuhost.run import evidence, unreachable
from pytest_gpuhost.run.record import target_name
from pytest_gpuhost.run.remediation import TARGET_PARAM
from pytest_gpuhost.run.settings import Settings, settings_key

__all__ = [
    "NO_TARGET_REASON",
    "Target",
    "UnknownTarget",
    "close_pool",
    "get_pool",
    "get_target",
    "load_targets",
    "parametrize_targets",
    "pool_key",
    "require_targets",
    "sudo_hint",
    "require_targets_xdist",
    "targets_key",
]

NO_TARGET_REASON = (
    "no target: pass --host=URL (e.g. --host=local:// or --host=ssh://root@gpu-host) or --inventory=PATH"
)


class UnknownTarget(GpuhostError):
    """A target name that is not one of this run's targets (after `pytest_gpuhost_targets`)."""


#: The run's target specs, in order (after `pytest_gpuhost_targets`); the same in every process.
targets_key = pytest.StashKey[list[Any]]()
#: The run's TargetPool, made on first use.
pool_key = pytest.StashKey[TargetPool]()
_target_objects_key = pytest.StashKey[dict[str, "Target"]]()


def load_targets(config: pytest.Config, s: Settings) -> list[Any]:
    """Parse --host, --inventory and --container into specs and let `pytest_gpuhost_targets` edit them."""
    specs: list[Any] = []
    sources = s.sources
    for url in s.hosts:
        try:
            specs.append(parse_host_url(url, node_name=s.node_name))
        except GpuhostError as exc:
            raise sources["hosts"].error(str(exc), raw=url) from None
    if s.inventory:
        from pytest_gpuhost.exec.inventory.load import load_inventory  # YAML, only when an inventory is given

        try:
            specs.extend(load_inventory(s.inventory, reader=s.inventory_reader))
        except GpuhostError as exc:
            raise sources["inventory"].error(f"bad inventory: {exc}") from None
    if s.container:
        try:
            container = parse_container(s.container)
        except GpuhostError as exc:
            raise sources["container"].error(str(exc)) from None
        for spec in specs:
            if getattr(spec, "container", None) is None:
                spec.container = container
    config.hook.pytest_gpuhost_targets(config=config, targets=specs)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise pytest.UsageError(f"gpuhost: target {spec.name!r} is given twice (--host / --inventory)")
        seen.add(spec.name)
    return specs


class Target:
    """One machine or container of the run: its spec, its connection (opened on first use), its vars.

    A connect that fails is remembered for the rest of the run (in this process: one Target per
    name and config, so per xdist worker): the target's later tests fail at once with the same
    reason instead of each waiting for another connect timeout. Only `ConnectError` (could not
    reach, authentication or host key refused) is remembered; a connection that was open and is
    lost later is the connection's own business (`run/procedure.py` charges it to its link).
    """

    def __init__(self, spec: TargetSpec, pool: TargetPool, config: pytest.Config | None = None) -> None:
        self.spec = spec
        self.name: str = spec.name
        self.vars: dict[str, Any] = dict(getattr(spec, "vars", {}) or {})
        self._pool = pool
        self._config = config
        self._failed: dict[str, ConnectError] = {}  # "host" / "container" -> the first connect error
        self._recorded: set[str] = set()

    def _open(self, which: str, opener: Any) -> Any:
        first = self._failed.get(which)
        if first is not None:
            again = type(first)(f"{first}{unreachable.NOT_RETRIED}")
            raise again from None
        try:
            conn = opener()
        except ConnectError as exc:
            self._failed.setdefault(which, exc)
            raise
        if which not in self._recorded and conn is not None:
            self._recorded.add(which)
            evidence.connection(describe_connection(self.name, which, conn, self.spec))
        return conn

    def _hooked(self, conn: Any) -> Any:
        # The connection calls pytest_gpuhost_command on this config for every command.
        if conn is not None and getattr(conn, "config", None) is None:
            conn.config = self._config
        return conn

    @property
    def conn(self) -> Any:
        """The target's Connection (its agent is started on first use)."""
        return self._hooked(self._open("host", lambda: self._pool.get(self.spec)))

    @property
    def container_conn(self) -> Any:
        """The Connection into the target's container, or None when it has none."""
        if getattr(self.spec, "container", None) is None:
            return None
        self._open("host", lambda: self._pool.get(self.spec))  # a host that failed fails its container
        return self._hooked(self._open("container", lambda: self._pool.container(self.spec)))

    def __repr__(self) -> str:
        return f"<Target {self.name}>"


@functools.cache
def client_version(client: str) -> str:
    """Return the version of the SSH client that carries a connection ("" for a local one).

    OpenSSH prints it with `ssh -V` on stderr ("OpenSSH_9.2p1 Debian-2+deb12u3, OpenSSL 3.0.15 ...");
    paramiko has `__version__`. Read once per process.
    """
    if client == "openssh":
        ssh = shutil.which("ssh")
        if ssh is None:
            return "unknown (no ssh on PATH any more)"
        return client_facts(ssh).banner  # the `ssh -V` the connection already ran
    if client == "paramiko":
        import paramiko

        return f"paramiko {paramiko.__version__}"
    return ""


def describe_connection(name: str, which: str, conn: Any, spec: Any) -> dict[str, Any]:
    """Say how a target was reached, for the run's evidence: client, its version, agent or fallback,
    and the node's side (its Python and where, or why the agent could not start)."""
    launcher = getattr(conn, "launcher", None)
    client = str(getattr(launcher, "client", "") or "")
    container = getattr(spec, "container", None) if which == "container" else None
    return {
        "target": name,
        "to": f"container {getattr(container, 'text', '')}".strip() if which == "container" else "host",
        "client": client,
        "version": client_version(client),
        "mode": str(getattr(conn, "mode", "") or ""),
        "via": str(getattr(launcher, "description", "") or ""),
        # the node's side, for the report's environment: its Python, kernel and our agent's version
        **{
            f"node_{k}": str(v)
            for k, v in (getattr(conn, "hello", None) or {}).items()
            if k in ("python", "executable", "kernel", "version") and v
        },
        # a fallback connection: the one line saying why the agent could not start
        **({"no_python": str(conn.no_python)} if getattr(conn, "no_python", "") else {}),
    }


def get_pool(config: pytest.Config) -> TargetPool:
    """Return the run's TargetPool, made on first use (connections open lazily)."""
    pool = config.stash.get(pool_key, None)
    if pool is None:
        s = config.stash[settings_key]
        pool = TargetPool(
            TargetOptions(
                command_timeout=s.command_timeout,
                connect_timeout=s.connect_timeout,
                identity=s.ssh_identity,
                ssh_config=s.ssh_config,
                known_hosts=s.known_hosts,
                host_key_policy=s.host_key_policy,
                sudo=s.sudo,
            )
        )
        config.stash[pool_key] = pool
    return pool


def get_target(config: pytest.Config, name: str) -> Target:
    """Return the Target called `name` (one object per name and run)."""
    cache = config.stash.setdefault(_target_objects_key, {})
    if name not in cache:
        specs = config.stash.get(targets_key, [])
        spec = next((s for s in specs if s.name == name), None)
        if spec is None:
            known = ", ".join(s.name for s in specs) or "none"
            raise UnknownTarget(f"no target {name!r} in this run (its targets: {known})")
        cache[name] = Target(spec, get_pool(config), config)
    return cache[name]


def close_pool(config: pytest.Config) -> None:
    """Close every connection of the run (idempotent: the session and unconfigure both call it)."""
    pool = config.stash.get(pool_key, None)
    if pool is not None:
        del config.stash[pool_key]
        config.stash[_target_objects_key] = {}
        pool.close_all()


def parametrize_targets(metafunc: pytest.Metafunc) -> None:
    """Run a test that uses `target` (or `host`, ...) once per target; skip it when there is none."""
    if TARGET_PARAM not in metafunc.fixturenames:
        return
    names = [spec.name for spec in metafunc.config.stash.get(targets_key, [])]
    if names:
        metafunc.parametrize(TARGET_PARAM, names, ids=names, indirect=True, scope="module")
    else:
        params = [pytest.param(None, id=NO_TARGET_ID, marks=pytest.mark.skip(reason=NO_TARGET_REASON))]
        metafunc.parametrize(TARGET_PARAM, params, indirect=True, scope="module")


NO_TARGET_ID = "no-target"


def require_targets(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a run whose tests need a target when it has none (collect-only is let through).

    Skipping them instead would let CI pass with nothing checked. Tests that use none of the
    plugin's target fixtures (an unrelated test run in the same virtualenv) are not concerned.
    An xdist worker leaves it to the controller (`require_targets_xdist`): a usage error raised
    in a worker's collection crashes the worker instead of ending the run.
    """
    if hasattr(config, "workerinput"):
        return
    needing = [item.nodeid for item in items if TARGET_PARAM in getattr(item, "fixturenames", ())]
    _refuse_without_targets(config, needing)


def require_targets_xdist(config: pytest.Config, ids: list[str]) -> None:
    """The controller's `require_targets` under xdist: it sees the workers' node ids only."""
    needing = [nodeid for nodeid in ids if NO_TARGET_ID in _param_parts(nodeid)]
    _refuse_without_targets(config, needing)


def _param_parts(nodeid: str) -> str:
    head, bracket, params = nodeid.rpartition("::")[2].partition("[")
    return params if bracket else ""


def _refuse_without_targets(config: pytest.Config, needing: list[str]) -> None:
    if not needing or config.stash.get(targets_key, []) or config.option.collectonly:
        return
    s = config.stash[settings_key]
    why = "no target"
    if s.inventory:
        why = f"{s.sources['inventory']}={s.inventory!r} lists no host"
    elif s.hosts:
        why = "the pytest_gpuhost_targets hook removed every target"
    raise pytest.UsageError(
        f"gpuhost: {why}, and {len(needing)} test(s) need one (first: {printable(needing[0])}); "
        "pass --host=URL (e.g. --host=local:// or --host=ssh://root@gpu-host) or --inventory=PATH"
    )


#: Exit statuses of a command that could not be run (`sudo` itself, or the program it was given).
NOT_RUN = (126, 127)


def sudo_hint(item: pytest.Item, report: pytest.TestReport, exc: BaseException | None) -> str | None:
    """Return a hint when a failed test ran through sudo and something could not be run.

    "Could not be run": a command exited 126/127, or the agent did not start (`exc` is one of the
    execution layer's errors). Over SSH, `sudo -n -- python3 ...` on a host without sudo exits
    127 exactly as a missing program would; only the operator can tell which, so the hint names both.
    """
    if not report.failed:
        return None
    name = target_name(item)
    spec = next((s for s in item.config.stash.get(targets_key, []) if s.name == name), None)
    if spec is None:
        return None
    s = item.config.stash[settings_key]
    query = getattr(spec, "query", None) or {}
    if not (s.sudo or str(query.get("sudo", "")).lower() in ("1", "true", "yes", "on")):
        return None
    commands = (getattr(report, "gpuhost_evidence", None) or {}).get("commands") or []
    not_run = any(c.get("rc") in NOT_RUN for c in commands)
    if not not_run and not isinstance(exc, Unreachable | AgentError):
        return None
    how = "--sudo" if s.sudo else "?sudo=1 in its URL"
    return (
        f"{printable(name)} runs commands through sudo ({how}) and something could not be run (exit status "
        f"126/127, or the agent did not start): if sudo is not installed there, connect as root and "
        f"drop {how}; otherwise install the missing program (or give ?python=PATH for the agent)"
    )

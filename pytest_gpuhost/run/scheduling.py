"""xdist scheduling that keeps one host's procedure on one worker, in collection order.

With `-n N` (xdist's default `--dist load`) this plugin hands xdist a `HostScheduling`: every
test whose id names a target (the `[...]` part of the node id, as the `target`/`host` fixtures
parametrize it) joins that target's work unit; a unit goes to one worker whole, in collection
order, and units are spread over the workers as they free up. So one host gets one connection,
its procedure runs in order, and a slow or unreachable host holds up one worker, not all.
Tests that name no target are units of one and are balanced like `--dist load`.

(xdist is a dependency of this package; `-p no:xdist` just leaves the hook unused.)
xdist's own `--dist loadgroup` needs `xdist_group` marks added at collection, which is fragile
on recent pytest; grouping by the node id needs nothing from the workers but the ids they send.
The known target names come from `pytest_gpuhost_targets` (recorded by `pytest_gpuhost.report.fleet`
in every process, the controller included); without them the whole `[...]` id is the host.
`--gpuhost-scheduling=xdist` (ini `gpuhost_scheduling`, declared with the plugin's options in
`run/settings.py`) leaves xdist's choice alone; `workers` uses the host scheduler even where
`fit_workers` would check in this process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

from pytest_gpuhost.run import settings

__all__ = [
    "CHOICES",
    "TARGET_NAMES",
    "HostScheduling",
    "assign_units",
    "fit_workers",
    "host_of_nodeid",
    "hosts_for_worker",
    "param_id",
    "scope_of",
    "static_assignment",
]

#: The target names of this run, in order (set by pytest_gpuhost.report.fleet; may be absent).
TARGET_NAMES = pytest.StashKey[list[str]]()
CHOICES = settings.SCHEDULING_CHOICES


def param_id(nodeid: str) -> str | None:
    """Return the parametrization id of a node id (`a.py::test_x[gpu-1]` -> `gpu-1`), or None."""
    _, sep, rest = nodeid.partition("::")
    if not sep:
        return None
    i = rest.find("[")
    if i < 0 or not rest.endswith("]"):
        return None
    return rest[i + 1 : -1]


def host_of_nodeid(nodeid: str, known: Iterable[str] | None = None) -> str | None:
    """Return the target a test runs against, judged from its node id.

    With `known` target names, the longest one that is the id or a `-`-separated part of it
    wins (`test_x[gpu-1-extra]` -> `gpu-1`); an id naming no known target gives None. Without
    them the whole id is taken as the target's name.
    """
    pid = param_id(nodeid)
    if pid is None:
        return None
    names = list(known or ())
    if not names:
        return pid
    best = None
    for name in names:
        if pid == name or pid.startswith(name + "-") or pid.endswith("-" + name) or f"-{name}-" in pid:
            if best is None or len(name) > len(best):
                best = name
    return best


_UNIT = "gpuhost:"  # a target's work unit is this prefix and its name


def scope_of(nodeid: str, known: Iterable[str] | None = None) -> str:
    """Return the work unit of a test: its target's, or the test alone when it names none."""
    host = host_of_nodeid(nodeid, known)
    return f"{_UNIT}{host}" if host is not None else nodeid


def assign_units(nodeids: Sequence[str], known: Iterable[str] | None, workers: int) -> dict[str, int]:
    """Give each target's unit a worker index: round robin in collection order.

    The controller's scheduler and every worker compute the same answer from the same
    collection, so a worker knows its hosts before their tests arrive (and can open their
    connections and read their facts concurrently: see `hosts_for_worker`). Tests that name no
    target are not in the answer: they are balanced as they go, like `--dist load`.
    """
    names = list(known or ())
    order: dict[str, int] = {}
    for nodeid in nodeids:
        scope = scope_of(nodeid, names)
        if scope.startswith(_UNIT) and scope not in order:
            order[scope] = len(order) % max(1, workers)
    return order


def hosts_for_worker(
    nodeids: Sequence[str], known: Iterable[str] | None, index: int, workers: int
) -> list[str]:
    """Return the targets the host scheduler gives worker `index` of `workers`, in order."""
    return [
        s[len(_UNIT) :]
        for s, w in assign_units(nodeids, known, workers).items()
        if w == index and s.startswith(_UNIT)
    ]


def static_assignment(config: pytest.Config) -> bool:
    """Say whether this run's xdist scheduling is HostScheduling (so `assign_units` holds).

    Workers see `dist=no`; the controller tells them in their workerinput (see
    `pytest_configure_node`).
    """
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return bool(workerinput.get("gpuhost_host_scheduling"))
    return _choice(config) in ("host", "workers") and getattr(config.option, "dist", "no") == "load"


class HostScheduling(LoadScopeScheduling):
    """LoadScopeScheduling whose scope is the target a test runs against, assigned round robin.

    Every target's unit (its tests, in collection order) goes to one worker, whole, at the start:
    unit k to worker k mod N, as `assign_units` says, so each worker can prepare its hosts
    concurrently instead of one after another. Tests without a target are balanced as workers
    run low. A worker that dies has its unfinished units handed to the others as
    LoadScopeScheduling does.
    """

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        known: list[str] = config.stash.get(TARGET_NAMES, [])
        self._known = list(known)
        self._scopes: dict[str, str] = {}

    def _split_scope(self, nodeid: str) -> str:
        # xdist asks again for every finished test (mark_test_complete); each answer compares the
        # id with every target name, so it is kept (the names are fixed for the run)
        scope = self._scopes.get(nodeid)
        if scope is None:
            scope = self._scopes[nodeid] = scope_of(nodeid, self._known)
        return scope

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:  # type: ignore[has-type]  # a node joined later: as LoadScope
            for node in self.nodes:
                self._reschedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = list(next(iter(self.registered_collections.values())))
        if not self.collection:
            return
        nodes = sorted(self.nodes, key=_worker_index)
        assignment = assign_units(self.collection, self._known, len(nodes))
        for nodeid in self.collection:
            self.workqueue.setdefault(self._split_scope(nodeid), {})[nodeid] = False
        for scope in list(self.workqueue):
            if scope in assignment:
                self.assigned_work[nodes[assignment[scope]]][scope] = self.workqueue.pop(scope)
        for node in nodes:
            work = self.assigned_work[node]
            if work:
                index = {nodeid: i for i, nodeid in enumerate(self.registered_collections[node])}
                node.send_runtest_some([index[n] for unit in work.values() for n in unit])
        # Tests without a target: handed out as workers run low, as LoadScopeScheduling does.
        for node in nodes:
            if self.workqueue and not self.assigned_work[node]:
                self._assign_work_unit(node)
        for node in nodes:
            if self.workqueue:
                self._reschedule(node)
        if not self.workqueue:
            for node in nodes:
                node.shutdown()  # everything is sent: each worker leaves after its queue


_FIT_NOTE = pytest.StashKey[str]()


#: At most this many targets of a --check-only run are checked in this process, without workers.
IN_PROCESS_HOSTS = 32


def fit_workers(config: pytest.Config, n_targets: int) -> None:
    """Start no more xdist workers than pay for themselves when the host scheduler is used.

    The host scheduler gives each target's tests to one worker, in order; with `-n 4` and one
    target, three workers would start (a Python process, a collection, plugins) for nothing.
    N targets start N workers. One target, or a --check-only run of at most `IN_PROCESS_HOSTS` by a
    suite that reads its targets up front (`pytest_gpuhost_reads_up_front`: suites/health reads
    every host's facts at the end of collection, in threads), runs in this process with no worker
    at all: what is left per test is pytest's own CPU, which a worker only moves to another
    process, at the cost of the worker's start (0.5-0.75 CPU-s measured) and of sending every report through execnet. Measured with
    bench_health.py (docs/health-speed.md): 16 hosts 13.2 s in process vs 20.9 s with -n 2, one
    host 3.9 vs 7.2 s. A run with fixes keeps its workers past one target: a fix waits on its
    host, and workers let other hosts' tests run meanwhile. Called at configure time, before
    xdist starts its workers; `--gpuhost-scheduling=workers` never checks in process, `xdist`
    leaves `-n` alone. Said in the report header.
    """
    if hasattr(config, "workerinput") or n_targets < 1 or config.option.collectonly:
        return
    tx = list(getattr(config.option, "tx", None) or [])
    if not static_assignment(config) or not tx or any(spec != "popen" for spec in tx):
        return  # remote or special workers (--tx ssh=...) are the user's explicit choice
    asked = len(tx)
    plural = "s" if n_targets > 1 else ""
    s = settings.read(config)
    few = (
        s.check_only
        and n_targets <= IN_PROCESS_HOSTS
        and config.hook.pytest_gpuhost_reads_up_front(config=config)
    )
    if s.scheduling == "host" and (n_targets == 1 or few):
        config.option.numprocesses = 0
        config.option.tx = []
        config.option.dist = "no"
        config.stash[_FIT_NOTE] = (
            f"gpuhost: -n {asked} with {n_targets} target{plural}"
            f"{' (--check-only)' if n_targets > 1 else ''}: checking in this process, no workers "
            "(each would cost a Python start; --gpuhost-scheduling=workers keeps them)"
        )
        return
    if asked <= n_targets:
        return
    config.option.numprocesses = n_targets
    config.option.tx = tx[:n_targets]
    config.stash[_FIT_NOTE] = (
        f"gpuhost: -n {asked} with {n_targets} target{plural}: "
        f"starting {n_targets} worker{plural} (the host scheduler runs each "
        "target's tests in order on one worker; --gpuhost-scheduling=xdist keeps -n)"
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    return config.stash.get(_FIT_NOTE, None)


def _worker_index(node: Any) -> tuple[int, str]:
    wid = str(getattr(node, "workerinput", {}).get("workerid") or getattr(node.gateway, "id", ""))
    digits = wid.removeprefix("gw")
    return (int(digits) if digits.isdigit() else 1 << 30, wid)


def _choice(config: pytest.Config) -> str:
    return settings.read(config).scheduling


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tell each worker whether the host scheduler assigns the units (it cannot see --dist)."""
    node.workerinput["gpuhost_host_scheduling"] = static_assignment(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> HostScheduling | None:
    """Group by target under xdist's default `--dist load`; leave explicit other modes alone."""
    if _choice(config) not in ("host", "workers") or getattr(config.option, "dist", "no") != "load":
        return None
    return HostScheduling(config, log)

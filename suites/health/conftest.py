"""suites/health: one facts read per host, shared by every check of that host in this worker.

The `health` fixture hands each test the `HostHealth` of its target: the host's thresholds
(inventory host and group vars over the documented defaults), its `health` facts gathered in
one agent request the first time any check of the host asks, and the verdicts computed from
them. A host that cannot be reached fails at that first request; its later checks re-raise the
same one-line error at once instead of waiting for another connect timeout.
"""

from __future__ import annotations

import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import controller_state
from pytest_gpuhost.modules.health import facts as health_facts
from pytest_gpuhost.run import evidence, scheduling, unreachable
from pytest_gpuhost.run.remediation import Action, Check

from . import options

_HOSTS = pytest.StashKey[dict[str, "HostHealth"]]()
_PREFETCHED = pytest.StashKey[threading.Thread]()
_READ = pytest.StashKey[dict[str, threading.Event]]()  # set when that host's background read ended
_LAST = pytest.StashKey[dict[str, str]]()
PREFETCH_THREADS = 32
VERIFY_TIMEOUT = 30.0  # seconds a fix has to show on the host (a restarted service to answer /health)


def _health_up(facts: dict[str, Any], t: hm.Thresholds) -> bool:
    """Say whether the service's health endpoint answers (True when none is configured)."""
    v = hm.evaluate("service_health", facts, t)
    return v.ok or v.skip is not None


class HostHealth:
    """The health facts and verdicts of one target, gathered once per worker."""

    def __init__(self, target: Any, fixes: list[str], check_only: bool = False) -> None:
        self.target = target
        self.name: str = target.name
        self.fixes = fixes
        self.check_only = check_only
        self.thresholds = hm.Thresholds.from_vars(target.vars)
        self.params = hm.probe_params(self.thresholds)
        # What the last --check-only run remembered, kept on the controller (it writes nothing on
        # the node): sent with every run, the node's probe takes the newer of it and its own file.
        kept = controller_state.load(self.name)
        if kept is not None:
            self.params["state"] = kept
            self.params["state_from"] = str(controller_state.path_for(self.name))
        self.facts: dict[str, Any] | None = None
        self.error: GpuhostError | None = None
        self.error_said = False  # the error's whole line went to one check; the rest refer to it
        self.verdicts: dict[str, hm.Verdict] = {}
        self.samples: dict[str, list[dict[str, Any]]] = {}
        self.round_trips = 0
        self.committed = False
        self.drained_here: str | None = None  # the reason this run drained the Slurm node with
        self.commit_error: str | None = None
        self._commit: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- reading the host -----------------------------------------------------------------

    def _facts(self, **extra: Any) -> dict[str, Any]:
        conn = self.target.conn
        params = dict(self.params, **extra)
        names = health_facts.fact_names(extra.get("parts"))
        n = int(extra.get("samples") or 1)
        timeout = float(self.thresholds["probe_timeout"])
        # The `health` fact bounds itself (its parts run in parallel); the others run after it,
        # one command at a time (dmesg twice at most, systemctl per unit).
        bound = (timeout * 3 + 10 + float(extra.get("interval", 0))) * n + (timeout * 4 + 10) * (
            len(names) - 1
        )
        with self._lock:
            self.round_trips += 1  # one request (the connection's own count adds the agent start)
        reply = conn.call("facts", names=names, params=params, reply_timeout=bound)
        main = reply.get("health", {}) if "health" in names else {}
        if not isinstance(main, dict) or (
            "error" in main and "commands" not in main and "samples" not in main
        ):
            raise hm.ThresholdError(f"{self.name}: health probe failed: {main}")
        return health_facts.merge(reply)

    def gather(self) -> dict[str, Any]:
        """Return the host's facts, reading them on first use (one agent request)."""
        if self.error is not None:
            raise self.error
        if self.facts is None:
            try:
                self.facts = self._facts()
            except GpuhostError as exc:
                self.error = exc
                raise
        return self.facts

    def verdict(self, check: str) -> hm.Verdict:
        """Judge a check; a measurement inside its noise band is re-read before the verdict."""
        if check in self.verdicts:
            return self.verdicts[check]
        facts = self.gather()
        v = hm.evaluate(check, facts, self.thresholds)
        if v.reread:
            t = self.thresholds
            part = v.reread
            if part not in self.samples:
                got = self._facts(parts=[part], samples=t["reread_count"], interval=t["reread_interval"])
                self.samples[part] = list(got.get("samples") or [])
            v = hm.evaluate(check, facts, t, samples=self.samples[part])
        self.verdicts[check] = v
        return v

    def commit_kernel_cursor(self) -> None:
        """Start recording where this run's kernel-log reading ended (the next run reads only newer lines).

        Started once per host when the Xid/SXid verdicts exist (a run that died before judging
        them leaves the old cursor, and the next run reads those lines again), in a thread: the
        request's round trip overlaps the host's remaining checks, and `wait_commit` collects it
        at the host's last check (or at the end of the session). Under --check-only it is kept on
        the controller instead (`modules/health/controller_state.py`): nothing is written on the node.
        """
        if self._commit is not None or self.facts is None:
            return
        state = health_facts.commit_state(self.facts, self.thresholds["xid_ignore"])
        if state is None:
            return
        state_path = (self.facts.get("kernel_log") or {}).get("state_path")
        conn = self.target.conn

        def commit() -> None:
            try:
                stamped = dict(state, committed=time.time())
                if self.check_only:  # writes nothing on the node: the controller keeps it
                    controller_state.save(self.name, stamped)
                else:
                    conn.call("health_commit", state=stamped, state_path=state_path, timeout=10)
                self.committed = True
            except (GpuhostError, OSError) as exc:
                self.commit_error = f"{type(exc).__name__}: {exc}"

        with self._lock:
            self.round_trips += 1
        self._commit = threading.Thread(target=commit, name=f"cursor-{self.name}", daemon=True)
        self._commit.start()

    def wait_commit(self, timeout: float = 30.0) -> str | None:
        """Wait for the cursor commit, if one was started; return a line for the evidence."""
        if self._commit is None:
            return None
        self._commit.join(timeout)
        if self._commit.is_alive():
            return f"kernel log cursor: commit still running after {timeout:.0f} s"
        if self.committed:
            return "kernel log cursor committed"
        return f"kernel log cursor NOT committed ({self.commit_error}): the next run reads these lines again"

    # ---- the remediation a test hands to the engine ----------------------------------------

    def judge(self, check: str, remediate: Any, item: pytest.Item, last: bool = False) -> None:
        """Hand one check to the engine: passed, skipped, failed, or fixed / would fix.

        `last`: this is the host's last check in this process, where the cursor commit is collected.
        """
        v = self.verdict(check)
        ev = evidence.current()
        if check in ("xid", "sxid"):
            started = self._commit is None
            self.commit_kernel_cursor()
            if started and self._commit is not None:
                ev.note("kernel log cursor: commit sent (collected at this host's last check)")
        if last:
            line = self.wait_commit()
            if line:
                ev.note(line)
        item.user_properties.append(("gpuhost_host", self.name))
        item.user_properties.append(("gpuhost_check", check))
        item.user_properties.append(("gpuhost_verdict", v.as_dict()))
        # Requests this suite made to the host so far (facts, re-reads, cursor), and all of the
        # connection's (agent start included): the benchmark's "round trips per host".
        item.user_properties.append(("gpuhost_round_trips", self.round_trips))
        item.user_properties.append(("gpuhost_conn_round_trips", self.target.conn.round_trips))
        for reason in v.reasons:
            ev.note(f"{check}: {reason}")
        fix_name = v.fix if v.fix in self.fixes else None

        def first_check() -> Check:
            return Check(ok=v.ok, summary=v.summary, state=v.state, skip=v.skip, cannot_see=v.cannot_see)

        def plan(before: Check) -> list[Action]:
            if fix_name is None:
                hint = f" (a safe fix exists: pass --fix={v.fix})" if v.fix else ""
                lines = [f"failed: {check}: {v.summary}{hint}"] + [f"  - {r}" for r in v.reasons]
                pytest.fail("\n".join(lines), pytrace=False)
            return self._plan(fix_name, v)

        def fix(actions: list[Action], before: Check) -> None:
            for a in actions:
                argv = shlex.split(a.command)  # built with shlex.join in _plan
                res = self.target.conn.run(argv, timeout=60)
                if not res.ok:
                    raise RuntimeError(f"{a.command} exited {res.rc}: {res.stderr.strip()[-300:]}")

        def verify() -> Check:
            # Re-read the host (bounded), then put the fresh part into the host's facts, so
            # the checks after this one (service_health after service) judge the fixed host.
            parts = ["gpus", "pci"] if check == "persistence_mode" else ["services"]
            deadline = time.monotonic() + VERIFY_TIMEOUT
            while True:
                fresh = self._facts(parts=parts)
                after = hm.evaluate(check, fresh, self.thresholds)
                settled = after.ok and (check != "service" or _health_up(fresh, self.thresholds))
                if settled or time.monotonic() > deadline:
                    break
                time.sleep(1)
            if self.facts is not None:
                self.facts.update({p: fresh[p] for p in parts if p in fresh})
                for c in hm.CHECKS:
                    if c != check:
                        self.verdicts.pop(c, None)
            return Check(ok=after.ok, summary=after.summary, state=after.state)

        remediate(name=check, check=first_check, plan=plan, fix=fix, verify=verify)

    def _plan(self, fix_name: str, v: hm.Verdict) -> list[Action]:
        if fix_name == "persistence":
            show = self.target.conn.run(
                ["systemctl", "show", "-p", "LoadState", "--value", "nvidia-persistenced.service"], timeout=15
            )
            if show.ok and show.stdout.strip() == "loaded":
                return [
                    Action(
                        "start the NVIDIA persistence daemon (keeps every GPU initialised)",
                        shlex.join(["systemctl", "start", "nvidia-persistenced.service"]),
                        destructive=False,
                    )
                ]
            return [
                Action(
                    "turn on legacy persistence mode",
                    shlex.join(["nvidia-smi", "-pm", "1"]),
                    destructive=False,
                )
            ]
        units = [u for u, s in (v.state or {}).items() if s.get("ActiveState") in ("failed", "inactive")]
        return [
            Action(
                f"restart {u} ({v.state[u].get('ActiveState')})",
                shlex.join(["systemctl", "restart", "--", u]),
            )
            for u in units
        ]


def pytest_gpuhost_reads_up_front(config: pytest.Config) -> bool:
    """Every host's facts are read at the end of collection, at once (`pytest_collection_finish`)."""
    return True


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """Collect the drain and reset steps (test_health_drain.py, test_health_reset.py) only with their --fix,
    and the NCCL collective (test_health_nccl.py) only with --health-nccl."""
    for name, fix in (("test_health_drain.py", "drain"), ("test_health_reset.py", "reset")):
        if collection_path.name == name and fix not in options.fixes(config):
            return True
    if collection_path.name == "test_health_nccl.py" and not options.nccl(config):
        return True  # opt-in: --health-nccl
    return None


def _hosts(config: pytest.Config) -> dict[str, HostHealth]:
    return config.stash.setdefault(_HOSTS, {})


def _my_hosts(session: pytest.Session) -> list[str]:
    """Return the targets whose health checks this process will run, in order."""
    config = session.config
    items = [i for i in session.items if "health" in getattr(i, "fixturenames", ())]
    known: list[str] = config.stash.get(scheduling.TARGET_NAMES, [])
    nodeids = [i.nodeid for i in session.items]
    wanted = {scheduling.host_of_nodeid(i.nodeid, known) for i in items}
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        mine = [h for h in dict.fromkeys(scheduling.host_of_nodeid(n, known) for n in nodeids) if h]
    elif scheduling.static_assignment(config):
        index = int(str(workerinput.get("workerid", "gw-1")).removeprefix("gw") or -1)
        count = int(workerinput.get("workercount", 0))
        if not 0 <= index < count:
            return []  # a restarted worker: its hosts are not known in advance
        mine = scheduling.hosts_for_worker(nodeids, known, index, count)
    else:
        return []  # xdist's own scheduling: this worker cannot know its hosts in advance
    return [h for h in mine if h in wanted]


def _last_items(session: pytest.Session) -> dict[str, str]:
    """Map each host to the node id of its last health check in run order (computed once)."""
    config = session.config
    got = config.stash.get(_LAST, None)
    if got is None:
        known: list[str] = config.stash.get(scheduling.TARGET_NAMES, [])
        got = {}
        for item in session.items:
            host = scheduling.host_of_nodeid(item.nodeid, known)
            if host and "health" in getattr(item, "fixturenames", ()):
                got[host] = item.nodeid
        config.stash[_LAST] = got
    return got


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Collect cursor commits whose host's last check ran elsewhere (before connections close)."""
    for hh in _hosts(session.config).values():
        hh.wait_commit()


def _check_only(config: pytest.Config) -> bool:
    from pytest_gpuhost.run import settings

    return bool(settings.read(config).check_only)


def _read_quietly(hh: HostHealth) -> None:
    try:
        hh.gather()
    except Exception:  # kept in hh.error, or raised again by the host's own checks
        pass


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start reading the facts of every host this process will check, in the background, at once.

    A worker checks its hosts one after another, but reading a host's facts is mostly waiting
    (the SSH handshake, the agent's start, the tools): doing all of them at once makes N hosts
    cost about what one does. Started here, the reads also overlap what happens before the first
    test (xdist's controller waits for every worker's collection, then hands out the tests):
    about 0.1-0.5 s here, of a one-host run of 2-3 s. Errors stay with their host (its own checks
    raise them). `--collect-only` reads nothing.
    """
    config = session.config
    if config.option.collectonly or config.stash.get(_PREFETCHED, None) is not None:
        return
    from pytest_gpuhost.plugin import get_target

    hosts = _hosts(config)
    todo: list[HostHealth] = []
    for name in _my_hosts(session):
        if name in hosts:
            continue
        try:
            hh = HostHealth(get_target(config, name), options.fixes(config), _check_only(config))
        except (hm.ThresholdError, StopIteration):
            continue  # reported by the host's own checks
        hosts[name] = hh
        todo.append(hh)
    if not todo:
        return
    done = config.stash[_READ] = {hh.name: threading.Event() for hh in todo}

    def read_one(hh: HostHealth) -> None:
        try:
            _read_quietly(hh)
        finally:
            done[hh.name].set()

    def read_all() -> None:
        with ThreadPoolExecutor(
            max_workers=min(PREFETCH_THREADS, len(todo)), thread_name_prefix="health-facts"
        ) as pool:
            list(pool.map(read_one, todo))

    reader = threading.Thread(target=read_all, name="health-prefetch", daemon=True)
    config.stash[_PREFETCHED] = reader
    reader.start()


def _prefetch(request: pytest.FixtureRequest, name: str) -> None:
    """Wait for this host's background read started at the end of collection (each read is bounded).

    Only this host's: a host's checks run while the other hosts' reads are still on their way.
    """
    done = request.config.stash.get(_READ, {}).get(name)
    if done is not None:
        done.wait()
        return
    reader = request.config.stash.get(_PREFETCHED, None)
    if reader is not None:
        reader.join()


@pytest.fixture
def health(target: Any, request: pytest.FixtureRequest) -> HostHealth:
    """The HostHealth of this test's target; its facts are read once per host and worker."""
    _prefetch(request, target.name)
    hosts = _hosts(request.config)
    hh = hosts.get(target.name)
    if hh is None:
        try:
            hh = HostHealth(target, options.fixes(request.config), _check_only(request.config))
        except hm.ThresholdError as exc:
            pytest.fail(f"{target.name}: {exc}", pytrace=False)
        hosts[target.name] = hh
    failed: GpuhostError | None = None
    try:
        hh.gather()
    except GpuhostError as exc:
        failed = exc
    if failed is not None:
        unreachable.note(request.node, failed)  # said once per host on the terminal, not per check
        # One line, no traceback and no chained exception (raised outside the `except`): for a
        # host that cannot be read this runs once per check, and formatting the connection
        # code's frames each time costs more than the connect timeout itself.  The whole line
        # is said at the host's first check; the others refer to it.
        if hh.error_said:
            where = str(getattr(target.spec, "hostname", "") or "")
            source = f" from {where}" if where and where != target.name else ""
            pytest.fail(
                f"{target.name}: facts not read{source} ({type(failed).__name__}, said at its first check)",
                pytrace=False,
            )
        hh.error_said = True
        pytest.fail(f"{target.name}: {type(failed).__name__}: {failed}", pytrace=False)
    return hh


@pytest.fixture
def judge(health: HostHealth, remediate: Any, request: pytest.FixtureRequest) -> Any:
    """Return `judge(check)`: run one health check of this target through the engine."""

    last = _last_items(request.session).get(health.name) == request.node.nodeid

    def run(check: str) -> None:
        health.judge(check, remediate, request.node, last=last)

    return run

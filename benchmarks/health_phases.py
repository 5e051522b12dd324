"""Where one suite run's time goes, per process: a pytest plugin the health benchmark loads with `-p`.

Each pytest process (the controller and every xdist worker) appends one JSON line to the file
named by GPUHOST_PHASES when it unconfigures: wall-clock stamps (time.time(), comparable across
processes) of its start (from /proc: 10 ms ticks), the end of plugin import and configuration, the
end of collection, its first test's setup and call (the setup waits for the facts), the end of its
last test, the start of `pytest_sessionfinish` (where pytest-html, JUnit and the fleet summary are
written) and its unconfigure; and each connection's hidden timing record (`Connection.timings`:
the SSH login with the agent's start, then each request). `phases()` turns the lines of one run
into the breakdown bench_health.py prints. GPUHOST_PROFILE=PATH also profiles the controller
(cProfile) from the end of collection to its unconfigure.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

_STAMPS: dict[str, float] = {}


def _process_start() -> float:
    """Return when this process started (wall clock), from /proc/self/stat and /proc/stat's btime."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    btime = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _stamp(name: str, first: bool = True) -> None:
    if not first or name not in _STAMPS:
        _STAMPS[name] = time.time()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    _STAMPS["start"] = _process_start()
    _stamp("configured")


def pytest_collection_finish(session: pytest.Session) -> None:
    _stamp("collected")
    if os.environ.get("GPUHOST_PROFILE") and not hasattr(session.config, "workerinput"):
        import cProfile

        _PROFILE.append(cProfile.Profile())
        _PROFILE[0].enable()


_PROFILE: list[Any] = []  # GPUHOST_PROFILE=PATH: the controller's profile, collection end to unconfigure


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _stamp("first_setup")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    _stamp("first_call")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _stamp("last_test", first=False)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    _stamp("sessionfinish")
    # Read before the plugin closes the pool (its own sessionfinish is trylast); imported here,
    # since this module is loaded before the plugin is.
    from pytest_gpuhost.plugin import pool_key

    pool = session.config.stash.get(pool_key, None)
    if pool is not None:
        _CONNS.extend(list(c.timings) for c in pool.connections())


_CONNS: list[list[tuple[str, float, float]]] = []


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    out = os.environ.get("GPUHOST_PHASES")
    if not out:
        return
    _stamp("unconfigure")
    if _PROFILE:
        _PROFILE[0].disable()
        _PROFILE[0].dump_stats(os.environ["GPUHOST_PROFILE"])
    wi = getattr(config, "workerinput", None)
    line = {"who": wi["workerid"] if wi else "controller", "stamps": _STAMPS, "conns": _CONNS}
    with open(out, "a", encoding="utf-8") as f:  # one short write per process: lines do not interleave
        f.write(json.dumps(line) + "\n")


def phases(path: Path, t0: float, t_end: float) -> list[tuple[str, float]]:
    """Return (phase, seconds) of one run from its lines; t0/t_end: the bench's wall clock around it.

    Phases follow the run's critical path: the controller's start, the workers' start (after the
    controller's configure; the slowest), collection, the connections and agents (median SSH
    login + agent start per host), the facts request (median per host), the wait for the facts
    seen by the first test, the tests, the session's end (reports), and exit.
    """
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    ctl = next((x["stamps"] for x in lines if x["who"] == "controller"), None)
    if ctl is None:
        return []
    workers = [x["stamps"] for x in lines if x["who"] != "controller"]
    runners = workers or [ctl]
    conns = [c for x in lines for c in x["conns"]]
    start = [e - s for c in conns for what, s, e in c if what == "start"]
    facts = [e - s for c in conns for what, s, e in c if what == "facts"]
    out = [("controller start (interpreter, pytest, plugins, configure)", ctl["configured"] - t0)]
    if workers:
        out.append(
            (
                "workers start (slowest: interpreter, plugins, configure)",
                max(w["configured"] for w in workers) - ctl["configured"],
            )
        )
    ready = max(w["configured"] for w in runners)
    collected = max(w.get("collected", ready) for w in runners)
    out.append(("collection (slowest process)", collected - ready))
    if start:
        out.append((f"SSH login + agent start, per host (median of {len(start)})", statistics.median(start)))
    if facts:
        out.append((f"facts request, per host (median of {len(facts)})", statistics.median(facts)))
    first = max(w.get("first_call", collected) for w in runners)
    out.append(("from collection to the first check (waits for the facts)", first - collected))
    last = max(w.get("last_test", first) for w in runners)
    out.append(("checks: first to last (verdicts, evidence, reports over execnet)", last - first))
    out.append(("last check to the controller's session end (workers finish)", ctl["sessionfinish"] - last))
    out.append(
        (
            "controller's session end (reports, fleet summary, connections closed)",
            ctl["unconfigure"] - ctl["sessionfinish"],
        )
    )
    out.append(("interpreter exit (controller)", t_end - ctl["unconfigure"]))
    return out

"""The host-grouping xdist scheduler: each target's tests on one worker, in collection order."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pytest_gpuhost.run.scheduling import host_of_nodeid, param_id

INVENTORY = """\
[rack1]
h1 ansible_connection=local
h2 ansible_connection=local
h3 ansible_connection=local
[rack2]
h4 ansible_connection=local
h5 ansible_connection=local
h6 ansible_connection=local
"""

STEPS = """\
import os, time
import pytest

def _log(target, step):
    with open(os.environ["SCHED_LOG"], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {target.name} {step} {time.monotonic()}\\n")

def test_a(target): _log(target, "a")
def test_b(target): _log(target, "b"); time.sleep(0.05)
def test_c(target): _log(target, "c")
def test_d(target): _log(target, "d")
def test_plain(): pass
"""


def test_host_of_nodeid() -> None:
    assert param_id("suites/health/test_health.py::test_xid[gpu-node-07]") == "gpu-node-07"
    assert param_id("a.py::test_x") is None
    assert host_of_nodeid("a.py::test_x[local://]") == "local://"
    known = ["gpu-1", "gpu-10", "198.18.1.2"]
    assert host_of_nodeid("a.py::test_x[gpu-10]", known) == "gpu-10"
    assert host_of_nodeid("a.py::test_x[gpu-1-extra]", known) == "gpu-1"
    assert host_of_nodeid("a.py::test_x[4-198.18.1.2]", known) == "198.18.1.2"
    assert host_of_nodeid("a.py::test_x[other]", known) is None
    assert host_of_nodeid("a.py::C::test_x[gpu-1]", known) == "gpu-1"


def test_each_host_runs_on_one_worker_in_collection_order(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = pytester.path / "sched.log"
    monkeypatch.setenv("SCHED_LOG", str(log))
    pytester.makefile(".ini", fleet=INVENTORY)
    pytester.makepyfile(test_steps=STEPS)
    result = pytester.runpytest_subprocess(
        "--inventory=fleet.ini", "-n", "2", "-p", "no:cacheprovider", "--report-dir=none"
    )
    result.assert_outcomes(passed=6 * 4 + 1)
    rows = [line.split() for line in log.read_text().splitlines()]
    workers: dict[str, set[str]] = defaultdict(set)
    order: dict[str, list[str]] = defaultdict(list)
    for worker, host, step, _t in sorted(rows, key=lambda r: float(r[3])):
        workers[host].add(worker)
        order[host].append(step)
    assert set(workers) == {f"h{i}" for i in range(1, 7)}
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert all(steps == ["a", "b", "c", "d"] for steps in order.values()), dict(order)
    used = {w for ws in workers.values() for w in ws}
    assert used == {"gw0", "gw1"}, "hosts are spread over both workers"


def test_xdist_choice_leaves_the_scheduling_to_xdist(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(): pass")
    result = pytester.runpytest("--gpuhost-scheduling=nope", "--report-dir=none")
    result.stderr.fnmatch_lines(["*--gpuhost-scheduling='nope': choose one of host, workers, xdist*"])
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_units_go_round_robin_and_each_worker_can_compute_its_hosts() -> None:
    from pytest_gpuhost.run.scheduling import assign_units, hosts_for_worker

    ids = [f"t.py::test_{c}[h{h}]" for c in "ab" for h in range(1, 6)] + ["t.py::test_plain"]
    known = [f"h{h}" for h in range(1, 6)]
    units = assign_units(ids, known, 2)
    assert units == {
        "gpuhost:h1": 0,
        "gpuhost:h2": 1,
        "gpuhost:h3": 0,
        "gpuhost:h4": 1,
        "gpuhost:h5": 0,
    }
    assert hosts_for_worker(ids, known, 0, 2) == ["h1", "h3", "h5"]
    assert hosts_for_worker(ids, known, 1, 2) == ["h2", "h4"]


KNOWS = """\
import json, os
from pytest_gpuhost.run import scheduling

def test_a(target, request):
    config = request.config
    nodeids = [i.nodeid for i in request.session.items]
    wi = config.workerinput
    mine = scheduling.hosts_for_worker(nodeids, config.stash[scheduling.TARGET_NAMES], int(wi["workerid"][2:]), wi["workercount"])
    with open(os.environ["SCHED_LOG"], "a") as f:
        f.write(json.dumps({"worker": wi["workerid"], "ran": target.name, "static": scheduling.static_assignment(config), "mine": mine}) + "\\n")
"""


def test_every_worker_knows_its_hosts_before_they_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    log = pytester.path / "knows.log"
    monkeypatch.setenv("SCHED_LOG", str(log))
    pytester.makefile(".ini", fleet=INVENTORY)
    pytester.makepyfile(test_knows=KNOWS)
    result = pytester.runpytest_subprocess(
        "--inventory=fleet.ini", "-n", "2", "-p", "no:cacheprovider", "--report-dir=none"
    )
    result.assert_outcomes(passed=6)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(r["static"] for r in rows)
    for r in rows:
        assert r["ran"] in r["mine"], r
    assert {r["worker"]: r["mine"] for r in rows} == {"gw0": ["h1", "h3", "h5"], "gw1": ["h2", "h4", "h6"]}


def test_tests_without_a_target_run_on_every_worker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = pytester.path / "plain.log"
    monkeypatch.setenv("SCHED_LOG", str(log))
    pytester.makepyfile(
        test_plain="""
import os, time, pytest

@pytest.mark.parametrize("i", range(8))
def test_p(i):
    time.sleep(0.3 if i == 0 else 0.01)
    with open(os.environ["SCHED_LOG"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""
    )
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--report-dir=none")
    result.assert_outcomes(passed=8)
    workers = log.read_text().split()
    assert set(workers) == {"gw0", "gw1"}


@pytest.mark.parametrize(
    ("hosts", "extra", "workers", "header"),
    [
        (1, [], {"main"}, "gpuhost: -n 4 with 1 target: checking in this process, no workers (*"),
        (2, [], {"gw0", "gw1"}, "gpuhost: -n 4 with 2 targets: starting 2 workers (*"),
        (
            2,
            ["--check-only", "UP_FRONT"],
            {"main"},
            "gpuhost: -n 4 with 2 targets (--check-only): checking in this process, no workers (*",
        ),
        # A suite that reads its hosts in its tests keeps its workers, --check-only or not.
        (2, ["--check-only"], {"gw0", "gw1"}, "gpuhost: -n 4 with 2 targets: starting 2 workers (*"),
        (1, ["--gpuhost-scheduling=xdist"], None, None),
    ],
)
def test_no_more_workers_than_targets(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    hosts: int,
    extra: list[str],
    workers: set[str] | None,
    header: str | None,
) -> None:
    log = pytester.path / "sched.log"
    monkeypatch.setenv("SCHED_LOG", str(log))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this test's own worker's, under -n
    pytester.makefile(
        ".ini", fleet="[all]\n" + "".join(f"h{i} ansible_connection=local\n" for i in range(hosts))
    )
    pytester.makepyfile(test_steps=STEPS)
    if "UP_FRONT" in extra:  # the suite says it reads every target at the end of collection
        pytester.makeconftest("def pytest_gpuhost_reads_up_front(config):\n    return True\n")
        extra = [x for x in extra if x != "UP_FRONT"]
    result = pytester.runpytest_subprocess(
        "--inventory=fleet.ini", "-n", "4", "-p", "no:cacheprovider", "--report-dir=none", *extra
    )
    result.assert_outcomes(passed=hosts * 4 + 1)
    if header is None:
        result.stdout.no_fnmatch_line("gpuhost: -n *")
        result.stdout.fnmatch_lines(["created: 4/4 workers"])
        return
    if workers == {"main"}:  # no xdist at all: no "created:" line, every test in this process
        result.stdout.fnmatch_lines([header])
        result.stdout.no_fnmatch_line("created: *")
    else:
        result.stdout.fnmatch_lines([header, f"created: {len(workers or ())}/{len(workers or ())} worker*"])
    used = {line.split()[0] for line in log.read_text().splitlines()}
    assert used == workers

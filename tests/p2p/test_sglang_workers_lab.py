"""SGLang's renamed workers on the b200-nvl8 lab host: they hold GPUs, outlive a server stopped
alone, and a selection by tree and by GPU use leaves no GPU holder (real SSH, real agent)."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulab.host.lab import CLIENT_KEY
from pytest_gpuhost.exec.targets import TargetOptions, open_connection, parse_host_url
from pytest_gpuhost.modules.backup.local import load_manifest
from pytest_gpuhost.modules.process import Proc, ProcessTable, Selection, stop_processes

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "fixtures" / "manifests" / "b200-node-backup.yaml"
IDLE_MIB = 256  # the manifest's gpu_idle_mib


@pytest.fixture(scope="module")
def b200(lab: Any) -> Any:
    return lab.host("b200-nvl8", data_scale="small")


@pytest.fixture
def conn(b200: Any) -> Iterator[Any]:
    b200.reset()  # pristine: the seven servers just started by hand, with their workers
    opts = TargetOptions(identity=str(CLIENT_KEY), known_hosts=str(b200.known_hosts), command_timeout=30)
    c = open_connection(parse_host_url(f"ssh://root@{b200.address}"), opts)
    yield c
    c.close()


def gpu_apps(h: Any) -> list[list[str]]:
    out = h.ssh(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"])
    return [r for r in csv.reader(io.StringIO(out.stdout), skipinitialspace=True) if r]


def gpus_busy(h: Any) -> list[int]:
    out = h.ssh(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]).stdout.split()
    return [i for i, mib in enumerate(out) if int(mib) > IDLE_MIB]


def settled(conn: Any) -> ProcessTable:
    """Read the table once the servers' seven schedulers hold their GPUs (a fresh boot races)."""
    for _ in range(100):
        table = ProcessTable.read(conn)
        if sum(title(p).startswith("sglang::scheduler") and bool(p.gpus) for p in table.procs) == 7:
            return table
        time.sleep(0.1)
    raise AssertionError("the b200 servers' schedulers never held their GPUs")


def title(p: Proc) -> str:
    return p.argv[0] if p.argv else ""


def test_renamed_workers_hold_gpus_outlive_their_server_and_the_tree_stops_them(b200: Any, conn: Any) -> None:
    h = b200
    stop = load_manifest(MANIFEST).stop
    table = settled(conn)
    servers = [p for p in table.procs if any(m.matches(p) for m in stop.matchers)]
    assert len(servers) == 7
    kids = table.descendants(servers)
    # the real setproctitle module (python3-setproctitle): argv is the title alone, as with SGLang
    assert all(k.argv == (title(k),) for k, _ in kids), [k.argv for k, _ in kids]
    # each server has a scheduler and a detokenizer, renamed: the manifest's matcher sees neither
    assert sorted(title(k) for k, _ in kids) == ["sglang::detokenizer"] * 7 + ["sglang::scheduler_TP0"] * 7
    assert all(not any(m.matches(k) for m in stop.matchers) for k, _ in kids)
    scheds = {root.pid: k for k, root in kids if title(k) == "sglang::scheduler_TP0"}
    for s in servers:
        held = sorted(scheds[s.pid].gpus)
        assert held and held == [g for g in sorted(s.gpus)]  # the worker holds the server's GPU
        assert any(g.startswith("/dev/nvidia") and g[-1].isdigit() for g in held)
    assert {r[1] for r in gpu_apps(h)} >= {"sglang::scheduler_TP0"}

    # The hole: SIGTERM to the server alone (the selection before the tree). Its scheduler
    # is reparented and keeps the GPU; the GPUs-idle condition cannot pass.
    dp0 = min(servers, key=lambda p: p.pid)
    orphan = scheds[dp0.pid]
    res = stop_processes(conn, [dp0], term_timeout=10, kill_timeout=5, tree=False)
    assert res.ok and res.termed == [dp0.pid] and res.killed == []
    after = {p.pid: p for p in ProcessTable.read(conn).procs}
    assert dp0.pid not in after and orphan.pid in after
    assert after[orphan.pid].ppid != dp0.pid and after[orphan.pid].gpus == orphan.gpus
    assert str(orphan.pid) in {r[0] for r in gpu_apps(h)} and gpus_busy(h)
    # the manifest's matchers no longer reach it; selection by GPU use does
    table = ProcessTable.read(conn)
    assert orphan.pid not in {p.pid for p, _ in table.select(stop)}
    by_gpu = Selection(matchers=stop.matchers, gpu_holders=True)
    chosen = table.select(by_gpu)
    why = {p.pid: w for p, w in chosen}
    assert why[orphan.pid].startswith("holds /dev/nvidia")
    assert sum(w.startswith("holds /dev/nvidia") for w in why.values()) == 7  # the orphan, 6 schedulers
    assert sum(w.startswith("descendant of PID") for w in why.values()) == 6  # the detokenizers
    assert sum(w == "matcher sglang server" for w in why.values()) == 6

    # The fix: the tree and the GPU holders, recorded before any signal, then stopped.
    recorded: list[tuple[str, Any]] = []
    res = stop_processes(
        conn,
        [p for p, _ in chosen],
        term_timeout=10,
        kill_timeout=5,
        record=lambda k, v: recorded.append((k, v)),
    )
    assert res.ok and not res.killed, res
    assert recorded[0][0] == "selected for stop" and len(recorded[0][1]) == 19
    assert all({"pid", "starttime", "cmdline"} <= r.keys() for r in recorded[0][1])
    table = ProcessTable.read(conn)
    assert table.gpu_holders() == []
    assert gpu_apps(h) == [] and gpus_busy(h) == []
    args = h.ssh(["ps", "-eo", "args="]).stdout.splitlines()
    assert "vim /data/sglang_notes.md" in args and "tail -f /data/logs/sglang-dp0.log" in args
    assert not any(a.startswith("sglang::") for a in args), args


def test_a_stubborn_detokenizer_outlives_sigterm_and_needs_sigkill(b200: Any, conn: Any) -> None:
    """A server started with --gpulab-workers stubborn: the tree selection still leaves nothing."""
    h = b200
    stop = load_manifest(MANIFEST).stop
    chosen = settled(conn).select(stop)
    dp0 = next(p for p, w in chosen if w == "matcher sglang server" and "--base-gpu-id 0 " in p.cmdline)
    res = stop_processes(conn, [p for p, _ in chosen], term_timeout=10, kill_timeout=5)
    assert res.ok and res.killed == [] and len(res.termed) == 21  # every worker took its SIGTERM
    # a server on GPU 0 whose detokenizer outlives it and ignores SIGTERM, started by hand
    argv = [*dp0.argv, "--port", "30100", "--gpulab-workers", "stubborn"]
    detach = 'setsid -f "$@" </dev/null >/dev/null 2>&1'  # ssh returns; the server stays
    assert h.ssh(["sh", "-c", detach, "-", "env", "GPULAB_LOAD_SECONDS=0.2", *argv]).returncode == 0
    chosen = []
    for _ in range(50):
        chosen = ProcessTable.read(conn).select(stop)
        if len(chosen) == 3:
            break
        h.ssh(["sleep", "0.1"])
    assert sorted(title(p) for p, _ in chosen)[1:] == ["sglang::detokenizer", "sglang::scheduler_TP0"], chosen
    detok = next(p for p, _ in chosen if title(p) == "sglang::detokenizer")
    res = stop_processes(conn, [p for p, _ in chosen], term_timeout=2, kill_timeout=5)
    assert res.ok and res.killed == [detok.pid], res
    assert ProcessTable.read(conn).gpu_holders() == []
    signals = [r for r in h.record() if r.get("kind") == "signal" and r.get("title") == "sglang::detokenizer"]
    assert signals[-1]["pid"] == detok.pid and signals[-1]["signal"] == "SIGTERM"

"""Steps 1-3 of suites/decommission: inventory, servers stopped, GPUs idle."""

from __future__ import annotations

import json
import time
from typing import Any

from pytest_gpuhost.modules.process import Proc, ProcessTable, stop_processes
from pytest_gpuhost.redact import redact_obj
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from . import preflight
from .node import APPS_QUERY, GPU_QUERY, Decommission, csv_rows, mb

__all__ = ["gpu_state", "step_gpus_idle", "step_inventory", "step_servers_stopped"]


def step_inventory(run: Decommission) -> Step:
    """Step 1: host facts, GPU use, processes to stop and the manifest's files, in one round trip."""

    def check() -> Check:
        inv = run.take_inventory()
        run.event("inventory taken")
        cats = ", ".join(f"{k} {v['files']} files/{mb(v['bytes'])}" for k, v in inv["categories"].items())
        summary = (
            f"{inv['hostname']} ({inv['kernel']}): {len(inv['gpus'])} GPUs, {len(inv['gpu_apps'])} GPU processes, "
            f"{len(inv['to_stop'])} processes selected to stop; {cats}; {inv['round_trips']} round trip(s)"
        )
        # The last moment before the first change: what the listing shows the run cannot do
        # refuses it here, with every server still running (suites/decommission/preflight.py).
        assert run._listing is not None
        run.refused = preflight.node_problems(run._listing, run.manifest, run.dest, run.backup.state.items)
        if run.refused:
            run.event("refused before any change: " + "; ".join(run.refused))
            head = "\n  ".join(run.refused)
            return Check(False, f"refused before any change ({len(run.refused)} problems):\n  {head}", inv)
        run.stake()  # the destinations' owner records, now that the run will go on
        return Check(ok=True, summary=summary, state=inv)

    def fix(actions: list[Action], before: Check) -> None:
        raise ProcedureError("nothing was stopped or copied: " + "; ".join(run.refused))

    return run.step("inventory", check, None, fix)


def step_servers_stopped(run: Decommission) -> Step:
    """Step 2: the manifest's servers are stopped (SIGTERM, bounded wait, SIGKILL), nothing else."""
    sel = run.manifest.stop
    chosen: list[tuple[Proc, str]] = []

    def check() -> Check:
        nonlocal chosen
        table = ProcessTable.read(run.conn, gpu_holders=sel.gpu_holders)
        chosen = table.select(sel)
        state = [dict(p.record(), why=why) for p, why in chosen]
        if not chosen:
            return Check(True, "no process selected by the manifest is running", state)
        pids = ", ".join(str(p.pid) for p, _ in chosen)
        return Check(False, f"{len(chosen)} processes selected by the manifest are running: {pids}", state)

    def plan(before: Check) -> list[Action]:
        return [
            Action(
                f"stop PID {p.pid} ({why}): {p.cmdline}",
                f"kill -TERM {p.pid}; wait up to {sel.term_timeout:.0f} s; kill -KILL {p.pid}"
                f"  (exact PID, start time {p.starttime} re-checked before each signal)",
            )
            for p, why in chosen
        ]

    def fix(actions: list[Action], before: Check) -> None:
        with open(run.meta / "stopped.jsonl", "a") as f:
            for p, why in chosen:
                # the stop log keeps command lines: redacted like every other artefact
                f.write(json.dumps(redact_obj(dict(p.record(), why=why, t=time.time()))) + "\n")
        units = sorted({p.unit for p, why in chosen if why.startswith("unit ") and p.unit})
        run.event(f"stopping {len(chosen)} processes: " + ", ".join(str(p.pid) for p, _ in chosen))
        res = stop_processes(
            run.conn,
            [p for p, _ in chosen],
            term_timeout=sel.term_timeout,
            kill_timeout=sel.kill_timeout,
            record=run._state,
            units=units,
            run=lambda argv: run.conn.run(argv, timeout=30),
        )
        run.event(f"stopped: {len(res.termed)} took SIGTERM, {len(res.killed)} needed SIGKILL")
        if res.survivors:
            raise ProcedureError(f"still running after SIGKILL: PIDs {res.survivors}")

    return run.step("servers stopped", check, plan, fix)


def gpu_state(run: Decommission) -> dict[str, Any]:
    gpus, apps = run.conn.batch(
        [
            {"op": "run", "argv": GPU_QUERY, "timeout": 30},
            {"op": "run", "argv": APPS_QUERY, "timeout": 30},
        ]
    )
    if isinstance(gpus, Exception) or gpus.get("rc") != 0:
        err = gpus if isinstance(gpus, Exception) else (gpus.get("stderr") or "").strip()
        raise ProcedureError(f"nvidia-smi failed: {err}")
    rows = [r for r in csv_rows(gpus["stdout"]) if len(r) >= 6]
    app_rows = [r for r in csv_rows(apps.get("stdout", "")) if len(r) >= 4] if isinstance(apps, dict) else []
    busy = [
        {"index": r[0], "bus_id": r[1], "memory_used_mib": int(float(r[4]))}
        for r in rows
        if r[4].replace(".", "", 1).isdigit() and float(r[4]) > run.gpu_idle_mib
    ]
    return {
        "apps": [{"pid": r[0], "name": r[1], "used_mib": r[2], "bus_id": r[3]} for r in app_rows],
        "busy": busy,
        "gpus": len(rows),
    }


def step_gpus_idle(run: Decommission) -> Step:
    """Step 3: no compute process on any GPU, memory back to baseline."""

    def check() -> Check:
        st = gpu_state(run)
        if not st["apps"] and not st["busy"]:
            return Check(
                True,
                f"{st['gpus']} GPUs idle: no compute processes, memory at baseline "
                f"(<= {run.gpu_idle_mib} MiB)",
                st,
            )
        parts = []
        if st["apps"]:
            parts.append("compute processes " + ", ".join(f"{a['pid']} {a['name']}" for a in st["apps"]))
        if st["busy"]:
            parts.append(
                "memory in use on GPU "
                + ", ".join(f"{b['index']} ({b['memory_used_mib']} MiB)" for b in st["busy"])
            )
        return Check(False, "; ".join(parts), st)

    def plan(before: Check) -> list[Action]:
        if before.state["apps"]:
            # Servers that step 2 stops (still running under --check-only) leave on their own;
            # any other compute process is not ours to kill, so nothing is planned for it.
            table = ProcessTable.read(run.conn, gpu_holders=run.manifest.stop.gpu_holders)
            ours = {p.pid for p, _ in table.select(run.manifest.stop)}
            if any(int(a["pid"]) not in ours for a in before.state["apps"]):
                return []
        return [
            Action(
                f"wait up to {run.gpu_idle_timeout:.0f} s for GPU memory to return to baseline",
                " ".join(GPU_QUERY),
                destructive=False,
            )
        ]

    def fix(actions: list[Action], before: Check) -> None:
        if before.state["apps"]:
            raise ProcedureError(
                "compute processes not selected by the manifest still hold GPUs: "
                + ", ".join(f"PID {a['pid']} {a['name']}" for a in before.state["apps"])
                + " (add a matcher to the manifest's stop: section, or stop them by hand)"
            )
        deadline = time.monotonic() + run.gpu_idle_timeout
        while time.monotonic() < deadline:
            st = gpu_state(run)
            if not st["apps"] and not st["busy"]:
                return
            time.sleep(1.0)

    return run.step("gpus idle", check, plan, fix)

"""What a cut `--fix=reset` run left on a host, read from its journal, and putting it back.

suites/health/reset.py journals each destructive step on the host before it is taken (`stop`
with its unit and GPU, `persistence_off`, `reset`, `reboot`) and `restored` once a GPU's units
run again and its persistence mode is back on; a run cut in between leaves the journal. The next
run reads it here: what was stopped or turned off and never restored, and `complete` puts it back.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.modules.service import Service
from pytest_gpuhost.run.procedure import ProcedureError

__all__ = ["STOP_TIMEOUT", "by_gpu", "complete", "leftover", "run_checked"]

STOP_TIMEOUT = 30.0  # a unit's stop ladder; its start gets twice that


def leftover(journal: Mapping[str, Any] | None) -> tuple[list[str], list[str]]:
    """Return (units, GPUs) a cut run left: stopped, or with persistence off, and never restored.

    The journal's steps, in order: `stop` (unit, gpu), `persistence_off` (gpu), `reset` (gpu),
    `reboot` (boot id), `restored` (gpu: its units started again and persistence back on).
    """
    units, persistence = by_gpu(journal)
    return list(dict.fromkeys(u for us in units.values() for u in us)), sorted(persistence)


def by_gpu(journal: Mapping[str, Any] | None) -> tuple[dict[str, list[str]], dict[str, bool]]:
    """({GPU: units stopped for it}, {GPU: persistence off}) that a cut run never restored."""
    units: dict[str, list[str]] = {}
    persistence: dict[str, bool] = {}
    for step in (journal or {}).get("steps") or []:
        if not isinstance(step, Mapping):
            continue
        gpu, what = str(step.get("gpu", "")), step.get("step")
        if what == "stop" and step.get("unit"):
            units.setdefault(gpu, []).append(str(step["unit"]))
        elif what == "persistence_off":
            persistence[gpu] = True
        elif what == "restored":
            units.pop(gpu, None)
            persistence.pop(gpu, None)
    return units, persistence


def complete(conn: Any, units: list[str], gpus: list[str]) -> list[str]:
    """Put back what a cut run left: persistence on, then its stopped units started; return notes."""
    notes = []
    for g in gpus:
        run_checked(conn, ["nvidia-smi", "-i", g, "-pm", "1"], 30)
        notes.append(f"persistence mode on again for {g}")
    for u in reversed(units):
        st = Service(conn, u).state()
        if st.running:
            notes.append(f"{u} already active")
            continue
        Service(conn, u).start(timeout=STOP_TIMEOUT * 2)
        notes.append(f"started {u} again")
    return notes


def run_checked(conn: Any, argv: list[str], timeout: float) -> None:
    r = conn.run(argv, timeout=timeout)
    if r.rc != 0 or r.timed_out:
        raise ProcedureError(f"{shlex.join(argv)} failed (rc {r.rc}): {(r.stdout + r.stderr).strip()[-200:]}")

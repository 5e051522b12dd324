"""One reset of a GPU set on the host: its holders stopped, persistence off, `nvidia-smi -r`, all put back.

Each destructive step is journaled on the host before it is taken (the health reset's journal,
suites/health/reset.py), so a run cut in between is completed by the next (cutrun.py).
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.modules.journal import Journal
from pytest_gpuhost.modules.process import ProcessTable
from pytest_gpuhost.modules.service import Service
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError

from . import cutrun
from .holders import GpuReset

__all__ = ["RESET_TIMEOUT", "STOP_TIMEOUT", "reset_one"]

RESET_TIMEOUT = 60.0  # nvidia-smi -r on one GPU; a reset that hangs is a failure, not a stuck run
STOP_TIMEOUT = cutrun.STOP_TIMEOUT  # the units the reset stops: the stop ladder


def reset_one(conn: Any, p: GpuReset, journal: Journal | None = None) -> None:
    """Stop what holds the GPU (and its peers), reset them in one command, start every unit again.

    Each destructive step is journaled on the host before it is taken, and `restored` once
    everything is put back, so that a run cut in between is completed by the next (`leftover`).
    """
    ev = evidence.current()
    stopped: list[str] = []
    off: list[str] = []  # GPUs whose persistence mode this run turned off

    def note(what: str, gpu: str = p.smi_id, **detail: Any) -> None:
        if journal is not None:
            journal.step(what, gpu=gpu, **detail)

    restored = False
    try:
        for u in p.units:
            note("stop", unit=u)
            report = Service(conn, u).stop(STOP_TIMEOUT)
            stopped.append(u)
            ev.note(f"reset {p.smi_id}: stopped {u} ({report.duration:g} s)")
        minors = {f"/dev/nvidia{m.minor}" for m in p.members if m.minor is not None}
        if minors:
            left = [
                f"PID {x.pid}"
                for x in ProcessTable.read(conn, gpu_holders=True).gpu_holders()
                if minors & set(x.gpus)
            ]
            if left:
                raise ProcedureError(
                    f"{', '.join(p.ids)} still held after the stop ({', '.join(left)}): not reset"
                )
        for m in p.members:
            if m.persistence:
                note("persistence_off", m.smi_id)
                off.append(m.smi_id)
                cutrun.run_checked(conn, ["nvidia-smi", "-i", m.smi_id, "-pm", "0"], 30)
        note("reset")
        ids = ",".join(p.ids)
        r = conn.run(["nvidia-smi", "-r", "-i", ids], timeout=RESET_TIMEOUT)
        if r.timed_out:
            raise ProcedureError(
                f"nvidia-smi -r -i {ids} did not return in {RESET_TIMEOUT:g} s (driver hung?)"
            )
        ev.note(f"reset {ids}: nvidia-smi -r exited {r.rc}: {(r.stdout or r.stderr).strip()[-300:]}")
        if r.rc != 0:
            raise ProcedureError(
                f"nvidia-smi -r -i {ids} exited {r.rc}: {(r.stdout + r.stderr).strip()[-300:]}"
            )
    finally:
        restored = True
        for gpu in off:
            try:
                cutrun.run_checked(conn, ["nvidia-smi", "-i", gpu, "-pm", "1"], 30)
            except ProcedureError as exc:
                restored = False
                ev.note(f"reset {gpu}: {exc}")
        for u in reversed(stopped):
            Service(conn, u).start(timeout=STOP_TIMEOUT * 2)
            ev.note(f"reset {p.smi_id}: started {u} again")
        if restored:
            for gpu in p.ids:
                note("restored", gpu)

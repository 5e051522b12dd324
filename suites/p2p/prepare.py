"""Steps 1-4 of suites/p2p: plan, service stopped, GPUs released, IOMMU groups identity.

Each destructive action is journalled on the host before it is taken, and its undo pushed: the
module fixture's teardown (`Procedure.finish`) puts back whatever a failed or cut run left.
"""

from __future__ import annotations

import dataclasses
import errno
import socket
import time

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules import gpu, iommu, pci
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from . import actions
from .diagnosis import diagnosis_actions, uvm_problem, write_uvm_conf
from .procedure import P2PProcedure
from .service_env import adopt_env_journal

__all__ = [
    "check_kernel_holders",
    "gpu_holders",
    "planned_actions",
    "put_type_back",
    "step_gpus_released",
    "step_iommu_groups_identity",
    "step_plan",
    "step_service_stopped",
]


def planned_actions(run: P2PProcedure) -> list[Action]:
    """Every action of a repair, in order (what step 1 announces)."""
    t = run.conn.name
    acts = [
        Action("take the run lock", f"mkdir {run.journal.lock_path}", t, False),
        Action("write the journal", f"write {run.journal.path}", t, False),
    ]
    # what the diagnosis found: nvidia_uvm's file written with the plan (before the collective
    # it would hang), and what only the operator can do, named
    diag = diagnosis_actions(run, run.diagnosis) if run.diagnosis is not None else []
    if run.plan is not None and not run.plan.needs_repair:
        return acts + diag
    acts += actions.stop_actions(run)
    acts += actions.release_actions(run)
    acts += actions.group_actions(run)
    acts += actions.bind_actions(run, all_functions=True)
    acts += actions.persist_actions(run)
    if run.has_service:
        acts.append(actions.start_action(run))
    return acts + diag


def step_plan(run: P2PProcedure) -> Step:
    """Step 1: a repair plan is in force (lock held, journal written), or none is needed."""

    def check() -> Check:
        plan = run.plan if run.plan is not None else run.gather()
        if not plan.gpus:
            return Check(
                True,
                "no GPU in scope: " + plan.summary(),
                plan.to_dict(),
                skip="no NVIDIA GPU on nvidia in scope",
            )
        p2p_note = ""
        if run.before_ok is not None:
            p2p_note = "; P2P " + ("above" if run.before_ok else "below") + " threshold"
        if run.diagnosis is not None:
            p2p_note += "; " + run.diagnosis.summary()
        uvm = uvm_problem(run)
        if not plan.needs_repair:
            if uvm:
                return Check(
                    False, f"nvidia_uvm runs with HMM: {uvm}" + p2p_note, plan.to_dict() | {"uvm": uvm}
                )
            return Check(
                True, "nothing to repair: every in-scope group is identity" + p2p_note, plan.to_dict()
            )
        if uvm:
            p2p_note += f"; {uvm}"
        elif run.journal.held and run.journal.data.get("run_id") == run.journal.run_id:
            return Check(
                True, "repair planned; lock held; journal written: " + plan.summary(), plan.to_dict()
            )
        return Check(False, "repair needed: " + plan.summary() + p2p_note, plan.to_dict())

    def fix(actions: list[Action], before: Check) -> None:
        owner = {"controller": socket.gethostname(), "procedure": "suites/p2p"}
        run.take_lock(wait=run.opts.lock_wait, stale_s=run.opts.lock_stale, owner=owner)
        # another run may have repaired the host while this one waited: read again
        run.read_facts(("gpus", "nvidia_smi_gpus", "host_info"))
        plan = run.make_plan()
        run.adopt_old_journal()
        if not plan.needs_repair:
            if uvm_problem(run):  # HMM off for the next load of nvidia_uvm; nothing else to do
                run.journal.data = {"procedure": "suites/p2p", "started": time.time(), "plan": plan.to_dict()}
                run.journal.write(phase="planned")
                write_uvm_conf(run)
            run.journal.release()
            return
        run.journal.data = {
            "procedure": "suites/p2p",
            "started": time.time(),
            "controller": owner["controller"],
            "resumed_from": plan.resumed_from,
            "plan": plan.to_dict(),
            "service": {"unit": run.service.unit, "where": run.service.where} if run.has_service else None,
            "service_stopped": run.stopped_service,
            "persistenced_stopped": run.stopped_persistenced,
            "steps": list((run.old_journal or {}).get("steps", []))[-50:],
        }
        run.journal.write(phase="planned")
        # what an interrupted run left (or a function with no driver now) is put back at the end
        if run.stopped_service:
            run.push_service_undo()
        adopt_env_journal(run)
        if run.stopped_persistenced:
            run.push_persistenced_undo()
        if any(f.current != f.driver for g in plan.groups for f in g.functions):
            run.push_rebind_undo()
        if uvm_problem(run):
            write_uvm_conf(run)

    return run.step("plan", check, lambda before: planned_actions(run), fix)


def step_service_stopped(run: P2PProcedure) -> Step:
    """Step 2: the service that holds the GPUs is stopped (bounded), only when a repair is needed."""

    def check() -> Check:
        assert run.plan is not None
        if not run.has_service:  # step 1's evidence says why (holder.py)
            why = f"no service to stop: {run.service_origin}"
            return Check(True, why, skip=why)
        if not run.plan.needs_repair:
            seen = run.service_state
            if seen is not None and not seen.exists:  # say only what was seen: no unit, nothing left running
                return Check(
                    True, "not needed: no repair", skip=f"no unit {run.service.unit} on {run.service.where}"
                )
            return Check(True, f"not needed: no repair, {run.service.unit} left running")
        state = run.service.state()
        if not state.exists:
            return Check(
                True,
                f"no unit {run.service.unit} on {run.service.where}: nothing to stop",
                dataclasses.asdict(state),
            )
        return Check(state.stopped, state.summary(), dataclasses.asdict(state))

    def fix(actions: list[Action], before: Check) -> None:
        run.stopped_service = True
        run.record("stop-service", unit=run.service.unit, where=run.service.where)
        run.journal.write(service_stopped=True)
        run.push_service_undo()
        report = run.service.stop(run.opts.stop_timeout)
        ev = evidence.current()
        ev.measure("service stop seconds", report.duration, "s", target=run.service.where)
        for s in report.steps:
            ev.note(f"{run.service.unit}: {s['step']} at {s['t']} s: {s['state']}")

    return run.step("service stopped", check, lambda before: actions.stop_actions(run), fix, on=run.svc_conn)


def gpu_holders(run: P2PProcedure) -> list[gpu.Holder]:
    """Processes holding an in-scope GPU (or the control devices) now."""
    assert run.plan is not None
    facts = run.conn.facts("gpu_holders", "persistence")
    run.facts.update(facts)
    files = {f"/dev/nvidia{m}" for m in run.plan.minors.values()} | {"/dev/nvidiactl", "/dev/nvidia-uvm"}
    raw = facts.get("gpu_holders")
    return [
        gpu.Holder(
            int(h["pid"]),
            h.get("comm", ""),
            h.get("cmdline", ""),
            h.get("files", []),
            h.get("cgroup", ""),
        )
        for h in (raw if isinstance(raw, list) else [])
        if set(h.get("files") or []) & files
    ]


def step_gpus_released(run: P2PProcedure) -> Step:
    """Step 3: nothing holds the in-scope GPUs: no process, no nvidia-persistenced, no legacy persistence."""

    def check() -> Check:
        assert run.plan is not None
        if not run.plan.needs_repair:
            return Check(True, "not needed: no repair")
        holders = gpu_holders(run)
        pers = (run.facts.get("persistence") or {}).get("persistenced_pids") or []
        legacy = run.legacy_on()
        state = {
            "holders": [dataclasses.asdict(h) for h in holders],
            "persistenced_pids": pers,
            "legacy_on": legacy,
        }
        parts = []
        if holders:
            parts.append("held by " + "; ".join(h.describe() for h in holders[:5]))
        if pers:
            parts.append(f"nvidia-persistenced running (pid {', '.join(map(str, pers))})")
        if legacy:
            parts.append(f"legacy persistence on: {', '.join(legacy)}")
        return Check(
            not parts,
            "; ".join(parts) or "no holders, nvidia-persistenced stopped, legacy persistence off",
            state,
        )

    def plan(before: Check) -> list[Action]:
        acts = actions.release_actions(run)
        pers = set((before.state or {}).get("persistenced_pids") or [])
        others = [h for h in (before.state or {}).get("holders", []) if h.get("pid") not in pers]
        for h in others:
            acts.append(
                Action(
                    f"pid {h['pid']} ({h['comm']}) must let go"
                    + (f" (goes with {run.service.unit} if it is the service's)" if run.has_service else ""),
                    "none: this procedure never kills processes outside the service's unit",
                    run.conn.name,
                    False,
                )
            )
        return acts

    def fix(actions: list[Action], before: Check) -> None:
        pers = (before.state or {}).get("persistenced_pids") or []
        pstate = run.persistenced.state()
        if pers or pstate.running:
            run.stopped_persistenced = pstate.running or run.stopped_persistenced
            run.record("stop-persistenced")
            run.journal.write(persistenced_stopped=run.stopped_persistenced)
            run.push_persistenced_undo()
            if pstate.exists:
                run.persistenced.stop(run.opts.stop_timeout)
        # with the daemon gone, what nvidia-smi still reports as on is legacy persistence mode
        run.facts.update(run.conn.facts("persistence"))
        for b in run.legacy_on():
            run.record("persistence-off", bdf=b)
            r = run.conn.run(["nvidia-smi", "-i", b, "-pm", "0"], timeout=30)
            if r.rc != 0:
                raise ProcedureError(
                    f"nvidia-smi -i {b} -pm 0 failed (rc {r.rc}): {(r.stderr or r.stdout).strip()[:200]}"
                )
        holders = gpu_holders(run)
        if holders:
            raise ProcedureError(
                "GPUs still held after stopping the service: "
                + "; ".join(h.describe() for h in holders[:5])
                + ". Stop these processes (they are not part of the service's unit), then run again"
            )

    return run.step("gpus released", check, plan, fix)


def check_kernel_holders(run: P2PProcedure) -> None:
    """Stop before the first unbind when the kernel itself holds the GPUs: that unbind would never finish."""
    run.read_module_files()
    raw = run.conn.facts("gpu_holders").get("gpu_holders")
    held = gpu.open_counts(gpu.parse_holders(raw))
    found = run.kernel_holders(held)
    if found:
        raise ProcedureError(
            "; ".join(found) + ": an nvidia unbind would wait in the kernel until reboot: needs a reboot "
            "path (boot with nvidia_drm.modeset=0, or a driver from 580.105.08, and without the holder, then run "
            "again); nothing was unbound"
        )


def put_type_back(run: P2PProcedure, number: int, original: str | None, now: str) -> None:
    """A write that succeeded left the group in another type than asked (5.11-6.4: DMA for a refused
    identity domain): write its original type back while its functions are still unbound."""
    assert run.plan is not None
    if not original or original == now or original not in ("DMA", "DMA-FQ", "identity"):
        return
    group = iommu.IommuGroup(number, now, [])
    run.record("set-type", group=number, value=original)
    try:
        iommu.set_type(run.conn, group, original, kernel=run.plan.kernel)
    except iommu.IommuError as exc:
        evidence.current().note(f"group {number}: could not put its type back to {original}: {exc}")
        return
    evidence.current().note(f"group {number}: read {now} after the write; its type is back to {original}")


def step_iommu_groups_identity(run: P2PProcedure) -> Step:
    """Step 4: every in-scope IOMMU group is identity (unbind its functions, write, read back)."""

    def check() -> Check:
        assert run.plan is not None
        run.read_facts(("gpus",), minors=False)
        current = run.current_groups()
        groups = {g.number: current.get(g.number) for g in run.plan.groups}
        bad = {n: t for n, t in groups.items() if t != "identity"}
        summary = ", ".join(f"group {n}: {t}" for n, t in groups.items()) or "no group in scope"
        return Check(not bad, summary, {"groups": groups})

    def fix(actions: list[Action], before: Check) -> None:
        assert run.plan is not None
        run.changed = True
        run.push_rebind_undo()
        try:
            check_kernel_holders(run)
            for g in run.plan.groups:
                if (before.state or {}).get("groups", {}).get(g.number) == "identity":
                    continue
                for f in g.unbind_order:
                    current = run.driver_now(f.bdf)
                    if not current:
                        continue
                    run.record("unbind", bdf=f.bdf, driver=current, group=g.number)
                    try:
                        pci.unbind(run.conn, f.bdf, current, timeout=run.opts.unbind_timeout)
                    except pci.PciError as exc:
                        if exc.errno == errno.ETIMEDOUT:
                            run.blocked.append(f"unbind {f.bdf} from {current}")
                            run.journal.write(blocked=run.blocked)
                        raise
                    f.current = None
                run.record("set-type", group=g.number, value="identity")
                try:
                    iommu.set_type(run.conn, g.to_group(), "identity", kernel=run.plan.kernel)
                except iommu.TypeReadBack as exc:
                    put_type_back(run, g.number, g.original_type, exc.now)
                    raise
                g.type = "identity"
        except Exception as exc:
            if run.conn.lost is None:
                evidence.current().note(
                    f"step failed ({exc}); rolling back: rebinding every unbound function"
                )
                try:
                    run.rollback()
                except GpuhostError as again:  # the undo at the end tries once more
                    evidence.current().note(f"rollback: {again}")
            raise

    return run.step("iommu groups identity", check, lambda before: actions.group_actions(run), fix)

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

from .service_env import ServiceEnvSteps

__all__ = ["PrepareSteps"]


class PrepareSteps(ServiceEnvSteps):
    """The steps that take the host apart: up to the groups in identity with their functions unbound."""

    # ------------------------------------------------------------------ step 1: plan

    def planned_actions(self) -> list[Action]:
        """Every action of a repair, in order (what step 1 announces)."""
        t = self.conn.name
        acts = [
            Action("take the run lock", f"mkdir {self.journal.lock_path}", t, False),
            Action("write the journal", f"write {self.journal.path}", t, False),
        ]
        acts += self.stop_actions()
        acts += self.release_actions()
        acts += self.group_actions()
        acts += self.bind_actions(all_functions=True)
        acts += self.persist_actions()
        acts.append(self.start_action())
        return acts

    def step_plan(self) -> Step:
        """Step 1: a repair plan is in force (lock held, journal written), or none is needed."""

        def check() -> Check:
            plan = self.plan if self.plan is not None else self.gather()
            if not plan.gpus:
                return Check(
                    True,
                    "no GPU in scope: " + plan.summary(),
                    plan.to_dict(),
                    skip="no NVIDIA GPU on nvidia in scope",
                )
            p2p_note = ""
            if self.before_ok is not None:
                p2p_note = "; P2P " + ("above" if self.before_ok else "below") + " threshold"
            if not plan.needs_repair:
                return Check(
                    True, "nothing to repair: every in-scope group is identity" + p2p_note, plan.to_dict()
                )
            if self.journal.held and self.journal.data.get("run_id") == self.journal.run_id:
                return Check(
                    True, "repair planned; lock held; journal written: " + plan.summary(), plan.to_dict()
                )
            return Check(False, "repair needed: " + plan.summary() + p2p_note, plan.to_dict())

        def fix(actions: list[Action], before: Check) -> None:
            owner = {"controller": socket.gethostname(), "procedure": "suites/p2p"}
            got = self.journal.acquire(wait=self.opts.lock_wait, stale_s=self.opts.lock_stale, owner=owner)
            if got.get("took_over"):
                evidence.current().note(f"took over a stale lock: {got['took_over'].get('why')}")
            # another run may have repaired the host while this one waited: read again
            self.read_facts(("gpus", "nvidia_smi_gpus", "host_info"))
            plan = self.make_plan()
            self.adopt_old_journal()
            if not plan.needs_repair:
                self.journal.release()
                return
            self.journal.data = {
                "procedure": "suites/p2p",
                "started": time.time(),
                "controller": owner["controller"],
                "resumed_from": plan.resumed_from,
                "plan": plan.to_dict(),
                "service": {"unit": self.service.unit, "where": self.service.where},
                "service_stopped": self.stopped_service,
                "persistenced_stopped": self.stopped_persistenced,
                "steps": list((self.old_journal or {}).get("steps", []))[-50:],
            }
            self.journal.write(phase="planned")
            # what an interrupted run left (or a function with no driver now) is put back at the end
            if self.stopped_service:
                self.push_service_undo()
            self.adopt_env_journal()
            if self.stopped_persistenced:
                self.push_persistenced_undo()
            if any(f.current != f.driver for g in plan.groups for f in g.functions):
                self.push_rebind_undo()

        return self.step("plan", check, lambda before: self.planned_actions(), fix)

    # ------------------------------------------------------------------ step 2: service stopped

    def step_service_stopped(self) -> Step:
        """Step 2: the service that holds the GPUs is stopped (bounded), only when a repair is needed."""

        def check() -> Check:
            assert self.plan is not None
            if not self.plan.needs_repair:
                return Check(True, f"not needed: no repair, {self.service.unit} left running")
            state = self.service.state()
            if not state.exists:
                return Check(
                    True,
                    f"no unit {self.service.unit} on {self.service.where}: nothing to stop",
                    dataclasses.asdict(state),
                )
            return Check(state.stopped, state.summary(), dataclasses.asdict(state))

        def fix(actions: list[Action], before: Check) -> None:
            self.stopped_service = True
            self.record("stop-service", unit=self.service.unit, where=self.service.where)
            self.journal.write(service_stopped=True)
            self.push_service_undo()
            report = self.service.stop(self.opts.stop_timeout)
            ev = evidence.current()
            ev.measure("service stop seconds", report.duration, "s", target=self.service.where)
            for s in report.steps:
                ev.note(f"{self.service.unit}: {s['step']} at {s['t']} s: {s['state']}")

        return self.step("service stopped", check, lambda before: self.stop_actions(), fix, on=self.svc_conn)

    # ------------------------------------------------------------------ step 3: GPUs released

    def holders(self) -> list[gpu.Holder]:
        """Processes holding an in-scope GPU (or the control devices) now."""
        assert self.plan is not None
        facts = self.conn.facts("gpu_holders", "persistence")
        self.facts.update(facts)
        files = {f"/dev/nvidia{m}" for m in self.plan.minors.values()} | {"/dev/nvidiactl", "/dev/nvidia-uvm"}
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

    def step_gpus_released(self) -> Step:
        """Step 3: nothing holds the in-scope GPUs: no process, no nvidia-persistenced, no legacy persistence."""

        def check() -> Check:
            assert self.plan is not None
            if not self.plan.needs_repair:
                return Check(True, "not needed: no repair")
            holders = self.holders()
            pers = (self.facts.get("persistence") or {}).get("persistenced_pids") or []
            legacy = self.legacy_on()
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
            acts = self.release_actions()
            pers = set((before.state or {}).get("persistenced_pids") or [])
            others = [h for h in (before.state or {}).get("holders", []) if h.get("pid") not in pers]
            for h in others:
                acts.append(
                    Action(
                        f"pid {h['pid']} ({h['comm']}) must let go (goes with {self.service.unit} if it is the service's)",
                        "none: this procedure never kills processes outside the service's unit",
                        self.conn.name,
                        False,
                    )
                )
            return acts

        def fix(actions: list[Action], before: Check) -> None:
            pers = (before.state or {}).get("persistenced_pids") or []
            pstate = self.persistenced.state()
            if pers or pstate.running:
                self.stopped_persistenced = pstate.running or self.stopped_persistenced
                self.record("stop-persistenced")
                self.journal.write(persistenced_stopped=self.stopped_persistenced)
                self.push_persistenced_undo()
                if pstate.exists:
                    self.persistenced.stop(self.opts.stop_timeout)
            # with the daemon gone, what nvidia-smi still reports as on is legacy persistence mode
            self.facts.update(self.conn.facts("persistence"))
            for b in self.legacy_on():
                self.record("persistence-off", bdf=b)
                r = self.conn.run(["nvidia-smi", "-i", b, "-pm", "0"], timeout=30)
                if r.rc != 0:
                    raise ProcedureError(
                        f"nvidia-smi -i {b} -pm 0 failed (rc {r.rc}): {(r.stderr or r.stdout).strip()[:200]}"
                    )
            holders = self.holders()
            if holders:
                raise ProcedureError(
                    "GPUs still held after stopping the service: "
                    + "; ".join(h.describe() for h in holders[:5])
                    + ". Stop these processes (they are not part of the service's unit), then run again"
                )

        return self.step("gpus released", check, plan, fix)

    # ------------------------------------------------------------------ step 4: groups identity

    def check_kernel_holders(self) -> None:
        """Stop before the first unbind when the kernel itself holds the GPUs: that unbind would never finish."""
        self.read_module_files()
        raw = self.conn.facts("gpu_holders").get("gpu_holders")
        held = gpu.open_counts(gpu.parse_holders(raw))
        found = self.kernel_holders(held)
        if found:
            raise ProcedureError(
                "; ".join(found) + ": an nvidia unbind would wait in the kernel until reboot: needs a reboot "
                "path (boot with nvidia_drm.modeset=0, or a driver from 580.105.08, and without the holder, then run "
                "again); nothing was unbound"
            )

    def put_type_back(self, number: int, original: str | None, now: str) -> None:
        """A write that succeeded left the group in another type than asked (5.11-6.4: DMA for a refused
        identity domain): write its original type back while its functions are still unbound."""
        assert self.plan is not None
        if not original or original == now or original not in ("DMA", "DMA-FQ", "identity"):
            return
        group = iommu.IommuGroup(number, now, [])
        self.record("set-type", group=number, value=original)
        try:
            iommu.set_type(self.conn, group, original, kernel=self.plan.kernel)
        except iommu.IommuError as exc:
            evidence.current().note(f"group {number}: could not put its type back to {original}: {exc}")
            return
        evidence.current().note(f"group {number}: read {now} after the write; its type is back to {original}")

    def step_iommu_groups_identity(self) -> Step:
        """Step 4: every in-scope IOMMU group is identity (unbind its functions, write, read back)."""

        def check() -> Check:
            assert self.plan is not None
            self.read_facts(("gpus",), minors=False)
            current = self.current_groups()
            groups = {g.number: current.get(g.number) for g in self.plan.groups}
            bad = {n: t for n, t in groups.items() if t != "identity"}
            summary = ", ".join(f"group {n}: {t}" for n, t in groups.items()) or "no group in scope"
            return Check(not bad, summary, {"groups": groups})

        def fix(actions: list[Action], before: Check) -> None:
            assert self.plan is not None
            self.changed = True
            self.push_rebind_undo()
            try:
                self.check_kernel_holders()
                for g in self.plan.groups:
                    if (before.state or {}).get("groups", {}).get(g.number) == "identity":
                        continue
                    for f in g.unbind_order:
                        current = self.driver_now(f.bdf)
                        if not current:
                            continue
                        self.record("unbind", bdf=f.bdf, driver=current, group=g.number)
                        try:
                            pci.unbind(self.conn, f.bdf, current, timeout=self.opts.unbind_timeout)
                        except pci.PciError as exc:
                            if exc.errno == errno.ETIMEDOUT:
                                self.blocked.append(f"unbind {f.bdf} from {current}")
                                self.journal.write(blocked=self.blocked)
                            raise
                        f.current = None
                    self.record("set-type", group=g.number, value="identity")
                    try:
                        iommu.set_type(self.conn, g.to_group(), "identity", kernel=self.plan.kernel)
                    except iommu.TypeReadBack as exc:
                        self.put_type_back(g.number, g.original_type, exc.now)
                        raise
                    g.type = "identity"
            except Exception as exc:
                if self.conn.lost is None:
                    evidence.current().note(
                        f"step failed ({exc}); rolling back: rebinding every unbound function"
                    )
                    try:
                        self.rollback()
                    except GpuhostError as again:  # the undo at the end tries once more
                        evidence.current().note(f"rollback: {again}")
                raise

        return self.step("iommu groups identity", check, lambda before: self.group_actions(), fix)

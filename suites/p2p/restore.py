"""Steps 5, 6, 8 and 9 of suites/p2p: drivers bound, P2P bandwidth, persisted, service restored."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pytest_gpuhost.modules import nccl, p2p, pci
from pytest_gpuhost.modules.service import check_health
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from . import persist
from .service_env import ServiceEnvSteps

__all__ = ["RestoreSteps"]


class RestoreSteps(ServiceEnvSteps):
    """The steps that put the host back together, repaired, and prove it."""

    # ------------------------------------------------------------------ step 5: drivers bound

    def wait_for_firmware(self) -> bool:
        """Poll nvidia-smi until it lists every in-scope GPU, up to gsp_wait seconds after a rebind; True if it polled.

        The first open after a bind starts the GPU's firmware (nv_open_device -> rm_init_adapter
        boots GSP-RM, open-gpu-kernel-modules kernel-open/nvidia/nv.c); with several GPUs one
        nvidia-smi can outlast its own time limit, or list a GPU only once it is up.
        """
        assert self.plan is not None
        t0 = time.monotonic()
        while True:
            smi = self.facts.get("nvidia_smi_gpus")
            missing = [b for b in self.plan.gpus if smi is None or b not in smi]
            waited = time.monotonic() - t0
            if not missing:
                if waited > 0.5:
                    evidence.current().note(
                        f"nvidia-smi listed every GPU {waited:.1f} s after the first try (firmware start on first open)"
                    )
                return waited > 0
            if waited >= self.opts.gsp_wait:
                evidence.current().note(
                    f"nvidia-smi still misses {', '.join(missing)} after {waited:.0f} s (the bound for the firmware start)"
                )
                return True
            time.sleep(2.0)
            self.read_facts(("nvidia_smi_gpus",))

    def step_drivers_bound(self) -> Step:
        """Step 5: every in-scope function is on its original driver, /dev/nvidiaN unchanged, nvidia-smi sees all."""

        def check() -> Check:
            assert self.plan is not None
            plan = self.plan
            if self.check_only and plan.groups_to_fix:
                return Check(
                    False,
                    f"step 4 would unbind {sum(len(g.functions) for g in plan.groups_to_fix)} functions; they are rebound here",
                )
            self.read_facts(("gpus", "nvidia_smi_gpus"))
            now = {m.bdf: m.driver for g in self.gpus() if g.group for m in g.group.members}
            if self.changed and all(now.get(f.bdf) == f.driver for f in plan.rebind_order):
                if self.wait_for_firmware():  # the minors in `gpus` come from the same nvidia-smi: read again
                    self.read_facts(("gpus", "nvidia_smi_gpus"))
            minors = {g.bdf: g.minor for g in self.gpus()}
            for f in (f for g in plan.groups for f in g.functions):
                f.current = now.get(f.bdf)
            wrong = [
                f"{f.bdf} on {f.current or 'no driver'} (was {f.driver})"
                for g in plan.groups
                for f in g.functions
                if f.current != f.driver
            ]
            renumbered = [
                f"{b}: {'no ' if minors.get(b) is None else ''}/dev/nvidia{'N' if minors.get(b) is None else minors[b]} (was /dev/nvidia{m})"
                for b, m in plan.minors.items()
                if minors.get(b) != m and not (minors.get(b) is None and now.get(b) is None)
            ]
            smi = self.facts.get("nvidia_smi_gpus")
            unseen = [b for b in plan.gpus if smi is not None and b not in smi]
            state = {"drivers": now, "minors": minors, "nvidia_smi": sorted(smi or {})}
            problems = wrong + renumbered + [f"nvidia-smi does not list {b}" for b in unseen]
            if smi is None:
                problems.append("nvidia-smi did not run")
            ok_line = f"{len(plan.gpus)} GPUs on nvidia as /dev/nvidia{','.join(str(plan.minors[b]) for b in plan.gpus if b in plan.minors)}; nvidia-smi sees all"
            return Check(not problems, "; ".join(problems) or ok_line, state)

        def fix(actions: list[Action], before: Check) -> None:
            assert self.plan is not None
            self.changed = True
            self.push_rebind_undo()
            for f in self.plan.rebind_order:
                if self.driver_now(f.bdf):
                    continue
                self.record("bind", bdf=f.bdf, driver=f.driver)
                pci.bind(self.conn, f.bdf, f.driver, timeout=self.opts.unbind_timeout)
            self.journal.write(phase="rebound")

        return self.step(
            "drivers bound",
            check,
            lambda before: self.bind_actions(all_functions=self.check_only),
            fix,
        )

    # ------------------------------------------------------------------ step 6: P2P bandwidth

    def step_p2p_bandwidth(self) -> Step:
        """Step 6: every in-scope GPU pair reaches its threshold peer to peer."""

        def check() -> Check:
            assert self.plan is not None
            if len(self.plan.gpus) < 2:
                return Check(
                    True,
                    "fewer than two GPUs in scope",
                    skip="fewer than two GPUs in scope: no pair to measure",
                )
            if self.before is not None and not self.changed:
                matrix = self.before
            else:
                self.read_facts(("nvidia_smi_gpus",))
                matrix = p2p.measure_anywhere(self.measure_conns(), self.plan.gpus, index=self.smi_index())
                self.record_matrix("P2P bandwidth after", matrix)
            self.no_tool = matrix.note if matrix.no_tool else ""
            state: dict[str, Any] = {"matrix": matrix.to_dict()}
            if matrix.no_tool:  # nothing was measured: say what to install where, not what to fix
                return Check(False, matrix.note, state)
            verdicts = self.judge(matrix)
            low = [v for v in verdicts if not v.ok]
            for v in verdicts:
                evidence.current().note(v.describe())
            measured = [v.gbps for v in verdicts if v.gbps is not None]
            line = (
                f"{len(verdicts)} pairs via {matrix.source}: min {min(measured):g} GB/s"
                if measured
                else f"no pair measured ({matrix.note})"
            )
            state["low"] = [v.describe() for v in low]
            if low:
                why = self.redirect_note(low)
                return Check(
                    False,
                    f"{len(low)} of {len(verdicts)} pairs below threshold, e.g. {low[0].describe()}{why}",
                    state,
                )
            return Check(True, line, state)

        def plan(before: Check) -> list[Action]:
            assert self.plan is not None
            if self.check_only and self.plan.needs_repair:
                return [
                    Action(
                        "measure again after steps 2-5 set the groups to identity",
                        f"nvbandwidth -t {p2p.NVBANDWIDTH_TEST}",
                        self.conn.name,
                        False,
                    )
                ]
            return []

        def fix(actions: list[Action], before: Check) -> None:
            if self.no_tool:
                raise ProcedureError(self.no_tool)
            why = self.redirect_note(None)
            raise ProcedureError(
                "P2P stays below threshold with every in-scope group in identity mode"
                + (
                    why
                    or ": look for PCIe ACS on the path (lspci -vvv | grep ACSCtl), a link trained down, or BIOS settings"
                )
            )

        return self.step("p2p bandwidth", check, plan, fix)

    # ------------------------------------------------------------------ step 8: persisted

    def step_persisted(self) -> Step:
        """Step 8: a boot-time unit sets exactly the in-scope groups to identity before the GPUs' users start."""

        def check() -> Check:
            assert self.plan is not None
            if not self.plan.groups:
                return Check(True, "no group in scope", skip="no IOMMU group in scope")
            boot = persist.boot_identity((self.facts.get("host_info") or {}).get("cmdline") or "")
            if boot and not self.plan.needs_repair and not self.changed:
                return Check(
                    True, f"identity at every boot by the kernel command line ({boot}): no unit needed"
                )
            want_script, want_unit = persist.script_text(self.plan), persist.unit_text()
            files = self.conn.read_files([persist.SCRIPT, persist.UNIT])
            r = self.conn.run(["systemctl", "is-enabled", persist.UNIT_NAME], timeout=15)
            enabled = r.stdout.strip()
            problems = []
            if files[persist.SCRIPT] != want_script:
                problems.append(
                    f"{persist.SCRIPT} "
                    + ("missing" if isinstance(files[persist.SCRIPT], OSError) else "differs from the plan")
                )
            if files[persist.UNIT] != want_unit:
                problems.append(
                    f"{persist.UNIT} "
                    + ("missing" if isinstance(files[persist.UNIT], OSError) else "differs")
                )
            if enabled != "enabled":
                problems.append(f"{persist.UNIT_NAME} is {enabled or 'unknown'}, not enabled")
            groups = ", ".join(str(g.number) for g in self.plan.groups)
            state = {
                "enabled": enabled,
                "groups": [g.number for g in self.plan.groups],
                "script": want_script,
            }
            return Check(
                not problems, "; ".join(problems) or f"{persist.UNIT_NAME} enabled for groups {groups}", state
            )

        def fix(actions: list[Action], before: Check) -> None:
            assert self.plan is not None
            for path, text in (
                (persist.SCRIPT, persist.script_text(self.plan)),
                (persist.UNIT, persist.unit_text()),
            ):
                w = self.conn.write_file(path, text, timeout=15)
                if not w.ok:
                    raise ProcedureError(f"writing {path} failed: {w.error}")
            for argv in (
                ["chmod", "0755", persist.SCRIPT],
                ["systemctl", "daemon-reload"],
                ["systemctl", "reenable", persist.UNIT_NAME],  # drops links of an older [Install]
            ):
                r = self.conn.run(argv, timeout=60)
                if r.rc != 0:
                    raise ProcedureError(
                        f"{' '.join(argv)} failed (rc {r.rc}): {(r.stderr or r.stdout).strip()[:200]}"
                    )

        return self.step("persisted", check, lambda before: self.persist_actions(), fix)

    # ------------------------------------------------------------------ step 9: service restored

    def health_url(self) -> str:
        """The URL polled for /health (from the service's own side)."""
        return self.opts.health_url or f"http://127.0.0.1:{self.opts.health_port}/health"

    def log_text(self) -> str:
        """The service's log files and its last journal lines, read where it runs."""
        paths = list(self.opts.log_paths) or [f"/var/log/sglang/{self.opts.service}.log"]
        files = self.svc_conn.read_files(paths)
        text = "\n".join(v for v in files.values() if isinstance(v, str))
        r = self.svc_conn.run(
            ["journalctl", "-u", self.service.unit, "--no-pager", "-n", "2000", "-o", "cat"], timeout=20
        )
        if r.rc == 0:
            text += "\n" + r.stdout
        return text

    def step_service_restored(self) -> Step:
        """Step 9: the service this run stopped runs again, /health answers, NCCL uses P2P not SHM."""

        def check() -> Check:
            assert self.plan is not None
            if self.check_only and self.plan.needs_repair:
                return Check(False, f"{self.service.unit} would be stopped in step 2 and started again here")
            state = self.service.state()
            if not state.exists:
                return Check(
                    True,
                    f"no unit {self.service.unit}",
                    skip=f"no unit {self.service.unit} on {self.service.where}",
                )
            if not state.running:
                if not self.stopped_service:
                    return Check(
                        True,
                        f"{state.summary()}: not started by this run (it did not stop it)",
                        dataclasses.asdict(state),
                    )
                return Check(False, f"{state.summary()}: stopped by this run", dataclasses.asdict(state))
            healthy, answer, waited = check_health(
                self.svc_conn, self.health_url(), bound=self.opts.health_timeout
            )
            # NCCL's own line forms (modules/nccl.py): SHM lines have no "/conn" after the channel
            channels = nccl.parse_channels(self.log_text())
            last = channels[-1].transport if channels else None
            s = dataclasses.asdict(state) | {"health": answer, "health_wait_s": waited, "nccl": last}
            problems = []
            if not healthy:
                problems.append(f"{self.health_url()} answered {answer}")
            if channels and channels[-1].kind != "P2P":
                problems.append(f"NCCL transport is {last}, not P2P" + self.env_hint())
            problems += self.env_left_after_start()
            summary = f"{state.summary()}; /health {answer} after {waited:g} s" + (
                f"; NCCL via {last}" if last else ""
            )
            return Check(not problems, "; ".join(problems) or summary, s)

        def fix(actions: list[Action], before: Check) -> None:
            if not self.stopped_service:
                if (before.state or {}).get("active_state") in ("active", "activating", "reloading"):
                    raise ProcedureError(f"{self.service.unit} runs, but: {before.summary}")
                raise ProcedureError(
                    f"{self.service.unit} is not running and this run did not stop it: not starting it"
                )
            self.refuse_start_while_blocked(self.service.unit)
            # the undos, run now in order: nvidia-persistenced, then the service
            if self.stopped_persistenced:
                self.persistenced.start()
                self.stopped_persistenced = False
                self.journal.write(persistenced_stopped=False)
            self.resolve("start-persistenced")
            self.service.start()
            self.stopped_service = False
            self.journal.write(service_stopped=False, phase="service-started")
            self.resolve("start-service")
            self.env_started()

        return self.step(
            "service restored", check, lambda before: [self.start_action(False)], fix, on=self.svc_conn
        )

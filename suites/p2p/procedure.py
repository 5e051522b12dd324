"""The P2P procedure on one target: the state shared by the eight steps, and each step's remediation.

The steps are tests in test_p2p.py (in order, `gpuhost_procedure`); each asks this object for a
`Remediation`. Facts are read once in step 1 and re-read where a step must verify. Every
destructive step is written to the target's journal before it runs; the module fixture's
teardown (`finish`) makes sure no in-scope function is left without its driver and the service
this run stopped runs again, whatever happened in between.
"""

from __future__ import annotations

import dataclasses
import errno
import socket
import time
from dataclasses import dataclass
from typing import Any

from pytest_gpuhost.errors import AgentError, CommandTimeout, ConnectError
from pytest_gpuhost.modules import gpu, iommu, p2p, pci
from pytest_gpuhost.modules.journal import Journal
from pytest_gpuhost.modules.service import Service, ServiceError, check_health, nccl_transport
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.remediation import Action, Check, Remediation
from suites.p2p import persist
from suites.p2p.plan import P2PPlan, make_plan

__all__ = ["P2POptions", "P2PProcedure", "ProcedureError"]

HOST_FACTS = ("gpus", "gpu_holders", "persistence", "host_info", "nvidia_smi_gpus")
QUICK = 10.0  # seconds to wait for a reply to a small metadata op (readlink, journal, lock)


class ProcedureError(RuntimeError):
    """A step cannot go on; the message is one line for the operator."""


@dataclass
class P2POptions:
    """The suite's settings (suites/p2p/options.py fills them from the command line and ini)."""

    gpus: list[str] | None = None
    stop_timeout: float = 20.0
    min_gbps: float | None = None
    fraction: float = p2p.DEFAULT_FRACTION
    service: str = "sglang-qwen"
    health_url: str | None = None
    health_port: int = 30000
    health_timeout: float = 120.0
    lock_wait: float = 60.0
    lock_stale: float = 600.0
    unbind_timeout: float = 15.0
    log_paths: tuple[str, ...] = ()


def unreachable(exc: BaseException) -> bool:
    """True when `exc` says the target cannot be reached (not that an operation on it failed)."""
    if isinstance(exc, ConnectError | CommandTimeout):
        return True
    text = str(exc)
    return isinstance(exc, AgentError) and (text.startswith("agent on ") or text.startswith("connection to "))


class _Step(Remediation):
    """A step whose check, fix and verify stop at once when the target has become unreachable.

    Without this, every later call of the run would wait out its own timeout on a dead link.
    """

    def __init__(
        self, proc: P2PProcedure, name: str, check: Any, plan: Any, fix: Any, verify: Any = None
    ) -> None:
        self.proc = proc
        self.name = name
        self._c, self._p, self._f, self._v = check, plan, fix, verify

    def _guard(self, fn: Any, *args: Any) -> Any:
        if self.proc.lost is not None:
            raise ProcedureError(f"target unreachable since: {self.proc.lost}")
        try:
            return fn(*args)
        except Exception as exc:
            if unreachable(exc):
                self.proc.lost = str(exc)
            raise

    def check(self) -> Check:
        return self._guard(self._c)

    def plan(self, before: Check) -> list[Action]:
        return self._guard(self._p, before) if self._p else []

    def fix(self, actions: list[Action], before: Check) -> None:
        self._guard(self._f, actions, before)

    def verify(self) -> Check:
        return self._guard(self._v or self._c)


class P2PProcedure:
    """State of one suites/p2p run against one target."""

    def __init__(self, target: Any, opts: P2POptions, *, check_only: bool) -> None:
        self.target = target
        self.conn = target.conn
        self.opts = opts
        self.check_only = check_only
        self.svc_conn = getattr(target, "container_conn", None) or target.conn
        self.service = Service(self.svc_conn, opts.service, where=self._where(self.svc_conn))
        self.persistenced = Service(self.conn, "nvidia-persistenced", where=self.conn.name)
        self.journal = Journal(self.conn, "p2p")
        self.facts: dict[str, Any] = {}
        self.plan: P2PPlan | None = None
        self.old_journal: dict[str, Any] | None = None
        self.before: p2p.P2PMatrix | None = None
        self.before_ok: bool | None = None
        self.changed = False  # this run unbound/rebound something: P2P must be measured again
        self.stopped_service = False  # this run (or the interrupted one it completes) stopped it
        self.stopped_persistenced = False
        self.service_state: Any = None
        self.lost: str | None = None  # why the target became unreachable during this run
        self.blocked: list[str] = []  # writes left blocked in the kernel (an nvidia unbind while held)
        self.topo: dict[tuple[str, str], str] = {}  # nvidia-smi topo -m link per GPU pair (NV#, PIX, ...)
        self.boot_record: dict[str, dict[str, Any]] = {}  # functions listed by the installed boot script

    @staticmethod
    def _where(conn: Any) -> str:
        return str(getattr(conn, "name", "target"))

    # ------------------------------------------------------------------ facts

    def read_facts(self, names: tuple[str, ...] = HOST_FACTS, **params: Any) -> dict[str, Any]:
        """Read host facts (all the procedure needs by default), the journal and the boot script in one round trip."""
        replies = self.conn.batch(
            [
                {"op": "facts", "names": list(names), "params": params, "timeout": 60},
                self.journal.read_request(),
                {"op": "read_files", "paths": [persist.SCRIPT], "timeout": 5},
            ]
        )
        if isinstance(replies[0], Exception):
            raise replies[0]
        self.facts.update(replies[0])
        self.old_journal = Journal.parse(replies[1])
        script = replies[2].get(persist.SCRIPT, {}) if isinstance(replies[2], dict) else {}
        self.boot_record = persist.recorded_functions(script.get("data", "")) if "data" in script else {}
        return self.facts

    def gpus(self) -> list[gpu.GpuInfo]:
        """GpuInfo from the last facts read."""
        return gpu.from_facts(self.facts.get("gpus"), self.facts.get("gpu_holders"))

    def kernel(self) -> str:
        """Kernel release of the target."""
        info = self.facts.get("host_info") or {}
        return str(info.get("kernel") or self.conn.hello.get("kernel") or "")

    def make_plan(self) -> P2PPlan:
        """(Re)plan from the last facts read and any journal found."""
        journal = (
            self.old_journal
            if self.old_journal and self.old_journal.get("run_id") != self.journal.run_id
            else None
        )
        gpus = self.gpus()
        if journal is None:
            journal = self._boot_record_journal(gpus)
        self.plan = make_plan(gpus, kernel=self.kernel(), selected=self.opts.gpus, journal=journal)
        smi = self.facts.get("nvidia_smi_gpus") or {}
        names = [str((smi.get(b) or {}).get("name") or "") for b in self.plan.gpus]
        self.plan.model = names[0] if names else ""
        return self.plan

    def _boot_record_journal(self, gpus: list[gpu.GpuInfo]) -> dict[str, Any] | None:
        """A journal-shaped record, from the installed boot script, of functions that lost their driver.

        Only functions with no driver now are taken from it: what is bound now always wins.
        """
        driverless = {m.bdf for g in gpus if g.group for m in g.group.members if not m.driver}
        record = [f for b, f in self.boot_record.items() if b in driverless]
        if not record:
            return None
        evidence.current().note(
            "no driver now, driver known from the boot script: "
            + ", ".join(f"{f['bdf']} ({f['driver']})" for f in record)
        )
        return {
            "run_id": None,
            "plan": {"groups": [{"number": -1, "original_type": None, "functions": record}]},
        }

    def gather(self) -> P2PPlan:
        """Step 1's read: facts, journal, plan, service state, and P2P before anything changes."""
        self.read_facts()
        plan = self.make_plan()
        ev = evidence.current()
        ev.state("plan", plan.to_dict(), target=self.conn.name)
        for bdf, why in plan.excluded.items():
            ev.note(f"{bdf}: excluded: {why}")
        try:
            self.service_state = self.service.state()
        except ServiceError as exc:
            self.service_state = None
            ev.note(f"service {self.service.unit}: {exc}")
        if self.old_journal and plan.resumed_from:
            ev.note(
                f"journal of interrupted run {plan.resumed_from} found at phase {self.old_journal.get('phase')}"
            )
            self.stopped_service = bool(self.old_journal.get("service_stopped"))
            self.stopped_persistenced = bool(self.old_journal.get("persistenced_stopped"))
        if len(plan.gpus) >= 2 and not plan.unbound:
            index = self._smi_index()
            self.topo = p2p.topology(self.conn, plan.gpus, index)
            self.before = p2p.measure(self.conn, plan.gpus, index=index)
            self.before_ok = all(v.ok for v in self._judge(self.before))
            self._record_matrix("P2P bandwidth before", self.before)
        return plan

    def _smi_index(self) -> dict[int, str] | None:
        """nvidia-smi index -> PCI address, from the last facts read (None when unknown)."""
        smi = self.facts.get("nvidia_smi_gpus") or {}
        index = {int(row["index"]): bdf for bdf, row in smi.items() if str(row.get("index", "")).isdigit()}
        return index or None

    def _judge(self, matrix: p2p.P2PMatrix) -> list[p2p.PairVerdict]:
        assert self.plan is not None
        return p2p.judge(
            matrix,
            self.plan.links,
            min_gbps=self.opts.min_gbps,
            fraction=self.opts.fraction,
            topo=self.topo,
            model=self.plan.model,
        )

    def _threshold(self, verdicts: list[p2p.PairVerdict]) -> float | None:
        values = [v.threshold for v in verdicts if v.threshold is not None]
        return min(values) if values else None

    def _record_matrix(self, name: str, matrix: p2p.P2PMatrix) -> None:
        verdicts = self._judge(matrix)
        ev = evidence.current()
        ev.matrix(
            name,
            matrix.bdfs,
            matrix.rows(),
            unit="GB/s",
            threshold=self._threshold(verdicts),
            target=self.conn.name,
        )
        ev.note(f"{name}: measured with {matrix.source}" + (f"; {matrix.note}" if matrix.note else ""))

    # ------------------------------------------------------------------ step 1: plan

    def _planned_actions(self) -> list[Action]:
        assert self.plan is not None
        t = self.conn.name
        acts = [
            Action("take the run lock", f"mkdir {self.journal.lock_path}", t, False),
            Action("write the journal", f"write {self.journal.path}", t, False),
        ]
        acts += self._stop_actions()
        acts += self._release_actions(include_holders=False)
        acts += self._group_actions()
        acts += self._bind_actions(all_functions=True)
        acts += self._persist_actions()
        acts.append(
            Action(
                f"start {self.service.unit} again",
                f"systemctl start {self.service.unit}",
                self._where(self.svc_conn),
            )
        )
        return acts

    def step_plan(self) -> Remediation:
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
            if self.old_journal and plan.resumed_from:
                self.stopped_service = self.stopped_service or bool(self.old_journal.get("service_stopped"))
                self.stopped_persistenced = self.stopped_persistenced or bool(
                    self.old_journal.get("persistenced_stopped")
                )
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

        return _Step(self, "plan", check, lambda before: self._planned_actions(), fix)

    # ------------------------------------------------------------------ step 2: service stopped

    def _stop_actions(self) -> list[Action]:
        where = self._where(self.svc_conn)
        return [
            Action(f"stop {self.service.unit}", cmd, where)
            for cmd in self.service.commands(self.opts.stop_timeout)
        ]

    def step_service_stopped(self) -> Remediation:
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
            self.journal.step("stop-service", unit=self.service.unit, where=self.service.where)
            self.journal.write(service_stopped=True)
            report = self.service.stop(self.opts.stop_timeout)
            ev = evidence.current()
            ev.measure("service stop seconds", report.duration, "s", target=self.service.where)
            for s in report.steps:
                ev.note(f"{self.service.unit}: {s['step']} at {s['t']} s: {s['state']}")

        return _Step(self, "service stopped", check, lambda before: self._stop_actions(), fix)

    # ------------------------------------------------------------------ step 3: GPUs released

    def _holders(self) -> list[gpu.Holder]:
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

    def _legacy_on(self) -> list[str]:
        assert self.plan is not None
        legacy = (self.facts.get("persistence") or {}).get("legacy") or {}
        return [b for b in self.plan.gpus if str(legacy.get(b, "")).lower() in ("enabled", "1", "on")]

    def _release_actions(self, include_holders: bool = True) -> list[Action]:
        assert self.plan is not None
        t = self.conn.name
        acts = [
            Action(f"stop {self.persistenced.unit}", cmd, t)
            for cmd in self.persistenced.commands(self.opts.stop_timeout)[:1]
        ]
        for b in self._legacy_on() if self.facts.get("persistence") else []:
            acts.append(
                Action(
                    f"persistence mode off on {b} (if still on once nvidia-persistenced is stopped)",
                    f"nvidia-smi -i {b} -pm 0",
                    t,
                )
            )
        return acts

    def step_gpus_released(self) -> Remediation:
        """Step 3: nothing holds the in-scope GPUs: no process, no nvidia-persistenced, no legacy persistence."""

        def check() -> Check:
            assert self.plan is not None
            if not self.plan.needs_repair:
                return Check(True, "not needed: no repair")
            holders = self._holders()
            pers = (self.facts.get("persistence") or {}).get("persistenced_pids") or []
            legacy = self._legacy_on()
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
            acts = self._release_actions()
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
                self.journal.step("stop-persistenced")
                self.journal.write(persistenced_stopped=self.stopped_persistenced)
                if pstate.exists:
                    self.persistenced.stop(self.opts.stop_timeout)
            # with the daemon gone, what nvidia-smi still reports as on is legacy persistence mode
            self.facts.update(self.conn.facts("persistence"))
            for b in self._legacy_on():
                self.journal.step("persistence-off", bdf=b)
                r = self.conn.run(["nvidia-smi", "-i", b, "-pm", "0"], timeout=30)
                if r.rc != 0:
                    raise ProcedureError(
                        f"nvidia-smi -i {b} -pm 0 failed (rc {r.rc}): {(r.stderr or r.stdout).strip()[:200]}"
                    )
            holders = self._holders()
            if holders:
                raise ProcedureError(
                    "GPUs still held after stopping the service: "
                    + "; ".join(h.describe() for h in holders[:5])
                    + ". Stop these processes (they are not part of the service's unit), then run again"
                )

        return _Step(self, "gpus released", check, plan, fix)

    # ------------------------------------------------------------------ step 4: groups identity

    def _group_actions(self) -> list[Action]:
        assert self.plan is not None
        t = self.conn.name
        acts: list[Action] = []
        for g in self.plan.groups_to_fix:
            for f in g.unbind_order:
                if f.current:
                    acts.append(
                        Action(
                            f"unbind {f.bdf} from {f.current} (group {g.number})",
                            pci.unbind_command(f.bdf, f.current),
                            t,
                        )
                    )
            if not g.identity:
                acts.append(
                    Action(
                        f"group {g.number}: {g.type} -> identity", iommu.type_command(g.number, "identity"), t
                    )
                )
        return acts

    def _current_groups(self) -> dict[int, str | None]:
        return {g.iommu_group: g.group_type for g in self.gpus() if g.iommu_group is not None}

    def step_groups_identity(self) -> Remediation:
        """Step 4: every in-scope IOMMU group is identity (unbind its functions, write, read back)."""

        def check() -> Check:
            assert self.plan is not None
            self.read_facts(("gpus",), minors=False)
            current = self._current_groups()
            groups = {g.number: current.get(g.number) for g in self.plan.groups}
            bad = {n: t for n, t in groups.items() if t != "identity"}
            summary = ", ".join(f"group {n}: {t}" for n, t in groups.items()) or "no group in scope"
            return Check(not bad, summary, {"groups": groups})

        def fix(actions: list[Action], before: Check) -> None:
            assert self.plan is not None
            self.changed = True
            try:
                for g in self.plan.groups:
                    if (before.state or {}).get("groups", {}).get(g.number) == "identity":
                        continue
                    for f in g.unbind_order:
                        current = self._driver_now(f.bdf)
                        if not current:
                            continue
                        self.journal.step("unbind", bdf=f.bdf, driver=current, group=g.number)
                        try:
                            pci.unbind(self.conn, f.bdf, current, timeout=self.opts.unbind_timeout)
                        except pci.PciError as exc:
                            if exc.errno == errno.ETIMEDOUT:
                                self.blocked.append(f"unbind {f.bdf} from {current}")
                                self.journal.write(blocked=self.blocked)
                            raise
                        f.current = None
                    self.journal.step("set-type", group=g.number, value="identity")
                    iommu.set_type(self.conn, g.to_group(), "identity", kernel=self.plan.kernel)
                    g.type = "identity"
            except Exception as exc:
                evidence.current().note(
                    f"step failed ({exc}); rolling back: rebinding every unbound function"
                )
                self.rollback()
                raise

        return _Step(self, "iommu groups identity", check, lambda before: self._group_actions(), fix)

    def _driver_now(self, bdf: str) -> str | None:
        link = f"{pci.DEVICES}/{bdf}/driver"
        r = self.conn.call("readlink", paths=[link], reply_timeout=QUICK)
        entry = r.get(link) or {}
        target = entry.get("target") if isinstance(entry, dict) else None
        return target.rsplit("/", 1)[-1] if target else None

    def rollback(self) -> list[str]:
        """Rebind every in-scope function that has no driver, in the original order; return errors."""
        if self.plan is None:
            return []
        errors = []
        try:
            for f in self.plan.rebind_order:
                try:
                    if self._driver_now(f.bdf):
                        continue
                    self.journal.step("rollback-bind", bdf=f.bdf, driver=f.driver)
                    pci.bind(self.conn, f.bdf, f.driver, timeout=self.opts.unbind_timeout)
                except OSError as exc:  # this function refused; try the others
                    errors.append(str(exc))
        except Exception as exc:  # the target is unreachable: the journal tells the next run
            errors.append(f"target unreachable during rollback: {exc}")
        for e in errors:
            evidence.current().note(f"rollback: {e}")
        return errors

    # ------------------------------------------------------------------ step 5: drivers bound

    def _bind_actions(self, all_functions: bool = False) -> list[Action]:
        assert self.plan is not None
        t = self.conn.name
        todo = self.plan.rebind_order
        if not all_functions:
            todo = [f for f in todo if f.current != f.driver]
        return [Action(f"bind {f.bdf} to {f.driver}", pci.bind_command(f.bdf, f.driver), t) for f in todo]

    def step_drivers_bound(self) -> Remediation:
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
            for f in self.plan.rebind_order:
                if self._driver_now(f.bdf):
                    continue
                self.journal.step("bind", bdf=f.bdf, driver=f.driver)
                pci.bind(self.conn, f.bdf, f.driver, timeout=self.opts.unbind_timeout)
            self.journal.write(phase="rebound")

        return _Step(
            self,
            "drivers bound",
            check,
            lambda before: self._bind_actions(all_functions=self.check_only),
            fix,
        )

    # ------------------------------------------------------------------ step 6: P2P bandwidth

    def step_p2p_bandwidth(self) -> Remediation:
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
                matrix = p2p.measure(self.conn, self.plan.gpus, index=self._smi_index())
                self._record_matrix("P2P bandwidth after", matrix)
            verdicts = self._judge(matrix)
            low = [v for v in verdicts if not v.ok]
            for v in verdicts:
                evidence.current().note(v.describe())
            measured = [v.gbps for v in verdicts if v.gbps is not None]
            line = (
                f"{len(verdicts)} pairs via {matrix.source}: min {min(measured):g} GB/s"
                if measured
                else f"no pair measured ({matrix.note})"
            )
            state = {"matrix": matrix.to_dict(), "low": [v.describe() for v in low]}
            if low:
                return Check(
                    False,
                    f"{len(low)} of {len(verdicts)} pairs below threshold, e.g. {low[0].describe()}",
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
            raise ProcedureError(
                "P2P stays below threshold with every in-scope group in identity mode: look for PCIe ACS "
                "on the path (lspci -vvv | grep ACSCtl), a link trained down, or BIOS settings"
            )

        return _Step(self, "p2p bandwidth", check, plan, fix)

    # ------------------------------------------------------------------ step 7: persisted

    def _persist_actions(self) -> list[Action]:
        t = self.conn.name
        return [
            Action("install the boot script", f"write {persist.SCRIPT} (mode 0755)", t, False),
            Action("install the unit", f"write {persist.UNIT}", t, False),
            Action("reload systemd", "systemctl daemon-reload", t, False),
            Action("enable the unit", f"systemctl enable {persist.UNIT_NAME}", t, False),
        ]

    def step_persisted(self) -> Remediation:
        """Step 7: a boot-time unit sets exactly the in-scope groups to identity before the GPUs' users start."""

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
                ["systemctl", "enable", persist.UNIT_NAME],
            ):
                r = self.conn.run(argv, timeout=60)
                if r.rc != 0:
                    raise ProcedureError(
                        f"{' '.join(argv)} failed (rc {r.rc}): {(r.stderr or r.stdout).strip()[:200]}"
                    )

        return _Step(self, "persisted", check, lambda before: self._persist_actions(), fix)

    # ------------------------------------------------------------------ step 8: service restored

    def health_url(self) -> str:
        """The URL polled for /health (from the service's own side)."""
        return self.opts.health_url or f"http://127.0.0.1:{self.opts.health_port}/health"

    def _log_text(self, since: float | None) -> str:
        paths = list(self.opts.log_paths) or [f"/var/log/sglang/{self.opts.service}.log"]
        files = self.svc_conn.read_files(paths)
        text = "\n".join(v for v in files.values() if isinstance(v, str))
        r = self.svc_conn.run(
            ["journalctl", "-u", self.service.unit, "--no-pager", "-n", "2000", "-o", "cat"], timeout=20
        )
        if r.rc == 0:
            text += "\n" + r.stdout
        return text

    def step_service_restored(self) -> Remediation:
        """Step 8: the service this run stopped runs again, /health answers, NCCL uses P2P not SHM."""

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
            transports = nccl_transport(self._log_text(None))
            last = transports[-1] if transports else None
            s = dataclasses.asdict(state) | {"health": answer, "health_wait_s": waited, "nccl": last}
            problems = []
            if not healthy:
                problems.append(f"{self.health_url()} answered {answer}")
            if last is not None and not last.startswith("P2P"):
                problems.append(f"NCCL transport is {last}, not P2P")
            summary = f"{state.summary()}; /health {answer} after {waited:g} s" + (
                f"; NCCL via {last}" if last else ""
            )
            return Check(not problems, "; ".join(problems) or summary, s)

        def fix(actions: list[Action], before: Check) -> None:
            if not self.stopped_service:
                raise ProcedureError(
                    f"{self.service.unit} is not running and this run did not stop it: not starting it"
                )
            if self.stopped_persistenced:
                self.persistenced.start()
                self.stopped_persistenced = False
                self.journal.write(persistenced_stopped=False)
            self.service.start()
            self.stopped_service = False
            self.journal.write(service_stopped=False, phase="service-started")

        def plan(before: Check) -> list[Action]:
            return [
                Action(
                    f"start {self.service.unit}",
                    f"systemctl start {self.service.unit}",
                    self._where(self.svc_conn),
                    False,
                )
            ]

        return _Step(self, "service restored", check, plan, fix)

    # ------------------------------------------------------------------ end of run

    def finish(self) -> list[str]:
        """End of run: never leave a GPU without its driver; restart what this run stopped; release.

        Runs from the module fixture's teardown, whatever the steps did. Under --check-only it
        does nothing. Returns problems (also noted in the evidence).
        """
        if self.check_only or not self.journal.held:
            return []
        if self.lost is not None:
            evidence.current().note(
                f"finish: target unreachable ({self.lost}); the journal on it tells the next run"
            )
            return [f"target unreachable: {self.lost}"]
        problems = self.rollback()
        if problems and "unreachable" in problems[-1]:
            evidence.current().note(f"finish: {problems[-1]}; the journal on the target tells the next run")
            return problems
        if self.stopped_persistenced:
            try:
                self.persistenced.start()
                self.stopped_persistenced = False
                self.journal.write(persistenced_stopped=False)
            except Exception as exc:
                problems.append(f"starting nvidia-persistenced: {exc}")
        if self.stopped_service and not problems:
            try:
                self.service.start()
                self.stopped_service = False
                self.journal.write(service_stopped=False)
            except Exception as exc:
                problems.append(f"starting {self.service.unit}: {exc}")
        if self.blocked:
            # the kernel still holds the write: the GPU loses its driver once its users let go;
            # the journal stays so that the next run rebinds it
            problems.append(
                f"{', '.join(self.blocked)} is still blocked in the kernel; the journal stays for the next run to complete"
            )
            self.journal.release()
        elif not problems:
            self.journal.retire()
            self.journal.release()
        for p in problems:
            evidence.current().note(f"finish: {p}")
        return problems

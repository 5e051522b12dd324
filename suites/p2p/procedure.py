"""The P2P procedure on one target: the state its nine steps share, the facts, the plan and the undo.

The steps are tests in test_p2p.py (in order, `gpuhost_procedure`). Each builds its `Remediation`
from the one `P2PProcedure` of the target: steps 1-4 (take the host apart) are the functions of
prepare.py, steps 5-6 and 8-9 (put it back, prove it) of restore.py, step 7 (the NCCL collective)
of collective.py, and the service's own NCCL settings those steps read and unset of
service_env.py. What each step runs, as the actions its plan shows, is actions.py. Step names follow one convention in every suite: the test is `test_<name>`, its
remediation is named `<name>` with spaces ("iommu groups identity"), the function that builds it
`step_<name>(run)`.

Facts are read once in step 1 and re-read where a step must verify. The host's journal
(`/var/lib/gpuhost/journal/p2p.json`) records every destructive action before it is taken; the
undo stack of `Procedure` puts back, at the end of the run (the module fixture's teardown,
`finish`), what a failed or cut run left: unbound functions (rebound in the original order),
nvidia-persistenced and the service this run stopped. No in-scope function is left without its
driver, whatever happened in between.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.errors import Unreachable
from pytest_gpuhost.modules import acs, gpu, iommu, p2p, p2p_causes, p2p_reports, pci, service_env
from pytest_gpuhost.modules import p2p_boot as persist
from pytest_gpuhost.modules.journal import Journal
from pytest_gpuhost.modules.service import Service, ServiceError
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError
from pytest_gpuhost.run.suite import SuiteProcedure

from . import holder
from .options import P2POptions
from .plan import P2PPlan, make_plan, redirect_advice

__all__ = ["HOST_FACTS", "P2PProcedure"]

# pci_paths: the ports above each GPU with their ACS bits (why a group is shared; ACS redirect)
# p2p_causes: BAR1, NUMA, links, ports' power management and AER, nvidia_uvm's HMM (the diagnosis)
HOST_FACTS = ("gpus", "gpu_holders", "persistence", "host_info", "nvidia_smi_gpus", "pci_paths", "p2p_causes")
QUICK = 10.0  # seconds to wait for a reply to a small metadata op (readlink, journal, lock)


def _texts(reply: Any) -> dict[str, str | None]:
    """Path -> text of a read_files reply (None for a file that could not be read)."""
    if not isinstance(reply, dict):
        return {}
    return {p: (e.get("data") if isinstance(e, dict) else None) for p, e in reply.items()}


class P2PProcedure(SuiteProcedure):
    """One suites/p2p run against one target (the host, and the service's container)."""

    def __init__(self, target: Any, opts: P2POptions, *, check_only: bool) -> None:
        super().__init__(target, check_only=check_only, journal_name="p2p")
        journal = self.journal
        assert journal is not None  # journal_name given
        self.journal: Journal = journal
        self.target = target
        self.opts = opts
        self.conn = self.host
        self.svc_conn = self.container or self.host  # where the service runs
        # None until step 1 finds the unit holding the GPUs (or there is none: nothing to stop)
        self._service = (
            Service(self.svc_conn, opts.service, where=self.svc_conn.name) if opts.service else None
        )
        self.service_origin = "--service or the inventory" if opts.service else ""
        self.persistenced = Service(self.conn, "nvidia-persistenced", where=self.conn.name)
        self.facts: dict[str, Any] = {}
        self.plan: P2PPlan | None = None
        self.before: p2p.P2PMatrix | None = None
        self.after: p2p.P2PMatrix | None = None  # step 6's measurement, when it measured again
        self.collective: tuple[Any, Any] | None = None  # step 7's two arms (P2P on, P2P off)
        self.before_ok: bool | None = None
        self.changed = False  # this run unbound/rebound something: P2P must be measured again
        self.stopped_service = False  # this run (or the interrupted one it completes) stopped it
        self.stopped_persistenced = False
        self.service_state: Any = None
        self.blocked: list[str] = []  # writes left blocked in the kernel (an nvidia unbind while held)
        self.no_tool = ""  # step 6: why nothing could be measured (no tool on the host or in the container)
        self.topo: dict[tuple[str, str], str] = {}  # nvidia-smi topo -m link per GPU pair (NV#, PIX, ...)
        self.boot_record: dict[str, dict[str, Any]] = {}  # functions listed by the installed boot script
        self.snp: iommu.SnpFacts | None = None  # SEV-SNP on the IOMMU, from step 1
        self.module_files: dict[str, str | None] = {}  # nvidia_drm/nvidia_uvm files (kernel-side holders)
        self.service_env: service_env.ServiceEnv | None = None  # what the service set, read in step 1
        self.unset_names: list[str] = []  # what this run's drop-in unsets (suites/p2p/service_env.py)
        self.diag_raw: dict[str, str] = {}  # step 1's diagnosis command outputs (diagnosis.py)
        self.diagnosis: p2p_causes.Diagnosis | None = None

    @property
    def has_service(self) -> bool:
        """True when a unit was given or found holding the in-scope GPUs."""
        return self._service is not None

    @property
    def service(self) -> Service:
        """The unit that holds the GPUs; only on paths where there is one (`has_service`)."""
        if self._service is None:
            raise ProcedureError("no service holds the in-scope GPUs and none was given")
        return self._service

    # ------------------------------------------------------------------ facts and plan

    def read_facts(self, names: tuple[str, ...] = HOST_FACTS, **params: Any) -> dict[str, Any]:
        """Read host facts (all the procedure needs by default), the journal and the boot script in one round trip."""
        kernel_side = "host_info" in names  # step 1's read: what the kernel will refuse or block
        requests = [
            {"op": "facts", "names": list(names), "params": params, "timeout": 60},
            self.journal.read_request(),
            {"op": "read_files", "paths": [persist.SCRIPT], "timeout": 5},
        ]
        if kernel_side:
            requests += [
                {"op": "read_files", "paths": [iommu.SNP_PARAM, *gpu.MODULE_FILES], "timeout": 5},
                {"op": "run", "argv": ["dmesg"], "timeout": 20, "max_output": 4 << 20},
                {"op": "glob", "pattern": "/sys/class/iommu/*", "timeout": 5},
                *[dict(r) for r in p2p_causes.READS],
            ]
        replies = self.conn.batch(requests)
        if isinstance(replies[0], Exception):
            raise replies[0]
        self.facts.update(replies[0])
        self.old_journal = Journal.parse(replies[1])
        script = replies[2].get(persist.SCRIPT, {}) if isinstance(replies[2], dict) else {}
        self.boot_record = persist.recorded_functions(script.get("data", "")) if "data" in script else {}
        if kernel_side:
            self._kernel_facts(*replies[3:6])
            self.diag_raw = p2p_causes.outputs(replies[6:])
        return self.facts

    def _kernel_facts(self, files: Any, dmesg: Any, classes: Any) -> None:
        """Keep SEV-SNP and kernel-side holder facts from step 1's round trip."""
        text = _texts(files)
        self.module_files = {p: text.get(p) for p in gpu.MODULE_FILES}
        log = dmesg.get("stdout") if isinstance(dmesg, dict) and dmesg.get("rc") == 0 else None
        if log is None:
            r = self.conn.run(["journalctl", "-k", "-b", "-o", "cat", "--no-pager"], timeout=30)
            log = r.stdout if r.rc == 0 else None
        found = classes if isinstance(classes, list) else None
        cmdline = str((self.facts.get("host_info") or {}).get("cmdline") or "")
        self.snp = iommu.snp_facts(cmdline, log, text.get(iommu.SNP_PARAM), list(found or []))
        if self.snp.unknown:
            evidence.current().note(self.snp.unknown)

    def kernel_holders(self, held: dict[str, int]) -> list[str]:
        """Kernel-side holders of the GPUs (from the module files last read), given the files processes hold."""
        return gpu.kernel_holders(self.module_files, held)

    def read_module_files(self) -> None:
        """Read the nvidia module files again (just before the first unbind)."""
        self.module_files = _texts(
            self.conn.call("read_files", paths=list(gpu.MODULE_FILES), reply_timeout=QUICK)
        )

    def gpus(self) -> list[gpu.GpuInfo]:
        """GpuInfo from the last facts read."""
        return gpu.from_facts(self.facts.get("gpus"), self.facts.get("gpu_holders"))

    def kernel(self) -> str:
        """Kernel release of the target."""
        info = self.facts.get("host_info") or {}
        return str(info.get("kernel") or self.conn.hello.get("kernel") or "")

    def make_plan(self) -> P2PPlan:
        """(Re)plan from the last facts read and any journal found."""
        journal = self.interrupted()
        gpus = self.gpus()
        if journal is None:
            journal = self._boot_record_journal(gpus)
        self.plan = make_plan(
            gpus,
            kernel=self.kernel(),
            selected=self.opts.gpus,
            journal=journal,
            paths=acs.parse_paths(self.facts.get("pci_paths")),
        )
        self.plan.errors.extend(self.kernel_refusals(self.plan))
        info = self.facts.get("host_info") or {}
        if not self.plan.gpus and isinstance(info, dict) and info.get("nvidia_driver") == []:
            # nothing to restore, and nothing to stop for it: refused here, before any step acts
            self.plan.errors.append(
                "no NVIDIA driver on this host (no nvidia module, no /proc/driver/nvidia, "
                "no /dev/nvidiactl): nothing to restore"
            )
        smi = self.facts.get("nvidia_smi_gpus") or {}
        names = [str((smi.get(b) or {}).get("name") or "") for b in self.plan.gpus]
        self.plan.model = names[0] if names else ""
        return self.plan

    def kernel_refusals(self, plan: P2PPlan) -> list[str]:
        """What the kernel will refuse or never finish, decided before anything is stopped or written."""
        out = []
        if self.snp is not None:
            why = iommu.snp_refusal(self.snp, plan.kernel, plan.needs_identity)
            if why:
                out.append(why)
        if plan.groups_to_fix:
            held = gpu.open_counts(gpu.parse_holders(self.facts.get("gpu_holders")))
            for k in self.kernel_holders(held):
                out.append(
                    f"{k}: an nvidia unbind would wait in the kernel until reboot: needs a reboot path"
                )
        return out

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

    def adopt_old_journal(self) -> None:
        """Take over what an interrupted run's journal says it stopped (this run restarts it)."""
        if self.old_journal and self.plan is not None and self.plan.resumed_from:
            self.stopped_service = self.stopped_service or bool(self.old_journal.get("service_stopped"))
            self.stopped_persistenced = self.stopped_persistenced or bool(
                self.old_journal.get("persistenced_stopped")
            )

    def gather(self) -> P2PPlan:
        """Step 1's read: facts, journal, plan, service state, and P2P before anything changes."""
        self.read_facts()
        plan = self.make_plan()
        ev = evidence.current()
        ev.state("plan", plan.to_dict(), target=self.conn.name)
        for bdf, why in plan.excluded.items():
            ev.note(f"{bdf}: excluded: {why}")
        for g in plan.groups:
            if g.kept:
                ev.note(
                    f"group {g.number}: {', '.join(g.kept)} stay bound: from kernel 6.4 a driver that manages "
                    "its own DMA (pcieport, pci-stub, vfio-pci) does not count in group->owner_cnt"
                )
        if plan.redirects:
            ev.note("ACS redirect: " + redirect_advice(plan.redirects))
        if plan.gpus:
            self.diagnose()  # before the measurement: its expectations are step 6's thresholds
        self.find_service(plan)
        try:
            self.service_state = self.service.state() if self.has_service else None
        except (ServiceError, ProcedureError) as exc:
            self.service_state = None
            ev.note(f"service {self.service.unit}: {exc}")
        self.service_env = self.read_service_env()  # before any stop: the processes' environment
        if self.old_journal and plan.resumed_from:
            ev.note(
                f"journal of interrupted run {plan.resumed_from} found at phase {self.old_journal.get('phase')}"
            )
            self.adopt_old_journal()
        if len(plan.gpus) >= 2 and not plan.unbound:
            index = self.smi_index()
            self.topo = p2p.topology(self.conn, plan.gpus, index)
            self.before = p2p.measure_anywhere(self.measure_conns(), plan.gpus, index=index)
            if self.diagnosis is not None:
                self.diagnose(self.links_under_load())  # right after the copies: the links as trained
            self.before_ok = all(v.ok for v in self.judge(self.before))
            self.record_matrix("P2P bandwidth before", self.before)
        if self.diagnosis is not None:
            self.record_diagnosis()
        return plan

    def links_under_load(self) -> dict[str, dict[str, Any]]:
        """Each in-scope GPU's link read right after a measurement loaded it (one read)."""
        assert self.plan is not None
        names = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
        paths = [f"{pci.DEVICES}/{b}/{n}" for b in self.plan.gpus for n in names]
        try:
            text = _texts(self.conn.call("read_files", paths=paths, reply_timeout=QUICK))
        except Unreachable:
            return {}
        out = {}
        for b in self.plan.gpus:
            link = {n: (text.get(f"{pci.DEVICES}/{b}/{n}") or "").strip() for n in names}
            if link["current_link_speed"] and link["current_link_width"]:
                out[b] = link
        return out

    def diagnose(self, loaded: dict[str, dict[str, Any]] | None = None) -> p2p_causes.Diagnosis:
        """Every cause of slow or broken P2P, judged from step 1's facts (and the links under load)."""
        assert self.plan is not None
        plan, raw = self.plan, self.diag_raw
        smi = {k: v for k, v in p2p_reports.parse_smi_bar1(raw.get("smi_q") or "").items() if ":" in k}
        self.diagnosis = p2p_causes.diagnose(
            self.facts.get("p2p_causes"),
            list(plan.gpus),
            group_types={g.bdf: g.group_type for g in self.gpus() if g.bdf in plan.gpus},
            redirects=plan.redirects,
            p2p_rw=p2p_causes.p2p_rw(raw, self.smi_index() or {}),
            smi_bar1=smi,
            loaded_links=loaded or None,
            overrides=self.opts.expect or None,
            excluded=plan.excluded,
        )
        return self.diagnosis

    def record_diagnosis(self) -> None:
        """The diagnosis table in step 1's evidence, its summary, one note per cause found."""
        d = self.diagnosis
        assert d is not None
        ev = evidence.current()
        ev.state("P2P diagnosis", d.table(), target=self.conn.name)
        ev.note(d.summary())
        for c in d.found:
            ev.note(f"{c.cause} ({c.where}): {c.fact}; fix: {c.fix} [{c.who}]")

    def find_service(self, plan: P2PPlan) -> None:
        """Without --service: the unit holding the in-scope GPUs (or the journal's), said in the evidence."""
        if self._service is not None:
            return
        found = holder.service_of(self.facts.get("gpu_holders"), plan.minors.values(), self.old_journal)
        if found.unit:
            self._service = Service(self.svc_conn, found.unit, where=self.svc_conn.name)
        self.service_origin = found.why
        evidence.current().note(f"service: {found.why}")

    def read_service_env(self) -> service_env.ServiceEnv | None:
        """What the service and its processes set that keeps NCCL off P2P (None: its side did not answer)."""
        if self._service is None:
            return None
        try:
            return service_env.read(self.svc_conn, self.service.unit)
        except Unreachable:
            return None

    def redirect_note(self, low: list[p2p.PairVerdict] | None) -> str:
        """ "; ACS redirect: ..." for the planned redirects among these pairs (all planned ones when None)."""
        assert self.plan is not None
        reds = self.plan.redirects
        if low is not None:
            bad = {frozenset((v.a, v.b)) for v in low}
            reds = [r for r in reds if frozenset((r.a, r.b)) in bad]
        return f"; {redirect_advice(reds)}" if reds else ""

    def measure_conns(self) -> list[Any]:
        """Where P2P can be measured: the host, then the service's container (its CUDA stack)."""
        return [self.conn] if self.svc_conn is self.conn else [self.conn, self.svc_conn]

    def smi_index(self) -> dict[int, str] | None:
        """nvidia-smi index -> PCI address, from the last facts read (None when unknown)."""
        smi = self.facts.get("nvidia_smi_gpus") or {}
        index = {int(row["index"]): bdf for bdf, row in smi.items() if str(row.get("index", "")).isdigit()}
        return index or None

    def judge(self, matrix: p2p.P2PMatrix) -> list[p2p.PairVerdict]:
        """Each in-scope pair's verdict against its threshold."""
        assert self.plan is not None
        return p2p.judge(
            matrix,
            self.plan.links,
            min_gbps=self.opts.min_gbps,
            fraction=self.opts.fraction,
            topo=self.topo,
            model=self.plan.model,
            placed={frozenset((e.a, e.b)): e.gbps for e in self.diagnosis.pairs if e.gbps}
            if self.diagnosis
            else None,
        )

    def record_matrix(self, name: str, matrix: p2p.P2PMatrix) -> None:
        """Put a measured matrix (a heatmap in the report) and how it was measured in the evidence."""
        verdicts = self.judge(matrix)
        thresholds = [v.threshold for v in verdicts if v.threshold is not None]
        ev = evidence.current()
        ev.matrix(
            name,
            matrix.bdfs,
            matrix.rows(),
            unit="GB/s",
            threshold=min(thresholds) if thresholds else None,
            target=self.conn.name,
        )
        where = f" on {matrix.where}" if matrix.where else ""
        what = f"measured with {matrix.source}{where}" if not matrix.no_tool else "not measured"
        ev.note(f"{name}: {what}" + (f"; {matrix.note}" if matrix.note else ""))

    def current_groups(self) -> dict[int, str | None]:
        """IOMMU group -> type, from the last facts read."""
        return {g.iommu_group: g.group_type for g in self.gpus() if g.iommu_group is not None}

    def driver_now(self, bdf: str) -> str | None:
        """The driver `bdf` is bound to right now (one readlink), or None."""
        link = f"{pci.DEVICES}/{bdf}/driver"
        r = self.conn.call("readlink", paths=[link], reply_timeout=QUICK)
        entry = r.get(link) or {}
        target = entry.get("target") if isinstance(entry, dict) else None
        return target.rsplit("/", 1)[-1] if target else None

    def legacy_on(self) -> list[str]:
        """In-scope GPUs with legacy persistence mode on (per the last persistence fact)."""
        assert self.plan is not None
        legacy = (self.facts.get("persistence") or {}).get("legacy") or {}
        return [b for b in self.plan.gpus if str(legacy.get(b, "")).lower() in ("enabled", "1", "on")]

    # ------------------------------------------------------------------ undo

    def rollback(self) -> list[str]:
        """Rebind every in-scope function that has no driver, in the original order; return refusals.

        A function the kernel refuses is reported and the others are still tried; an unreachable
        host raises (the journal on it tells the next run).
        """
        if self.plan is None:
            return []
        errors = []
        for f in self.plan.rebind_order:
            try:
                if self.driver_now(f.bdf):
                    continue
                self.record("rollback-bind", bdf=f.bdf, driver=f.driver)
                pci.bind(self.conn, f.bdf, f.driver, timeout=self.opts.unbind_timeout)
            except pci.PciError as exc:  # this function refused; try the others
                errors.append(str(exc))
        for e in errors:
            evidence.current().note(f"rollback: {e}")
        return errors

    def _undo_rebind(self) -> None:
        errors = self.rollback()
        if errors:
            raise ProcedureError("; ".join(errors))

    def refuse_start_while_blocked(self, unit: str) -> None:
        """Raise when an unbind is pending in the kernel: starting `unit` would hand the GPU to a removal.

        The pending nv_pci_remove completes the moment the GPU's last user lets go, and takes the GPU
        from under whatever was started on it; only a reboot ends it cleanly.
        """
        if self.blocked:
            raise ProcedureError(
                f"not started: {', '.join(self.blocked)} is still pending in the kernel and would take the GPU "
                f"from under {unit} once it lets go: reboot needed"
            )

    def _undo_persistenced(self) -> None:
        if self.stopped_persistenced:
            self.refuse_start_while_blocked(self.persistenced.unit)
            self.persistenced.start()
            self.stopped_persistenced = False
            self.journal.write(persistenced_stopped=False)

    def _undo_service(self) -> None:
        if self.stopped_service and self.has_service:
            self.refuse_start_while_blocked(self.service.unit)
            self.service.start()
            self.stopped_service = False
            self.journal.write(service_stopped=False)

    def push_service_undo(self) -> None:
        """Pending until step 9 starts it: start the service this run (or the one it completes) stopped.

        Skipped when an undo before it failed: the service must not start on GPUs without a driver.
        """
        self.push_undo(
            "start-service",
            f"start {self.service.unit}",
            self._undo_service,
            link=self.svc_conn,
            after_failure=False,
        )

    def push_persistenced_undo(self) -> None:
        """Pending until step 9 starts it: start nvidia-persistenced again."""
        self.push_undo(
            "start-persistenced", f"start {self.persistenced.unit}", self._undo_persistenced, link=self.conn
        )

    def push_rebind_undo(self) -> None:
        """Pending to the end: bind every in-scope function left without a driver (idempotent)."""
        self.push_undo(
            "rebind", "bind in-scope functions left without a driver", self._undo_rebind, link=self.conn
        )

    def unfinished(self) -> list[str]:
        """A write still blocked in the kernel: the journal stays for the next run to complete."""
        if not self.blocked:
            return []
        return [
            f"{', '.join(self.blocked)} is still blocked in the kernel: reboot needed (nothing was started; "
            "the journal stays for the run after the reboot to complete)"
        ]

"""The P2P diagnosis of suites/p2p: every cause checked, in the plan and the evidence, and the safe fixes.

The facts come in step 1's one round trip (`p2p_causes.READS`, kept by `p2p_causes.outputs`): the agent's
`p2p_causes` fact (HOST_FACTS), `nvidia-smi topo -p2p r` and `w`, memory per GPU and
`nvidia-smi -q -d MEMORY` (BAR1 where sysfs does not show it). The judging is
pytest_gpuhost/modules/p2p_causes.py (pure). What this run fixes itself: `uvm_disable_hmm=1` in
a modprobe.d file of its own (step 1, once the lock is held: before the collective that HMM would
hang; journaled, read back, its undo pending until the read-back agrees), which applies when nvidia_uvm is next loaded (the next boot: a reload is not done by the
run). The kernel command line (`pcie_port_pm=off pcie_aspm=off`) is only ever named, with the
reboot it needs; BIOS settings (Resizable BAR) are named with the exact setting. VM (vfio-pci) GPUs
are out of scope and never judged or touched.
"""

from __future__ import annotations

from pytest_gpuhost.modules import p2p_causes, parsers
from pytest_gpuhost.modules.p2p_causes import Diagnosis
from pytest_gpuhost.redact import printable
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError
from pytest_gpuhost.run.remediation import Action

from .procedure import P2PProcedure

__all__ = [
    "diagnosis_actions",
    "make_diagnosis",
    "record_diagnosis",
    "uvm_actions",
    "uvm_problem",
    "write_uvm_conf",
]


def _p2p_rw(run: P2PProcedure) -> dict[tuple[str, str], dict[str, str]]:
    index = run.smi_index() or {}
    out: dict[tuple[str, str], dict[str, str]] = {}
    for mode in ("r", "w"):
        text = run.diag_raw.get(f"topo_{mode}") or ""
        if not text:
            continue
        try:
            topo = parsers.parse_topo_p2p(text)
        except parsers.ParseError:
            continue
        for (ra, rb), status in topo.links.items():
            if not (ra.startswith("GPU") and rb.startswith("GPU")):
                continue
            a, b = index.get(int(ra[3:])), index.get(int(rb[3:]))
            if a and b and a != b:
                key = (a, b) if a < b else (b, a)
                cell = out.setdefault(key, {})
                # a pair counts as its worse direction
                if cell.get(mode) in (None, "OK"):
                    cell[mode] = status
    return out


def _memory(run: P2PProcedure) -> dict[str, int]:
    out = {}
    for line in (run.diag_raw.get("memory") or "").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 2 and cells[1].isdigit():
            out[p2p_causes.norm_bus(cells[0])] = int(cells[1])
    return out


def make_diagnosis(run: P2PProcedure) -> Diagnosis:
    """Judge every cause from the facts read in step 1 (in-scope GPUs only)."""
    assert run.plan is not None
    plan = run.plan
    types = {}
    for g in run.gpus():
        if g.bdf in plan.gpus:
            types[g.bdf] = g.group_type
    smi = {k: v for k, v in p2p_causes.parse_smi_bar1(run.diag_raw.get("smi_q") or "").items() if ":" in k}
    d = p2p_causes.diagnose(
        run.facts.get("p2p_causes"),
        list(plan.gpus),
        group_types=types,
        redirects=plan.redirects,
        p2p_rw=_p2p_rw(run),
        smi_bar1=smi,
        memory_mib=_memory(run),
        overrides=run.opts.expect or None,
        excluded=plan.excluded,
    )
    run.diagnosis = d
    return d


def record_diagnosis(run: P2PProcedure, d: Diagnosis) -> None:
    """The diagnosis table in the evidence, one note per cause found, the summary."""
    ev = evidence.current()
    ev.state("P2P diagnosis", d.table(), target=run.conn.name)
    ev.note(d.summary())
    for c in d.found:
        ev.note(f"{c.cause} ({c.where}): {c.fact}; fix: {c.fix} [{c.who}]")


def uvm_actions(run: P2PProcedure) -> list[Action]:
    """Step 8's write of the modprobe.d file, as its action."""
    return [
        Action(
            "configure nvidia_uvm without HMM (applies when nvidia_uvm is next loaded: the next boot)",
            f"write {p2p_causes.UVM_CONF}: options nvidia_uvm uvm_disable_hmm=1",
            run.conn.name,
            False,
        )
    ]


def diagnosis_actions(run: P2PProcedure, d: Diagnosis) -> list[Action]:
    """What the diagnosis asks for: this run's writes, and what only an operator can do (named)."""
    t = run.conn.name
    acts: list[Action] = uvm_actions(run) if d.uvm_fix else []
    if d.cmdline_add:
        acts.append(
            Action(
                f"kernel command line: add {' '.join(d.cmdline_add)} (PCIe port power management and ASPM off)",
                "none: the boot configuration is the operator's; add them (GRUB_CMDLINE_LINUX in /etc/default/grub, "
                "then update-grub; or /etc/kernel/cmdline, then proxmox-boot-tool refresh) and reboot",
                t,
                False,
            )
        )
    for c in d.found:
        if c.who == p2p_causes.BIOS:
            acts.append(Action(f"{c.cause} on {c.where}: {c.fact}", f"none: {c.fix}", t, False))
    return acts


def uvm_problem(run: P2PProcedure) -> str:
    """Why step 8 is not done for nvidia_uvm ("" when the modprobe.d file is as the diagnosis wants)."""
    d = run.diagnosis
    if d is None or not d.uvm_fix:
        return ""
    text = run.conn.read_files([p2p_causes.UVM_CONF]).get(p2p_causes.UVM_CONF)
    if text == p2p_causes.UVM_CONF_TEXT:
        return ""
    return f"{p2p_causes.UVM_CONF} " + ("missing" if not isinstance(text, str) else "differs")


def write_uvm_conf(run: P2PProcedure) -> None:
    """Write the modprobe.d file once (journaled, previous text kept), read it back; a mismatch puts it back."""
    path = p2p_causes.UVM_CONF
    got = run.conn.read_files([path]).get(path)
    previous = got if isinstance(got, str) else None
    run.record("write-uvm-conf", path=path, previous=previous)
    run.journal.write(uvm_conf={"path": path, "previous": previous, "pending": True})
    run.push_undo("uvm-conf", f"put {path} back as it was", lambda: _put_back(run, previous), link=run.conn)
    w = run.conn.write_file(path, p2p_causes.UVM_CONF_TEXT, timeout=15)
    if not w.ok:
        raise ProcedureError(f"writing {path} failed: {w.error}")
    again = run.conn.read_files([path]).get(path)
    if again != p2p_causes.UVM_CONF_TEXT:
        raise ProcedureError(f"{path} reads back {printable(str(again))[:120]!r}, not what was written")
    run.resolve("uvm-conf")
    run.journal.write(uvm_conf={"path": path, "previous": previous, "pending": False})
    evidence.current().note(
        f"{path} written: options nvidia_uvm uvm_disable_hmm=1; applies when nvidia_uvm is next loaded (the next "
        f"boot). To undo: rm {path}"
    )


def _put_back(run: P2PProcedure, previous: str | None) -> None:
    path = p2p_causes.UVM_CONF
    if previous is None:
        r = run.conn.run(["rm", "-f", "--", path], timeout=15)
        if r.rc != 0:
            raise ProcedureError(f"rm {path} failed (rc {r.rc})")
        return
    w = run.conn.write_file(path, previous, timeout=15)
    if not w.ok:
        raise ProcedureError(f"putting {path} back failed: {w.error}")

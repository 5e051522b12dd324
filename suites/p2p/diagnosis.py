"""What suites/p2p does about the causes its diagnosis found: this run's one fix, and the rest named.

The diagnosis itself is made in step 1 (`P2PProcedure.diagnose`, judged by
pytest_gpuhost/modules/p2p_causes.py from the facts of step 1's round trip). What this run fixes:
`uvm_disable_hmm=1` in a modprobe.d file of its own, written with the plan once the lock is held
(before the collective that HMM would hang), journaled, read back, its undo pending until the
read-back agrees; it applies when nvidia_uvm is next loaded (the next boot: the run does not
reload the module). The kernel command line (`pcie_port_pm=off pcie_aspm=off`) is only named,
with the reboot it needs; BIOS settings (Resizable BAR) are named with the exact setting. VM
(vfio-pci) GPUs are out of scope and never judged or touched.
"""

from __future__ import annotations

from pytest_gpuhost.modules import p2p_causes
from pytest_gpuhost.modules.p2p_causes import Diagnosis
from pytest_gpuhost.redact import printable
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError
from pytest_gpuhost.run.remediation import Action

from .procedure import P2PProcedure

__all__ = [
    "diagnosis_actions",
    "uvm_actions",
    "uvm_problem",
    "write_uvm_conf",
]


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

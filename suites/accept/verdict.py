"""The acceptance's answer in words: "ACCEPT" or "REJECT: <every promise the node does not keep>".

Said through the run's answer machinery (`evidence.current().answer`, report/answer.py): the
terminal's last lines, the banner atop the HTML report, and the answer JSON; the table under
the banner is each item promised vs found, and the same items go to the evidence JSON
(`--accept-evidence`) a renter can send the provider.
"""

from __future__ import annotations

from pathlib import Path

from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.remediation import Check, Remediation
from pytest_gpuhost.run.suite import Observation

from .procedure import AcceptProcedure

__all__ = ["reasons", "step_verdict", "verdict_line"]


def reasons(proc: AcceptProcedure) -> list[str]:
    """Why the node is not accepted, one line each: each broken promise, then each step that failed unseen."""
    out = [f"{i.item}: promised {i.promised}, found {i.found}" for i in proc.failed_items()]
    steps_with_items = {i.step for i in proc.items}
    for step, outcome in proc.outcomes.items():
        if outcome in ("failed", "cannot see") and (step not in steps_with_items or outcome == "cannot see"):
            out.append(f"{step}: {outcome}: {proc.summaries.get(step, 'see the report')}")
    return out


def verdict_line(proc: AcceptProcedure) -> str:
    """ "ACCEPT" or "REJECT: a; b; c" (the headline of the answer)."""
    why = reasons(proc)
    return "REJECT: " + "; ".join(why) if why else "ACCEPT"


def step_verdict(proc: AcceptProcedure) -> Remediation:
    """The answer: every step passed (or did not apply) and every promise holds."""

    def check() -> Check:
        line = verdict_line(proc)
        ok = line == "ACCEPT"
        table = [["item", "promised", "found", "holds"]] + [
            [i.item, i.promised, i.found, "yes" if i.ok else "NO"] for i in proc.items
        ]
        details = reasons(proc) or [f"{len(proc.items)} promises kept"]
        details += proc.notes
        evidence.current().answer(proc.name, ok, line, details, table)
        path = proc.write_evidence(Path(proc.root), line)
        evidence.current().note(f"promised vs found: {path}")
        return Check(ok, line, {"evidence": str(path)})

    return Observation("verdict", check)

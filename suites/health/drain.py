"""`--fix=drain`: drain a failed host in Slurm, resume one gpuhost drained once it is healthy again.

The controller path's twin of `gpuhost-nodecheck --slurm-drain`, with the same rules
(modules/slurm.py): drain with the reason `gpuhost: CHECK: VALUE`, resume only a node whose
reason starts with `gpuhost:`, never touch a node drained by a person. `scontrol` runs on the
target over its connection (the node's own slurm.conf says where slurmctld is), as a remediation:

- check: this run's verdicts of the host (every health check, judged from the facts the checks
  used, after any --fix=persistence / --fix=service repair) and `scontrol show node NAME`;
  ok when the node's drain state already matches its health (or a person's drain is left alone);
- plan: the one scontrol command (`State=DRAIN Reason=...` or `State=RESUME`);
- act: read the node again just before, and act only if the plan still holds;
- re-check: read the node again: drained with this reason, or no longer drained.

The Slurm node name is the inventory variable `slurm_node_name`, else the host name the target's
agent reports (what Slurm's NodeHostname is by default).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules import slurm
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.remediation import Action, Check

__all__ = ["SCONTROL_TIMEOUT", "first_failure", "node_name", "remediation", "reset_note", "return_node"]

SCONTROL_TIMEOUT = 15.0
SERVICE_UP_TIMEOUT = 60.0  # after a recovery, for a restarted inference server's /health to answer


def node_name(hh: Any) -> str:
    """Return the target's Slurm node name: inventory `slurm_node_name`, else the agent's host name."""
    explicit = (hh.target.vars or {}).get("slurm_node_name")
    if explicit:
        return slurm.check_node(str(explicit))
    hello = getattr(hh.target.conn, "hello", None) or {}
    return slurm.check_node(str(hello.get("hostname") or hh.name))


def failures(hh: Any) -> list[str]:
    """Return `CHECK: VALUE` for every health check of the host that fails now."""
    facts = hh.gather()
    out = []
    for check in hm.CHECKS:
        v = hm.evaluate(check, facts, hh.thresholds)
        if v.reread:  # a measurement inside its noise band: the suite's re-read decides
            v = hh.verdict(check)
        if not v.ok and v.skip is None:
            out.append(f"{check}: {v.reasons[0] if v.reasons else v.summary}")
    return out


def first_failure(hh: Any) -> str | None:
    """Return the failure the drain reason names (the first in check order), None when healthy."""
    got = failures(hh)
    return got[0] if got else None


def remediation(hh: Any, on_check: Callable[[Check], None] | None = None) -> dict[str, Any]:
    """Return the drain remediation of one host, as `remediate(**...)` takes it.

    `on_check` receives the first check (the test records it as the step's verdict).
    """
    conn = hh.target.conn
    name = node_name(hh)
    state: dict[str, Any] = {}

    def read() -> tuple[slurm.NodeState, slurm.Plan]:
        node = slurm.read_node(conn, name, timeout=SCONTROL_TIMEOUT)
        return node, slurm.plan(node, state["failure"])

    def check() -> Check:
        got = failures(hh)
        state["failures"] = got
        state["failure"] = got[0] if got else None
        try:
            node, p = read()
        except GpuhostError as exc:
            return Check(ok=False, summary=f"cannot read the Slurm node {name}: {exc}", state={"node": name})
        state["plan"] = p
        shown = {"node": node.describe(), "healthy": not got, "failures": got[:10], "decision": p.why}
        first = Check(ok=not p.changes, summary=p.why, state=shown)
        if on_check is not None:
            on_check(first)
        return first

    def plan(before: Check) -> list[Action]:
        p = state.get("plan")
        if p is None or not p.changes:
            return []
        return [Action(p.why, shlex.join(p.argv), destructive=p.action == "drain")]

    def fix(actions: list[Action], before: Check) -> None:
        node, p = read()  # a person may have drained it since the check: their drain wins
        if p.argv != state["plan"].argv:
            raise slurm.SlurmError(f"{node.describe()} changed since the check; now: {p.why}; nothing done")
        evidence.current().note(f"slurm: {p.why}")
        slurm.act(conn, p, timeout=SCONTROL_TIMEOUT)
        if p.action == "drain":
            hh.drained_here = p.why  # the reset step may resume it once the GPU is recovered

    def verify() -> Check:
        node, p = read()
        done = (node.drained and node.ours) if state["failure"] else not (node.drained and node.ours)
        return Check(
            ok=done and not p.changes, summary=f"now {node.describe()}", state={"node": node.describe()}
        )

    return {"name": "drain", "check": check, "plan": plan, "fix": fix, "verify": verify}


def reset_note(hh: Any) -> str:
    """Say whether the node stays drained: a drain this run made is left for the next run to lift."""
    if "drain" not in hh.fixes:
        return "node not drained (--fix=drain drains it)"
    try:
        node = slurm.read_node(hh.target.conn, node_name(hh), timeout=SCONTROL_TIMEOUT)
    except GpuhostError as exc:
        return f"the Slurm node could not be read ({exc})"
    if node.drained and node.ours:
        return f"node left drained ({node.reason!r})"
    return f"node not drained by gpuhost ({node.describe()})"


def return_node(hh: Any, fresh: bool = False) -> tuple[bool, str]:
    """After a confirmed recovery: resume the Slurm node if this run drained it and it is healthy.

    Return (ok, a line for the verdict). Only a drain this run made is lifted (`drained_here`,
    set by the drain step), and only when every health check passes on the facts read after the
    recovery; a person's drain, or an earlier run's, is left (the drain step of the next run
    resumes gpuhost's own once healthy). ok is False only when the resume itself failed.
    `fresh`: the caller read every fact after the recovery (a reboot's re-check), so the first
    judgement uses them rather than reading them all again.
    """
    if "drain" not in hh.fixes:
        return True, ""
    conn = hh.target.conn
    name = node_name(hh)
    try:
        node = slurm.read_node(conn, name, timeout=SCONTROL_TIMEOUT)
    except GpuhostError as exc:
        return False, f"the Slurm node could not be read ({exc})"
    if not node.drained:
        return True, f"Slurm node {node.describe()}"
    if not node.ours:
        return True, f"node drained by someone else ({node.reason!r}): left drained"
    if hh.drained_here is None:
        return (
            True,
            f"node left drained ({node.reason!r}): an earlier run drained it; the next run resumes it once healthy",
        )
    line = hh.wait_commit()  # this run's kernel-log cursor on disk before the facts are read again
    if line:
        evidence.current().note(line)
    deadline = time.monotonic() + SERVICE_UP_TIMEOUT
    while True:
        if not fresh:
            hh.facts = None  # every fact again, after the recovery: the resume is judged on all of them
            hh.samples.clear()
        fresh = False
        hh.verdicts.clear()
        still = failures(hh)
        # a service the recovery started again may still be loading: its /health is waited for
        if (
            not all(f.startswith("service_health:") for f in still)
            or not still
            or time.monotonic() > deadline
        ):
            break
        time.sleep(2)
    if still:
        return True, f"node left drained ({node.reason!r}): still failing: {still[0]}"
    p = slurm.plan(node, None)
    try:
        slurm.act(conn, p, timeout=SCONTROL_TIMEOUT)
        after = slurm.read_node(conn, name, timeout=SCONTROL_TIMEOUT)
    except GpuhostError as exc:
        return False, f"the GPU is recovered but {p.why} failed: {exc}"
    evidence.current().note(f"slurm: {p.why}")
    if after.drained:
        return (
            False,
            f"the GPU is recovered but the node is still drained after {shlex.join(p.argv)}: {after.describe()}",
        )
    hh.drained_here = None
    return True, f"node resumed (this run drained it): now {after.describe()}"

"""The node health check: a fast, check-only subset of suites/health on one node, within a budget.

What `gpuhost-nodecheck` (pytest_gpuhost/nodecheck.py) runs as Slurm's HealthCheckProgram, Prolog
or Epilog (docs/nodecheck.md). The facts are the health suite's (the agent's `health`,
`health_kernel_log` and `health_pci` facts, exec/agent/probe_health*.py) and so are the verdicts
(modules/health/checks.evaluate); nothing is re-implemented here. What differs is time:

- the whole check has a budget (default 10 s) that ends it whatever a probe does: each fact is
  asked for on a connection of its own, in a thread, with the reply bounded by the time left (a
  reply that does not come stops that agent: exec/agent_session.py); a fact still out at the
  deadline leaves its checks *unfinished*, named, and the overrun is a failure of its own;
- every command a probe runs has a timeout of a third of the facts' share of the budget, since
  the longest chain in the `health` fact is three nvidia-smi starts one after another
  (`--query-gpu`, the header, `-q` on NVSwitch models);
- no re-reads of a value inside its noise band (the nightly suite re-reads; here the one reading
  is judged as it is);
- the kernel-log cursor and what the node owes (Xid resets and reboots) are kept in a state file
  of their own, `nodecheck-state.json`, beside the nightly suite's `health-state.json`: a check
  every few minutes must not move the nightly run's cursor, and an Xid asking for a reboot keeps
  failing here until the boot id changes, as it does in the suite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import facts as health_facts

__all__ = [
    "NIGHTLY_ONLY",
    "STATE_FILE",
    "NodeResult",
    "default_checks",
    "parts_for",
    "run_checks",
]

STATE_FILE = "nodecheck-state.json"
#: Checks left to the nightly suite (declared `nightly_only`): boot-time configuration (IOMMU,
#: ACS, CUDA version), the P2P matrix, the inference service (not on batch nodes), and the opt-in
#: active diagnostics.
NIGHTLY_ONLY = frozenset(c.name for c in hm.DECLARED if c.nightly_only)
#: The facts parts a node check never reads (their checks are nightly-only).
_SKIPPED_PARTS = frozenset({"p2p", "services", "diag"})
COMMIT_TIMEOUT = 1.0


def default_checks() -> list[str]:
    """Return the checks a node check runs by default: every health check but the nightly-only."""
    return [c for c in hm.CHECKS if c not in NIGHTLY_ONLY]


#: Checks that read the kernel log part (the Xid/SXid lines, and the last run's counters kept
#: with the cursor); without one of them the kernel log is not read at all.
KERNEL_LOG_CHECKS = frozenset(c.name for c in hm.DECLARED if "kernel_log" in (*c.reads, *c.also_reads))
#: The check whose verdict moves the cursor: a run without it leaves the Xid lines for a later run.
COMMIT_CHECK = "xid"


def parts_for(checks: Sequence[str]) -> list[str]:
    """Return the facts parts to read: every cheap part, the kernel log only when a check reads it.

    The verdicts read parts freely (gpu_count the PCI bus, memory_temperature the fabric's -q, ...),
    so every part but the nightly-only ones is read; the kernel log only for the checks that judge it.
    """
    skip = set(_SKIPPED_PARTS)
    if not KERNEL_LOG_CHECKS & set(checks):
        skip.add("kernel_log")
    return [p for p in health_facts.PARTS if p not in skip]


@dataclass
class NodeResult:
    """The outcome of one node check."""

    checks: list[str]
    verdicts: dict[str, hm.Verdict] = field(default_factory=dict)
    unfinished: dict[str, str] = field(default_factory=dict)  # check -> fact still out at the deadline
    errors: dict[str, str] = field(default_factory=dict)  # fact -> one-line error
    budget: float = 10.0
    elapsed: float = 0.0
    committed: str | None = None
    live: Any = None  # a connection whose fact came back (alive, for the commands after the checks)

    def failures(self) -> list[tuple[str, str]]:
        """Return (check, value) for every failure: failed verdicts first, then unfinished checks."""
        out: list[tuple[str, str]] = []
        for check in self.checks:
            v = self.verdicts.get(check)
            if v is not None and not v.ok and v.skip is None:
                out.append((check, v.reasons[0] if v.reasons else v.summary))
        for check, fact in self.unfinished.items():
            out.append((check, f"did not finish within the {self.budget:g} s budget ({fact})"))
        if self.unfinished:
            names = ", ".join(self.unfinished)
            out.append(("budget", f"{names} did not finish within {self.budget:g} s"))
        return out

    @property
    def healthy(self) -> bool:
        return not self.failures()


def _fact_checks(checks: Sequence[str]) -> dict[str, list[str]]:
    """Map each fact to the checks that cannot be judged without it."""
    out: dict[str, list[str]] = {}
    for c in checks:
        for p in hm.declared(c).reads:
            out.setdefault(health_facts.FACT_OF_PART.get(p, "health"), []).append(c)
    return out


def _missing_parts(v: hm.Verdict, missing: Sequence[str]) -> bool:
    """Whether a verdict says it lacked one of the `missing` parts (merge leaves them out)."""
    text = " ".join([v.summary, *v.reasons])
    return any(f"{p}: not gathered" in text for p in missing)


def run_checks(
    open_conn: Callable[[], Any],
    checks: Sequence[str],
    thresholds: hm.Thresholds,
    deadline: float,
    budget: float,
    *,
    commit: bool = True,
    on_conn: Callable[[Any], None] | None = None,
) -> NodeResult:
    """Gather the facts (one connection per fact, in parallel) and judge `checks` by `deadline`.

    `deadline` is a time.monotonic() value; `open_conn()` opens a new connection to the node;
    `on_conn` receives each one (the caller closes them). Returns when every fact is in, or at the
    deadline with the facts still out named.
    """
    result = NodeResult(checks=list(checks), budget=budget)
    t0 = time.monotonic()
    # each fact on a connection of its own, in parallel: NVML's answer could not reach `health`
    names = [n for n in health_facts.fact_names(parts_for(checks)) if n != health_facts.NVML_FACT]
    per_command = max(0.2, (deadline - t0 - COMMIT_TIMEOUT) / 3.0)
    params: dict[str, Any] = dict(hm.probe_params(thresholds))
    params["timeout"] = min(float(thresholds["probe_timeout"]), per_command)
    params["parts"] = parts_for(checks)
    replies: dict[str, Any] = {}
    conns: dict[str, Any] = {}
    lock = threading.Lock()

    def gather(name: str) -> None:
        try:
            conn = open_conn()
            with lock:
                conns[name] = conn
            if on_conn is not None:
                on_conn(conn)
            p = dict(params)
            if name == "health_kernel_log":
                # the agent's state directory, from its hello (open_connection started it)
                state_dir = str((getattr(conn, "hello", None) or {}).get("state_dir") or "/var/lib/gpuhost")
                p["state_path"] = f"{state_dir.rstrip('/')}/{STATE_FILE}"
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no time left")
            reply = conn.call("facts", names=[name], params=p, reply_timeout=left)
            with lock:
                replies[name] = (reply or {}).get(name, {"error": f"{name}: missing from the reply"})
        except (GpuhostError, OSError) as exc:
            with lock:
                result.errors[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]

    threads = {
        n: threading.Thread(target=gather, args=(n,), name=f"nodecheck-{n}", daemon=True) for n in names
    }
    for t in threads.values():
        t.start()
    for t in threads.values():
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        got = dict(replies)
        errors = dict(result.errors)
    fact_checks = _fact_checks(checks)
    for c in checks:  # in check order
        for name in names:
            if name not in got and c in fact_checks.get(name, []):
                result.unfinished.setdefault(c, f"{name}: {errors.get(name) or 'no reply yet'}")
    facts = health_facts.merge(got) if "health" in got else _merge_without_health(got)
    missing = [p for p, f in health_facts.FACT_OF_PART.items() if f in names and f not in got]
    for c in checks:
        if c in result.unfinished:
            continue
        v = hm.evaluate(c, facts, thresholds)
        v.reread = None  # one reading, judged as it is
        if missing and _missing_parts(v, missing):
            result.unfinished[c] = "facts out: " + ", ".join(f for f in names if f not in got)
            continue
        result.verdicts[c] = v
    with lock:
        answered = [conns[n] for n in ("health_kernel_log", *names) if n in got and n in conns]
    result.live = answered[0] if answered else None
    if commit and COMMIT_CHECK in result.verdicts and "health_kernel_log" in conns:
        result.committed = _commit(conns["health_kernel_log"], facts, thresholds, deadline)
    result.elapsed = time.monotonic() - t0
    return result


def _merge_without_health(got: Mapping[str, Any]) -> dict[str, Any]:
    return health_facts.merge({"health": {"commands": []}, **got})


def _commit(conn: Any, facts: Mapping[str, Any], thresholds: hm.Thresholds, deadline: float) -> str:
    """Record the kernel-log cursor and what the node owes in nodecheck-state.json (bounded)."""
    state = health_facts.commit_state(facts, thresholds["xid_ignore"])
    if state is None:
        return "nothing to commit (kernel log unread)"
    left = min(COMMIT_TIMEOUT, deadline - time.monotonic())
    if left <= 0.05:
        return "kernel log cursor NOT committed: no time left in the budget"
    path = (facts.get("kernel_log") or {}).get("state_path")
    try:
        conn.call("health_commit", state=state, state_path=path, timeout=left, reply_timeout=left)
    except GpuhostError as exc:
        return f"kernel log cursor NOT committed: {exc}"
    return "kernel log cursor committed"

"""Step 7 of suites/p2p: the NCCL collective proves P2P on the in-scope GPUs (or says why not).

Both arms run through pytest_gpuhost/modules/nccl_run.py (bounded on the target, nothing left
behind): nccl-tests' all_reduce_perf on the host or in the service's container, else the torch
program with the service's own Python (the interpreters read at step 1, before the stop, in its
container), else ``python3`` on either's PATH. The verdict is pytest_gpuhost/modules/nccl.py.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.modules import nccl, p2p_reports
from pytest_gpuhost.modules.nccl_run import ARGS, NO_TOOL, TOOL, TORCH, find_tool, run_both, side
from pytest_gpuhost.modules.service_env import ServiceEnv
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from .procedure import P2PProcedure
from .service_env import (
    env_actions,
    env_note,
    env_state,
    service_env_now,
    unset_env,
    wants_unset,
)

__all__ = ["nccl_diagnostics", "service_pythons", "step_p2p_collective"]


def service_pythons(run: P2PProcedure) -> list[tuple[Any, str, str]]:
    """The service's Python interpreters as step 1 read them, on the service's side (its container)."""
    env = run.service_env
    if env is None:
        return []
    return [(run.svc_conn, path, f"the service's Python ({where})") for path, where in env.pythons]


def nccl_diagnostics(arm: nccl.Arm) -> str:
    """NCCL's own P2P check of the P2P arm (NCCL_RUN_DIAGNOSTICS=1), failing pairs named by PCI address.

    Informational, as NCCL makes it: it does not fail the step (the collective's own verdict does).
    A pair named by CUDA device or rank is mapped to the arm's GPUs: one process, `-g N`, so
    rank i is the i-th GPU of CUDA_VISIBLE_DEVICES (PCI order).
    """
    d = p2p_reports.parse_nccl_diag("\n".join(arm.diag))
    gpus = list(arm.gpus)

    def name(x: str) -> str:
        kind, _, n = x.partition(" ")
        if kind in ("rank", "GPU") and n.isdigit() and int(n) < len(gpus):
            return f"{gpus[int(n)]} ({x})"
        return x

    d.pairs = [(name(a), name(b)) for a, b in d.pairs]
    version = arm.result.nccl_version or "unknown"
    if not d.present:
        return f"NCCL diagnostics: no report (NCCL {version}; the report needs NCCL 2.31 or later)"
    return d.describe()


def step_p2p_collective(run: P2PProcedure) -> Step:
    """Step 7: all_reduce_perf on the in-scope GPUs completes in bound, via P2P, 0 wrong, faster than without P2P."""
    proven: list[Check] = []  # the collective's own verdict, kept for the re-check after the drop-in

    def judged(env: ServiceEnv | None, base: Check) -> Check:
        note = env_note(run, env)
        state = dict(base.state or {}) | {"service_env": env_state(run, env)}
        summary = base.summary + (f"; {note}" if note else "")
        names = wants_unset(run, env)
        if names:
            state["unset"] = names
            return Check(False, summary, state)
        return Check(base.ok, summary, state, skip=base.skip)

    def check() -> Check:
        assert run.plan is not None
        gpus = sorted(run.plan.gpus)
        if len(gpus) < 2:
            return Check(
                True, "fewer than two GPUs in scope", skip="fewer than two GPUs in scope: no collective"
            )
        env = service_env_now(run)
        ev = evidence.current()
        note = env_note(run, env)
        if note:
            ev.note(note)
        tool, looked = find_tool(run.measure_conns(), service_pythons(run))
        if tool is None:
            why = f"not checked: no NCCL tool ({NO_TOOL}): {'; '.join(looked)}"
            base = Check(True, why, {"looked": looked}, skip=why)
        else:
            ev.note(f"collective run with {tool.describe()}")
            first, control = run_both(tool, gpus, run.opts.nccl_timeout)
            for arm in (first, control):
                ev.state(arm.name, side(arm), target=tool.conn.name)
            run.collective = (first, control)
            v = nccl.verdict(first, control)
            diag = nccl_diagnostics(first)
            state: dict[str, Any] = {
                "tool": tool.describe(),
                "arms": [first.to_dict(), control.to_dict()],
                "margin": nccl.P2P_OVER_CONTROL,
                "verdict": v.summary,
                "nccl_diagnostics": diag,
            }
            ev.note(diag)
            base = Check(v.ok, v.summary + ("; " + diag if "failing" in diag else ""), state)
        proven[:] = [base]
        return judged(env, base)

    def verify() -> Check:
        return judged(service_env_now(run), proven[0]) if proven else check()

    def plan(before: Check) -> list[Action]:
        assert run.plan is not None
        acts = []
        if run.check_only and run.plan.needs_repair:
            acts.append(
                Action(
                    "run the collective again after steps 2-5 set the groups to identity",
                    f"{TOOL} {' '.join(ARGS)} -g {len(run.plan.gpus)} (with NCCL_P2P_DISABLE=0, then =1; "
                    f"without nccl-tests, the same through {TORCH})",
                    run.conn.name,
                    False,
                )
            )
        env = service_env_now(run) if (before.state or {}).get("unset") else None
        if env is not None and env.names_to_unset():
            acts += env_actions(run, env)
        return acts

    def fix(actions: list[Action], before: Check) -> None:
        base = proven[0] if proven else before
        names = (before.state or {}).get("unset") or []
        if not base.ok or base.skip:
            left = (
                f"; {' '.join(names)} left set in {run.service.unit}: unset only once the collective proves P2P"
                if names
                else ""
            )
            # a hang or a failure with ACS redirect on the path is the #902 case: the copies
            # pass through the root complex while the collectives do not (docs/FACTS.md)
            acs_why = run.redirect_note(None) if base.skip is None else ""
            raise ProcedureError(
                "the NCCL collective does not prove P2P with every in-scope group in identity mode: "
                + base.summary
                + left
                + acs_why
            )
        env = service_env_now(run)
        if env is not None and env.names_to_unset():
            unset_env(run, env)

    return run.step("p2p collective", check, plan, fix, verify)

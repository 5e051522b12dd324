"""Step 7 of suites/p2p: the NCCL collective proves P2P on the in-scope GPUs (or says why not).

Both arms run through pytest_gpuhost/modules/nccl_run.py (bounded on the target, nothing left
behind); the verdict is pytest_gpuhost/modules/nccl.py.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.modules import nccl
from pytest_gpuhost.modules.nccl_run import ARGS, TOOL, find_tool, run_both, side
from pytest_gpuhost.modules.service_env import ServiceEnv
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from .service_env import ServiceEnvSteps

__all__ = ["CollectiveSteps"]


class CollectiveSteps(ServiceEnvSteps):
    """Step 7: the NCCL collective proves P2P (or says why not); the service's own settings with it."""

    def step_p2p_collective(self) -> Step:
        """Step 7: all_reduce_perf on the in-scope GPUs completes in bound, via P2P, 0 wrong, faster than without P2P."""
        proven: list[Check] = []  # the collective's own verdict, kept for the re-check after the drop-in

        def judged(env: ServiceEnv | None, base: Check) -> Check:
            note = self.env_note(env)
            state = dict(base.state or {}) | {"service_env": self.env_state(env)}
            summary = base.summary + (f"; {note}" if note else "")
            names = self.wants_unset(env)
            if names:
                state["unset"] = names
                return Check(False, summary, state)
            return Check(base.ok, summary, state, skip=base.skip)

        def check() -> Check:
            assert self.plan is not None
            gpus = sorted(self.plan.gpus)
            if len(gpus) < 2:
                return Check(
                    True, "fewer than two GPUs in scope", skip="fewer than two GPUs in scope: no collective"
                )
            env = self.service_env_now()
            ev = evidence.current()
            note = self.env_note(env)
            if note:
                ev.note(note)
            conn, looked = find_tool(self.measure_conns())
            if conn is None:
                why = f"not checked: no NCCL tool (install nccl-tests: {TOOL} on PATH) on {' nor on '.join(looked)}"
                base = Check(True, why, {"looked": looked}, skip=why)
            else:
                first, control = run_both(conn, gpus, self.opts.nccl_timeout)
                for arm in (first, control):
                    ev.state(arm.name, side(arm), target=conn.name)
                v = nccl.verdict(first, control)
                state: dict[str, Any] = {
                    "arms": [first.to_dict(), control.to_dict()],
                    "margin": nccl.P2P_OVER_CONTROL,
                    "verdict": v.summary,
                }
                base = Check(v.ok, v.summary, state)
            proven[:] = [base]
            return judged(env, base)

        def verify() -> Check:
            return judged(self.service_env_now(), proven[0]) if proven else check()

        def plan(before: Check) -> list[Action]:
            assert self.plan is not None
            acts = []
            if self.check_only and self.plan.needs_repair:
                acts.append(
                    Action(
                        "run the collective again after steps 2-5 set the groups to identity",
                        f"{TOOL} {' '.join(ARGS)} -g {len(self.plan.gpus)} (with NCCL_P2P_DISABLE=0, then =1)",
                        self.conn.name,
                        False,
                    )
                )
            env = self.service_env_now() if (before.state or {}).get("unset") else None
            if env is not None and env.names_to_unset():
                acts += self.env_actions(env)
            return acts

        def fix(actions: list[Action], before: Check) -> None:
            base = proven[0] if proven else before
            names = (before.state or {}).get("unset") or []
            if not base.ok or base.skip:
                left = (
                    f"; {' '.join(names)} left set in {self.service.unit}: unset only once the collective proves P2P"
                    if names
                    else ""
                )
                # a hang or a failure with ACS redirect on the path is the #902 case: the copies
                # pass through the root complex while the collectives do not (docs/FACTS.md)
                acs_why = self.redirect_note(None) if base.skip is None else ""
                raise ProcedureError(
                    "the NCCL collective does not prove P2P with every in-scope group in identity mode: "
                    + base.summary
                    + left
                    + acs_why
                )
            env = self.service_env_now()
            if env is not None and env.names_to_unset():
                self.unset_env(env)

        return self.step("p2p collective", check, plan, fix, verify)

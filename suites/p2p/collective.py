"""Step 7 of suites/p2p: the NCCL collective proves P2P on the in-scope GPUs (or says why not).

Both arms run through pytest_gpuhost/modules/nccl_run.py (bounded on the target, nothing left
behind); the verdict is pytest_gpuhost/modules/nccl.py.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.errors import Unreachable
from pytest_gpuhost.modules import nccl
from pytest_gpuhost.modules.nccl_run import ARGS, TOOL, find_tool, run_both, side
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from .state import P2PState

__all__ = ["CollectiveSteps"]


class CollectiveSteps(P2PState):
    """Step 7: the NCCL collective proves P2P (or says why not)."""

    def service_env_findings(self) -> list[str]:
        """What the service's own ``Environment=`` sets that keeps NCCL off P2P (report only)."""
        try:
            r = self.svc_conn.run(["systemctl", "show", "-p", "Environment", self.service.unit], timeout=15)
        except Unreachable:
            return []
        if r.rc != 0:
            return []
        return nccl.env_findings(nccl.parse_unit_environment(r.stdout))

    def collective_note(self, findings: list[str]) -> str:
        """The sentence for a service that turns P2P off itself."""
        p2p_off = [f for f in findings if not f.startswith("NCCL_SHM_DISABLE")]
        if not p2p_off:
            return f"{self.service.unit} sets {'; '.join(findings)} in its Environment="
        return (
            f"the service disables P2P itself ({'; '.join(findings)} in the Environment= of "
            f"{self.service.unit}); after the repair it would still use SHM"
        )

    def step_p2p_collective(self) -> Step:
        """Step 7: all_reduce_perf on the in-scope GPUs completes in bound, via P2P, 0 wrong, faster than without P2P."""

        def check() -> Check:
            assert self.plan is not None
            gpus = sorted(self.plan.gpus)
            if len(gpus) < 2:
                return Check(
                    True, "fewer than two GPUs in scope", skip="fewer than two GPUs in scope: no collective"
                )
            findings = self.service_env_findings()
            ev = evidence.current()
            note = self.collective_note(findings) if findings else ""
            if note:
                ev.note(note)
            conn, looked = find_tool(self.measure_conns())
            if conn is None:
                why = f"not checked: no NCCL tool (install nccl-tests: {TOOL} on PATH) on {' nor on '.join(looked)}"
                return Check(True, why, {"looked": looked, "service_env": findings}, skip=why)
            first, control = run_both(conn, gpus, self.opts.nccl_timeout)
            for arm in (first, control):
                ev.state(arm.name, side(arm), target=conn.name)
            v = nccl.verdict(first, control)
            state: dict[str, Any] = {
                "arms": [first.to_dict(), control.to_dict()],
                "margin": nccl.P2P_OVER_CONTROL,
                "verdict": v.summary,
                "service_env": findings,
            }
            summary = v.summary + (f"; {note}" if note else "")
            return Check(v.ok, summary, state)

        def plan(before: Check) -> list[Action]:
            assert self.plan is not None
            if self.check_only and self.plan.needs_repair:
                return [
                    Action(
                        "run the collective again after steps 2-5 set the groups to identity",
                        f"{TOOL} {' '.join(ARGS)} -g {len(self.plan.gpus)} (with NCCL_P2P_DISABLE=0, then =1)",
                        self.conn.name,
                        False,
                    )
                ]
            return []

        def fix(actions: list[Action], before: Check) -> None:
            raise ProcedureError(
                "the NCCL collective does not prove P2P with every in-scope group in identity mode: "
                + before.summary
            )

        return self.step("p2p collective", check, plan, fix)

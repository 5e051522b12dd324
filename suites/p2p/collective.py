"""Running the NCCL collective check on the target: both arms of all_reduce_perf, each bounded there.

The parsing and the verdict are pytest_gpuhost/modules/nccl.py; this module only runs. Each arm
runs as ``timeout -k 5 BOUND all_reduce_perf ...`` on the target, so a hung collective is ended
there (SIGTERM at the bound, SIGKILL 5 s later) even when the link to it is lost; the arm carries a
marker in its environment (``GPUHOST_NCCL_RUN``), and afterwards every ``all_reduce_perf`` whose
environment holds the marker is listed and killed: nothing of ours stays on the GPUs. The GPUs
are given as CUDA ordinals in PCI order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``), counted among the GPUs
that machine's nvidia-smi lists (a container numbers only the GPUs passed to it).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pytest_gpuhost.errors import Unreachable
from pytest_gpuhost.modules import nccl, p2p
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from .state import P2PState

__all__ = ["ARGS", "TOOL", "CollectiveSteps", "find_tool", "run_arm", "run_both"]

TOOL = "all_reduce_perf"
# one process, every in-scope GPU (-g N); 8 MiB to 128 MiB, where a PCIe ring reaches its bus
# bandwidth; -c 1 checks every result (the #wrong column); 5 warm-up and 20 timed iterations
ARGS = ("-b", "8M", "-e", "128M", "-f", "2", "-c", "1", "-w", "5", "-n", "20")
KILL_AFTER = 5  # seconds between timeout's SIGTERM and its SIGKILL
MARK = "GPUHOST_NCCL_RUN"
# the pids of all_reduce_perf processes whose environment holds MARK=$1 (an argument, never spliced)
_OURS = (
    'for p in $(pgrep -x all_reduce_perf); do tr "\\0" "\\n" < /proc/$p/environ 2>/dev/null'
    ' | grep -qxF "GPUHOST_NCCL_RUN=$1" && echo "$p"; done; true'
)


def find_tool(conns: list[Any]) -> tuple[Any | None, list[str]]:
    """The first connection with all_reduce_perf on PATH, and where it was looked for."""
    looked = []
    for conn in conns:
        try:
            r = conn.run(["sh", "-c", 'command -v "$1"', "sh", TOOL], timeout=15)
        except Unreachable as exc:
            looked.append(f"{conn.name} (unreachable: {str(exc)[:80]})")
            continue
        if r.rc == 0 and r.stdout.strip():
            return conn, looked
        looked.append(conn.name)
    return None, looked


def cuda_order(conn: Any) -> list[str]:
    """PCI addresses of the GPUs this machine's nvidia-smi lists, in PCI order (CUDA's with PCI_BUS_ID)."""
    r = conn.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], timeout=30)
    if r.rc != 0:
        return []
    return sorted(p2p.norm_bdf(line) for line in r.stdout.splitlines() if line.strip())


def leftovers(conn: Any, token: str) -> list[int]:
    """Pids of all_reduce_perf processes of this arm still on the target."""
    r = conn.run(["sh", "-c", _OURS, "sh", token], timeout=15)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def run_arm(conn: Any, name: str, gpus: list[str], extra_env: dict[str, str], bound: float) -> nccl.Arm:
    """Run one arm on ``gpus`` (PCI addresses) within ``bound`` seconds on the target."""
    gpus = sorted(gpus)
    order = cuda_order(conn)
    argv = ["timeout", "-k", str(KILL_AFTER), f"{bound:g}", TOOL, *ARGS, "-g", str(len(gpus))]
    arm = nccl.Arm(name, gpus, argv, dict(extra_env), bound, where=conn.name)
    missing = [b for b in gpus if b not in order]
    if missing:
        arm.tail = f"{', '.join(missing)} not listed by nvidia-smi on {conn.name}"
        return arm
    token = uuid.uuid4().hex
    env = {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(order.index(b)) for b in gpus),
        "NCCL_DEBUG": "INFO",
        MARK: token,
        **extra_env,
    }
    t0 = time.monotonic()
    r = conn.run(argv, timeout=bound + KILL_AFTER + 15, env=env)
    arm.seconds = time.monotonic() - t0
    arm.rc = r.rc
    # timeout(1): 124 when it sent SIGTERM, 137 when the command needed the SIGKILL
    arm.hung = r.rc in (124, 137) or bool(getattr(r, "timed_out", False))
    arm.tail = (r.stdout + "\n" + r.stderr).strip()[-4000:]
    arm.result = nccl.parse_perf(r.stdout)
    arm.channels = nccl.parse_channels(r.stdout + "\n" + r.stderr)
    left = leftovers(conn, token)
    if left:
        conn.run(["kill", "-9", *map(str, left)], timeout=15)
        time.sleep(0.5)
        arm.leftover = left
    return arm


def run_both(conn: Any, gpus: list[str], bound: float) -> tuple[nccl.Arm, nccl.Arm]:
    """The P2P arm (NCCL as it chooses), then the control arm (NCCL_P2P_DISABLE=1), on ``gpus``."""
    first = run_arm(conn, nccl.ARMS[0], gpus, {"NCCL_P2P_DISABLE": "0"}, bound)
    control = run_arm(conn, nccl.ARMS[1], gpus, dict(nccl.CONTROL_ENV), bound)
    return first, control


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
                ev.state(arm.name, _side(arm), target=conn.name)
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


def _side(arm: nccl.Arm) -> dict[str, Any]:
    """One arm as a column of the evidence: transport, bus bandwidth, wrong elements, time."""
    r = arm.result
    return {
        "transport": arm.transport_text(),
        "avg busbw (GB/s)": r.avg_busbw,
        "#wrong": r.wrong,
        "seconds": round(arm.seconds, 2),
        "rc": arm.rc,
        "result": arm.failure() or "completed",
        "where": arm.where,
        "env": arm.env,
    }

"""`--fix=drain`: the host's Slurm drain state follows its health (suites/health/drain.py).

Collected only with --fix=drain (suites/health/conftest.py), after every check of the host
(this file sorts after test_health.py, and a host's tests run in file order): a failed host is
drained with the reason `gpuhost: CHECK: VALUE`, a healthy host gpuhost drained is resumed, a
node drained by a person is left alone. Under --check-only it reports "would fix" with the exact
scontrol command.
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.run.remediation import Check

from . import drain


def test_drain(health: Any, remediate: Any, request: Any) -> None:
    """Slurm: drained when a check failed, resumed when healthy again (only gpuhost's own drains)."""

    def record(c: Check) -> None:
        # the step's verdict in every output: the decision, and the host's failures as its reasons
        props = request.node.user_properties
        props.append(("gpuhost_host", health.name))
        props.append(("gpuhost_check", "drain"))
        verdict = {"check": "drain", "ok": c.ok, "summary": c.summary, "state": c.state}
        props.append(("gpuhost_verdict", {**verdict, "reasons": list(c.state.get("failures") or [])}))

    remediate(**drain.remediation(health, on_check=record))

"""`--fix=reset`: a GPU that owes a reset is reset, what holds it stopped and started again.

Collected only with --fix=reset (suites/health/conftest.py), after every check of the host and
the drain step (file order): see suites/health/reset.py. Under --check-only it reports "would
fix" with the exact commands, or names what holds the GPU. With --fix=reset,reboot a reset the
GPU's signals do not confirm is followed by a reboot of the node (suites/health/reboot.py).
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.run.remediation import Check

from . import options, reset


def test_reset(health: Any, remediate: Any, request: Any) -> None:
    """GPU reset: every GPU that owes one is reset (only with its holders ours to stop)."""

    def record(c: Check) -> None:
        props = request.node.user_properties
        props.append(("gpuhost_host", health.name))
        props.append(("gpuhost_check", "reset"))
        verdict = {"check": "reset", "ok": c.ok, "summary": c.summary, "state": c.state}
        props.append(
            ("gpuhost_verdict", {**verdict, "reasons": [g["bus"] for g in c.state.get("gpus") or []]})
        )

    config = request.config
    rem = reset.ResetRemediation(
        health,
        on_check=record,
        reboot_timeout=options.reboot_timeout(config),
        verify_timeout=options.reset_verify_timeout(config),
    )
    remediate(rem)

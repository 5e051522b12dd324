"""suites/p2p measures P2P where a tool exists, on the lab's proxmox-rtx6000 host.

A stock Proxmox host has neither cupy nor nvbandwidth; the CUDA stack lives in the container. With
nvbandwidth taken off the host, the suite measures in the container and says so; with it taken
off both, step 6 fails naming what it looked for where and what to install, with no ACS advice
(nothing was measured). The lab's nvbandwidth is installed in both machines, as TOOL_PATHS puts it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.p2p.test_p2p_suite import assert_repaired, run_suite, sh

HIDE = "mv /usr/bin/nvbandwidth /root/nvbandwidth.hidden"


@pytest.fixture(scope="module")
def host(lab: Any) -> Any:
    """The proxmox-rtx6000 lab host, booted once for this module."""
    return lab.host("proxmox-rtx6000")


def _notes(run: Any, step: str) -> str:
    return "\n".join(run.evidence(step).get("notes", []))


def test_measures_in_the_container_when_the_host_has_no_tool(host: Any, tmp_path: Path) -> None:
    host.reset()
    try:
        sh(host, HIDE)
        run = run_suite(host, tmp_path)
        assert run.rc == 0, run.output[-3000:]
        assert run.outcomes["test_p2p_bandwidth"] == "passed", run.outcomes
        notes = _notes(run, "test_p2p_bandwidth")
        assert "P2P bandwidth after: measured with nvbandwidth" in notes, notes
        assert "101" in notes.split("P2P bandwidth after: measured with nvbandwidth", 1)[1].splitlines()[0], (
            notes
        )
        assert "no tool on" in notes and "nvbandwidth and p2pBandwidthLatencyTest not installed" in notes, (
            notes
        )
        assert_repaired(host)

        # no tool anywhere: a precise failure, not platform advice
        sh(host, f"pct exec 101 -- {HIDE}")
        again = run_suite(host, tmp_path)
        assert again.rc != 0
        assert again.outcomes["test_p2p_bandwidth"] == "failed", again.outcomes
        out = again.output
        assert "no P2P bandwidth tool on" in out and "install nvbandwidth" in out, out[-3000:]
        assert "ACS" not in out and "BIOS" not in out, out[-3000:]
        assert again.writes() == [] and again.signals() == [], again.record
    finally:
        host.reset()

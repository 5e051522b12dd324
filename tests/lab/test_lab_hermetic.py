"""Lab hosts do not see the state of the machine that runs them (issue: tests leave the machine as found).

A lab host's root is an overlay on this machine's `/`; the plugin's own state directories are
masked in the lab layer, so a `local://` run's health cursor or journal on this machine never
appears inside a lab host as if the host had kept it.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

PROFILE = "proxmox-rtx6000"


@pytest.fixture
def controller_state() -> object:
    """Put a marker file in this machine's /var/lib/gpuhost for the test; remove what we made."""
    base = Path("/var/lib/gpuhost")
    made_dir = not base.exists()
    marker = base / f"gpulab-mask-probe-{uuid.uuid4().hex}"
    base.mkdir(parents=True, exist_ok=True)
    marker.write_text("controller state\n")
    try:
        yield marker
    finally:
        marker.unlink(missing_ok=True)
        if made_dir:
            shutil.rmtree(base, ignore_errors=True)


def test_state_dirs_of_this_machine_are_masked(lab, controller_state) -> None:
    h = lab.host(PROFILE)
    out = h.ssh(["sh", "-c", "ls -A /var/lib/gpuhost; echo rc=$?"]).stdout
    assert controller_state.name not in out
    assert "rc=0" in out  # the directory exists (empty) and is the host's own


def test_lab_hosts_see_the_checkout_read_only(lab) -> None:
    """Tests run the checkout's programs inside lab hosts (nodecheck, Slurm jobs): a checkout in
    /tmp (a CI clone) is hidden by the host's fresh /tmp unless the lab binds it back, read-only."""
    h = lab.host(PROFILE)
    repo = Path(__file__).resolve().parents[2]
    python = repo / ".venv" / "bin" / "python"
    out = h.ssh(
        [
            "sh",
            "-c",
            f"test -x '{python}' && echo seen; touch '{repo}/.lab-write-probe' 2>/dev/null || echo ro",
        ]
    )
    assert "seen" in out.stdout, out
    if repo.is_relative_to("/tmp"):
        assert "ro" in out.stdout and not (repo / ".lab-write-probe").exists()


def test_lab_tests_carry_the_lab_marker(pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["gpulab.pytest_fixtures"]')
    pytester.makepyfile(
        """
        def test_uses_lab(lab):
            pass

        def test_plain():
            pass
        """
    )
    result = pytester.runpytest("-m", "not lab", "--co", "-q", "-p", "no:gpuhost")
    result.stdout.fnmatch_lines(["*test_plain*", "*1/2 tests collected (1 deselected)*"])

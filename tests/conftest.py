"""Fixtures shared by the plugin's own tests, and the state directory they use.

The plugin keeps state on its targets (journals, run locks, the health cursor) under
$GPUHOST_STATE_DIR, default /var/lib/gpuhost. A `local://` agent inherits this process's
environment, so pointing the variable at a temporary directory for the session keeps every
`local://` run of the tests (in-process or in a pytester subprocess) off this machine's own
/var/lib/gpuhost. Lab hosts are reached over SSH and keep theirs inside their overlay root.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

pytest_plugins = [
    "pytester",
    "tests.helpers.sshd",
    "tests.helpers.s3server",
    "gpulab.pytest_fixtures",
    "gpulab.slurm.fixtures",
]


def pytest_configure(config: pytest.Config) -> None:
    # local:// is named after the machine (exec/nodename.py); the plugin's own tests expect one
    # name on every machine. tests/nodecheck/test_nodecheck_name.py checks the host-name default without it.
    os.environ.setdefault("GPUHOST_NODE_NAME", "local")
    if not os.environ.get("GPUHOST_CONTROLLER_STATE_DIR"):
        # what a --check-only health run keeps on the controller (modules/health/controller_state.py)
        kept = tempfile.mkdtemp(prefix="gpuhost-test-controller-state-")
        os.environ["GPUHOST_CONTROLLER_STATE_DIR"] = kept
        config.add_cleanup(lambda: shutil.rmtree(kept, ignore_errors=True))
    if os.environ.get("GPUHOST_STATE_DIR"):
        return
    state = tempfile.mkdtemp(prefix="gpuhost-test-state-")
    os.environ["GPUHOST_STATE_DIR"] = state

    def cleanup() -> None:
        if os.environ.get("GPUHOST_STATE_DIR") == state:
            del os.environ["GPUHOST_STATE_DIR"]
        shutil.rmtree(state, ignore_errors=True)

    config.add_cleanup(cleanup)

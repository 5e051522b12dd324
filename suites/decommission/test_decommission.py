"""Empty a rented GPU node for hand-back, with every byte that matters verified elsewhere.

    pytest suites/decommission --host=ssh://root@NODE --manifest=node-backup.yaml \
        --backup-dir=backups/{host} --backup-to=s3://BUCKET/PREFIX [--s3-endpoint=URL] [--check-only]

The steps run in this order for each node; a failed step blocks the ones after it, except the
last: the verdict always runs and lists exactly what is missing.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpuhost_procedure


def test_inventory(decom, step):
    """Host facts, GPU processes, servers to stop and the manifest's files, in one round trip."""
    step(decom.step_inventory())


def test_servers_stopped(decom, step):
    """The manifest's servers are stopped (SIGTERM, bounded wait, SIGKILL), and nothing else."""
    step(decom.step_servers_stopped())


def test_gpus_idle(decom, step):
    """No compute process on any GPU, memory back to baseline."""
    step(decom.step_gpus_idle())


def test_artifacts_backed_up(decom, step):
    """Every manifest file is in the local backup, SHA-256 checked against the node's."""
    step(decom.step_artifacts_backed_up())


def test_data_in_s3(decom, step):
    """The categories marked s3 are in the bucket with the same SHA-256; no upload left open."""
    step(decom.step_data_in_s3())


def test_notes_saved(decom, step):
    """NOTES.md says what the node was, what ran, what was kept and where."""
    step(decom.step_notes_saved())


@pytest.mark.gpuhost_final
def test_safe_to_terminate(decom, step):
    """Every step passed or was fixed and every byte is verified at its destination."""
    step(decom.step_safe_to_terminate())

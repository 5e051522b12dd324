"""Empty a rented GPU node for hand-back, with every byte that matters verified elsewhere.

    pytest suites/decommission --host=ssh://root@NODE --manifest=node-backup.yaml \
        --backup-dir=backups/{host} --backup-to=s3://BUCKET/PREFIX [--s3-endpoint=URL] [--check-only]

The steps run in this order for each node; a failed step blocks the ones after it, except the
last: the verdict always runs and lists exactly what is missing.
"""

from __future__ import annotations

import pytest

from .credentials import step_credentials_left
from .notes import step_notes_saved, step_safe_to_terminate
from .stop import step_gpus_idle, step_inventory, step_servers_stopped
from .transfer import step_artifacts_backed_up, step_data_in_s3

pytestmark = pytest.mark.gpuhost_procedure


def test_inventory(decom, step):
    """Host facts, GPU processes, servers to stop and the manifest's files, in one round trip."""
    step(step_inventory(decom))


def test_servers_stopped(decom, step):
    """The manifest's servers are stopped (SIGTERM, bounded wait, SIGKILL), and nothing else."""
    step(step_servers_stopped(decom))


def test_gpus_idle(decom, step):
    """No compute process on any GPU, memory back to baseline."""
    step(step_gpus_idle(decom))


def test_artifacts_backed_up(decom, step):
    """Every manifest file is in the local backup, SHA-256 checked against the node's."""
    step(step_artifacts_backed_up(decom))


def test_data_in_s3(decom, step):
    """The categories marked s3 are in the bucket with the same SHA-256; no upload left open."""
    step(step_data_in_s3(decom))


def test_credentials_left(decom, step):
    """No credential left on the node: each listed by kind, place and fingerprint; --fix=scrub removes them."""
    step(step_credentials_left(decom))


def test_notes_saved(decom, step):
    """NOTES.md says what the node was, what ran, what was kept and where."""
    step(step_notes_saved(decom))


@pytest.mark.gpuhost_final
def test_safe_to_terminate(decom, step):
    """Every step passed or was fixed and every byte is verified at its destination."""
    step(step_safe_to_terminate(decom))

"""The decommission procedure for one node: seven ordered steps on the `Procedure` base.

The shared state (links, destinations, timeline) is in state.py; steps 1-3 (inventory, servers
stopped, GPUs idle) in stop.py; 4-5 (artifacts backed up, data in S3) in transfer.py; 6-7 (notes
saved, safe to terminate) in notes.py. Step names follow the convention of every suite: the test
is `test_<name>`, its remediation `<name>` with spaces ("gpus idle"), its builder `step_<name>`.
"""

from __future__ import annotations

from .notes import STEPS, NotesSteps
from .state import APPS_QUERY, GPU_QUERY
from .stop import StopSteps
from .transfer import TransferSteps

__all__ = ["APPS_QUERY", "GPU_QUERY", "STEPS", "Decommission"]


class Decommission(StopSteps, TransferSteps, NotesSteps):
    """One node being emptied, step by step, in test_decommission.py's order."""

"""The P2P procedure on one target: nine ordered steps on the `Procedure` base.

The steps are tests in test_p2p.py (in order, `gpuhost_procedure`); each asks this object for a
`Remediation`. The state they share (facts, plan, measurements, undo) is in state.py, steps 1-4
(take the host apart) in prepare.py, steps 5-6 and 8-9 (put it back, prove it) in restore.py,
step 7 (the NCCL collective) in collective.py. The module fixture's teardown (`finish`) runs the
pending undos in reverse: no in-scope function is left without its driver, and what this run
stopped runs again, whatever happened in between.

Step names follow one convention in every suite: the test is `test_<name>`, its remediation is
named `<name>` with spaces ("iommu groups identity"), the method that builds it `step_<name>`.
"""

from __future__ import annotations

from pytest_gpuhost.run.procedure import ProcedureError

from .collective import CollectiveSteps
from .prepare import PrepareSteps
from .restore import RestoreSteps
from .state import P2POptions

__all__ = ["P2POptions", "P2PProcedure", "ProcedureError"]


class P2PProcedure(PrepareSteps, RestoreSteps, CollectiveSteps):
    """One suites/p2p run against one target: the nine steps, in test_p2p.py's order."""

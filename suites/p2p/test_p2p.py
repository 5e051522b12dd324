"""Restore GPU peer-to-peer DMA on a host whose IOMMU blocks it, safely, in nine ordered steps.

    pytest suites/p2p --host=ssh://root@gpu-host --container=pct:101 [--check-only]

On a host that is already healthy every step passes and the service is never touched. The
tests are made from the steps declared in suites/p2p/suite.py (`STEPS`), one `test_<step>` each,
in order.
"""

from __future__ import annotations

from .suite import SUITE

SUITE.tests(globals())

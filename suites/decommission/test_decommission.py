"""Empty a rented GPU node for hand-back, with every byte that matters verified elsewhere.

    pytest suites/decommission --host=ssh://root@NODE --manifest=node-backup.yaml \
        --backup-dir=backups/{host} --backup-to=s3://BUCKET/PREFIX [--s3-endpoint=URL] [--check-only]

The steps run in this order for each node; a failed step blocks the ones after it, except the
last: the verdict always runs and lists exactly what is missing. The tests are made from the
steps declared in suites/decommission/suite.py (`STEPS`), one `test_<step>` each, in order.
"""

from __future__ import annotations

from .suite import SUITE

SUITE.tests(globals())

"""Acceptance of a rented GPU node before a job starts: is it what the order promised?

    pytest suites/accept --host=ssh://root@NODE --order=order.yaml [--check-only]

The tests are made from the steps declared in suites/accept/suite.py (`STEPS`), one
`test_<name>` each, in their order, with the declaration's one line as the docstring; a step is
added there, not here (docs/adding-a-suite.md). Every step only reads, except the data volume's
scratch file (written, fsync'd, read back, removed; not even that under --check-only), and
every step runs whatever the others found: the last, the verdict, says "ACCEPT" or "REJECT:
..." naming every promise not kept (docs/accept.md).
"""

from __future__ import annotations

from .suite import SUITE

SUITE.tests(globals())

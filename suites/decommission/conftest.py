"""Fixtures of suites/decommission: the procedure of each node, made by the suite contract (run/suite.py)."""

from __future__ import annotations

from .suite import SUITE

procedure = SUITE.fixture()

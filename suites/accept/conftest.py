"""Fixtures of suites/accept: the acceptance of each target, made by the suite contract (run/suite.py)."""

from __future__ import annotations

from .suite import SUITE

procedure = SUITE.fixture()

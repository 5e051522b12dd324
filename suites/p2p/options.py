"""Command-line options and ini values of suites/p2p (registered by suites/conftest.py)."""

from __future__ import annotations

import pytest


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group."""


def validate(config: pytest.Config) -> None:
    """Check this suite's option values; raise pytest.UsageError naming the bad value."""

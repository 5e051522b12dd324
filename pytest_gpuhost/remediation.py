"""Deprecated import path: use `pytest_gpuhost.run.remediation` (kept for one release)."""

from pytest_gpuhost.run.remediation import *  # noqa: F403
from pytest_gpuhost.run.remediation import __all__  # noqa: F401

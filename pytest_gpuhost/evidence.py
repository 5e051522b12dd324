"""Deprecated import path: use `pytest_gpuhost.run.evidence` (kept for one release)."""

from pytest_gpuhost.run.evidence import *  # noqa: F403
from pytest_gpuhost.run.evidence import __all__  # noqa: F401

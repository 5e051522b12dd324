"""Deprecated import path: use `pytest_gpuhost.exec.transport` (kept for one release)."""

from pytest_gpuhost.exec.transport import *  # noqa: F403
from pytest_gpuhost.exec.transport import __all__  # noqa: F401

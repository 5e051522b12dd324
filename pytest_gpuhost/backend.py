"""Deprecated import path: use `pytest_gpuhost.exec.backend` (kept for one release)."""

from pytest_gpuhost.exec.backend import *  # noqa: F403
from pytest_gpuhost.exec.backend import __all__  # noqa: F401

"""Deprecated import path: use `pytest_gpuhost.exec.connection` (kept for one release)."""

from pytest_gpuhost.exec.connection import *  # noqa: F403
from pytest_gpuhost.exec.connection import __all__  # noqa: F401

"""Deprecated import path: use `pytest_gpuhost.exec.targets` (kept for one release)."""

from pytest_gpuhost.exec.targets import *  # noqa: F403
from pytest_gpuhost.exec.targets import __all__  # noqa: F401

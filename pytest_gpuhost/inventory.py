"""Deprecated import path: use `pytest_gpuhost.exec.inventory` (kept for one release)."""

from pytest_gpuhost.exec.inventory import *  # noqa: F403
from pytest_gpuhost.exec.inventory import __all__  # noqa: F401

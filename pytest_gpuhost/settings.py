"""Deprecated import path: use `pytest_gpuhost.run.settings` (kept for one release)."""

from pytest_gpuhost.run.settings import *  # noqa: F403
from pytest_gpuhost.run.settings import __all__  # noqa: F401

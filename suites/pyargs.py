"""`pytest --pyargs gpuhost_suites.health ...`: the installed suites run like the checkout's suites/.

Installed from the wheel, the suites are the package `gpuhost_suites` (pyproject.toml maps it to
suites/). pytest reads the conftest.py files of its path arguments before it parses the command
line (`_pytest/config/__init__.py`, `pytest_load_initial_conftests` -> `_set_initial_conftests`:
"initial conftests" are found from arguments that exist as paths), so those conftests can add
options. A `--pyargs` argument is a module name, not a path: pytest turns it into one only when it
collects, after the command line was parsed, so a suite's own options (`--fix`, `--manifest`,
`--gpus`, ...) would be "unrecognized arguments" and its ini values "unknown configuration value".

This plugin (entry point pytest11 `gpuhost_suites`) runs first in that hook and adds the directory
of every `--pyargs` argument naming this package to the arguments the initial conftests are found
from, so suites/conftest.py registers every suite's options exactly as with a path argument.
Collection is unchanged (pytest resolves the module names itself). Arguments naming other
packages, and runs without `--pyargs`, are left alone.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PACKAGE = __name__.rpartition(".")[0] or "gpuhost_suites"


def suite_path(name: str) -> Path | None:
    """Return the file or directory of `name` (a module of this package, `::` node ids allowed)."""
    module = name.split("::", 1)[0]
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None  # pytest says "module or package not found" when it collects
    if spec is None or not spec.origin:
        return None
    origin = Path(spec.origin)
    return origin.parent if spec.submodule_search_locations else origin


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    ns = early_config.known_args_namespace
    if not getattr(ns, "pyargs", False):
        return
    extra = [str(p) for a in list(ns.file_or_dir or ()) if (p := suite_path(str(a))) is not None]
    if extra:
        ns.file_or_dir = [*ns.file_or_dir, *extra]

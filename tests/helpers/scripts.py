"""Load a file of scripts/ as a module: the scripts are run by path, not installed as a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """Return scripts/NAME.py as the module `gpuhost_script_NAME` (registered, as dataclasses need)."""
    spec = importlib.util.spec_from_file_location(f"gpuhost_script_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod

"""What a probe may import from the agent core, and how each probe gets a namespace of its own.

Probes write `from pytest_gpuhost.exec.agent.core import fact, op, read_str`.  In the plugin that
is an ordinary import (ruff, mypy and tests see a normal module); on the target the core runs as
one program and registers a module under this same name holding the names in `__all__`, so the
probe's import line works there unchanged.  `load_probe` runs each probe in a module of its own,
seeded with the same names, so probes written before this API existed keep working, and
registers it under its dotted name for the probes loaded after it that import from it.

Target side: stdlib only, Python 3.6 syntax (see the package docstring).
"""

import sys
import types

from pytest_gpuhost.exec.agent.files import (
    link_name,
    pci_upstream,
    read_str,
    read_text,
    state_path,
    write_file,
)
from pytest_gpuhost.exec.agent.registry import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_OUTPUT,
    OpError,
    b64d,
    b64e,
    fact,
    op,
)
from pytest_gpuhost.exec.agent.runner import run_process, run_recorded

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_OUTPUT",
    "OpError",
    "b64d",
    "b64e",
    "fact",
    "link_name",
    "op",
    "pci_upstream",
    "read_str",
    "read_text",
    "run_process",
    "run_recorded",
    "state_path",
    "write_file",
]

API_MODULE = "pytest_gpuhost.exec.agent.core"  # the name probes import; registered on the target
PROBE_PREFIX = "__gpuhost_agent__."  # probe modules are registered as this + file stem
PROBE_PACKAGE = "pytest_gpuhost.exec.agent."  # ... and as this + stem, for probes importing probes


def _api_module():
    """Return the API module: the real one in the plugin, one built from the core on the target."""
    mod = sys.modules.get(API_MODULE)
    if mod is None:
        # On the target the core is one program, run in the bootstrap's globals: no real module.
        mod = types.ModuleType(API_MODULE, "The gpuhost agent core's API for probes.")
        core = globals()
        for name in __all__:
            setattr(mod, name, core[name])
        sys.modules[API_MODULE] = mod
    return mod


def load_probe(name, source):
    """Run a probe's source in a new module named PROBE_PREFIX + name; return the module.

    The module starts with every API name already defined, for probes that use them without
    importing them.  A failing probe raises here: the agent does not start half-built.
    """
    api = _api_module()
    mod = types.ModuleType(PROBE_PREFIX + name)
    for attr in __all__:
        setattr(mod, attr, getattr(api, attr))
    sys.modules[mod.__name__] = mod
    exec(compile(source, f"<gpuhost-agent/{name}.py>", "exec"), mod.__dict__)
    # A later probe's `from pytest_gpuhost.exec.agent.probe_x import y` finds it (the import
    # system looks a dotted name up in sys.modules before its parents); in the plugin the real
    # module is already there and stays.
    sys.modules.setdefault(PROBE_PACKAGE + name, mod)
    return mod

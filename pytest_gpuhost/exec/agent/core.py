"""What a probe may import from the agent core, and how each probe gets a namespace of its own.

Probes write `from pytest_gpuhost.exec.agent.core import fact, op, read_str`.  In the plugin that
is an ordinary import (ruff, mypy and tests see a normal module); on the target the core runs as
one program and registers a module under this same name holding the names in `__all__`, so the
probe's import line works there unchanged.  `load_probe` runs each probe in a module of its own,
seeded with the same names, so probes written before this API existed keep working, and
registers it under its dotted name for the probes loaded after it that import from it.

Target side: stdlib only, Python 3.6 syntax (see the package docstring).
"""

import re
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
    FACTS,
    OPS,
    STREAM_OPS,
    UNAVAILABLE,
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


# What a probe registers (`@op("name"`, `@fact("name"`) and which probes it imports from: read
# from its source, so a probe that cannot load still answers for its names.
_PROVIDES = re.compile(r"^@(op|fact)\(\s*[\"'](\w+)[\"']", re.MULTILINE)
_IMPORTS_PROBE = re.compile(r"^from pytest_gpuhost\.exec\.agent\.(probe_\w+) import ", re.MULTILINE)


def load_probe(name, source):
    """Run a probe's source in a new module named PROBE_PREFIX + name; return the module.

    The module starts with every API name already defined, for probes that use them without
    importing them.  A probe that imports a module this Python lacks (`ctypes`, `statistics`:
    Debian's python3-minimal has neither) is unavailable, as is a probe that imports from an
    unavailable probe: its ops and facts answer with the reason, and the agent serves the rest
    (`hello` lists them under `unavailable`).  Any other failure raises here: the agent does not
    start half-built.
    """
    for need in _IMPORTS_PROBE.findall(source):
        if need in UNAVAILABLE:
            return _unavailable(name, source, f"it needs {need}, which is unavailable: {UNAVAILABLE[need]}")
    api = _api_module()
    mod = types.ModuleType(PROBE_PREFIX + name)
    for attr in __all__:
        setattr(mod, attr, getattr(api, attr))
    sys.modules[mod.__name__] = mod
    ops, facts = set(OPS), set(FACTS)
    try:
        exec(compile(source, f"<gpuhost-agent/{name}.py>", "exec"), mod.__dict__)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if not missing or missing.startswith("pytest_gpuhost"):
            raise  # the probe's own mistake (a name the core does not export), not the node's
        del sys.modules[mod.__name__]
        for key in set(OPS) - ops:
            del OPS[key]
            STREAM_OPS.discard(key)
        for key in set(FACTS) - facts:
            del FACTS[key]
        return _unavailable(name, source, f"this Python has no module {missing!r}")
    # A later probe's `from pytest_gpuhost.exec.agent.probe_x import y` finds it (the import
    # system looks a dotted name up in sys.modules before its parents); in the plugin the real
    # module is already there and stays.
    sys.modules.setdefault(PROBE_PACKAGE + name, mod)
    return mod


def _unavailable(name, source, why):
    """Mark probe `name` unavailable: each op and fact it would register answers with `why`."""
    UNAVAILABLE[name] = why
    message = f"unavailable on this node: {name}: {why}"
    for kind, key in _PROVIDES.findall(source):

        def refuse(*_args, _key=key):
            raise OpError(f"{_key} is {message}")

        if kind == "op":
            OPS[key] = refuse
            STREAM_OPS.discard(key)  # a refusal is one reply, whatever the op streams
        else:
            FACTS[key] = refuse
    return None

"""Assemble the agent program that runs on targets: the core, each probe in its own module, `main()`.

The program is sent once per connection: a bootstrap (`python3 -S -u -c BOOTSTRAP`, the flags in
`PYTHON_FLAGS`) reads a decimal length line and that many bytes of zlib-compressed source from
stdin, then `exec`s it.
The source is built once per process and cached.  On the target it runs the core files
(`CORE_FILES`, in that order, as one namespace, their imports of each other removed), loads
every `probe_*.py` into a module of its own with `core.load_probe`, then calls `main()`:

  registry.py  op/fact registry, OpError, reply encoding, one request's dispatch
  runner.py    the `run` op: a command in its own session, process group killed at the timeout
  files.py     bounded reads, writes in a forked child under a watchdog, stat/listdir/glob
  facts.py     `facts`, `hello`, `batch`, and the kernel/hostname/os_release facts
  agent.py     the protocol loop, `main()`
  core.py      the API probes import, and `load_probe`

Probe-author guide
------------------
A probe is a file `exec/agent/probe_<name>.py` that adds operations or facts to the agent.  It is
picked up by its name; nothing else needs registering.

* It runs ON the target: stdlib only, Python 3.6 syntax (f-strings yes; no walrus, no
  `from __future__ import annotations`, no annotations such as `list[str]` that 3.6 evaluates;
  a type comment `x = {}  # type: dict` where mypy needs one).  Optional libraries (cupy,
  pynvml) are imported inside the function that needs them.
* It has a module of its own, so its private names need no prefix and cannot clash with
  another probe's.  It imports the core explicitly, from one module only::

      from pytest_gpuhost.exec.agent.core import fact, op, read_str

  Only names in `core.__all__` may be imported from the core (a test checks it): `op`, `fact`, `OpError`,
  `run_process` (argv, timeout, ...; same dict as the `run` op, whole process group killed at
  the timeout), `run_recorded(argv, timeout, record)` (the same, and a copy trimmed for the
  evidence appended to the list `record`), `read_text(path, max_bytes)` -> bytes, `read_str(path, default)` -> stripped
  text or `default`, `link_name(path)` -> basename of a symlink's target or None,
  `write_file(path, data, timeout)` (forked writer under a watchdog), `b64e`/`b64d`,
  `DEFAULT_MAX_BYTES`, `DEFAULT_MAX_OUTPUT`.  A probe may also import from another probe
  (`from pytest_gpuhost.exec.agent.probe_nvml import Nvml`): that probe is loaded first (a cycle
  is refused when the agent is built) and registered under its own dotted name, so the line works
  on the target unchanged.  A probe that only holds code other probes share registers no op or
  fact.  Nothing else from `pytest_gpuhost`: on the target only those modules exist.  In the
  plugin the same lines are ordinary imports, so ruff and mypy check the probe as a normal
  module, with no file-wide `noqa`.
* Declare handlers with the decorators::

      @op("gpu_inventory")               # handler(params: dict) -> JSON-able result
      def gpu_inventory(params): ...

      @op("tar_stream", stream=True)     # handler(params, emit); emit(chunk) per chunk,
      def tar_stream(params, emit): ...  # the return value is the final result

      @fact("iommu_groups")              # handler(params) -> JSON-able; the "facts" op calls
      def iommu_groups(params): ...      # it with the request's "params" (shared by its facts)

  Fail a request with `OSError` (its errno travels back) or `OpError("one line")`.  Nothing may
  wait without a bound: every command gets a timeout, every loop a deadline.
* The facts of one `facts` request share one `params` dict: a probe may cache a costly read
  there for the request's other facts, under a key named after the probe (`"_gpu_smi"`).
* Converting an old probe: add the import line, delete the `if "op" not in globals()` fallback,
  the hand prefixes (`_hl_`, `_bk_`) and private copies of core helpers (`read_str`,
  `link_name`), the file-wide `# ruff: noqa`, and the file's entry in pyproject's mypy `exclude`.
* A probe that also runs alone (the backup's bulk sender) is started with
  `probe_program("probe_x", "entry()")`: the core, that probe, then the call, no protocol loop.
* Tests: import the probe as a normal module (`from pytest_gpuhost.exec.agent import probe_x`)
  and call its functions against files under `tmp_path`; test what goes over the wire through a
  real agent (`open_connection(parse_host_url("local://"))`, or the lab).  tests/exec/test_agent.py
  checks every probe's imports and that the assembled program parses as Python 3.6.
"""

from __future__ import annotations

import ast
import functools
import re
import zlib
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "BOOTSTRAP",
    "agent_needs",
    "CORE_FILES",
    "PYTHON_FLAGS",
    "agent_source",
    "agent_payload",
    "load_order",
    "probe_files",
    "probe_needs",
    "probe_program",
]

_HERE = Path(__file__).resolve().parent
_FUTURE = re.compile(r"^from __future__ import [^\n]*\n", re.MULTILINE)
# A core file's import of another core file: on the target all core files share one namespace.
_CORE_IMPORT = re.compile(
    r"^from pytest_gpuhost\.exec\.agent\.\w+ import (?:\([^)]*\)|[^\n(]*)\n", re.MULTILINE
)

# The core, in the order it runs on the target: each file uses only names defined above it.
CORE_FILES = ("registry.py", "runner.py", "files.py", "facts.py", "agent.py", "core.py")

# The interpreter's flags for the agent. -u: unbuffered protocol. -S: no `site` initialisation:
# the agent uses the standard library only, and `site` runs every .pth file of the target's
# site-packages (distutils hooks, certifi, namespace packages): on the lab machine 13.9 ms of
# CPU per start against 7.6 ms with -S (median of 20, python3 3.11), paid once per host and run.
# -B: no bytecode written on the target. A node whose standard library has no .pyc (a
# python3-minimal laid out without Debian's py3compile, a virtualenv never compiled) would
# otherwise get __pycache__ directories from the first import: a write `--check-only` forbids.
PYTHON_FLAGS = ("-S", "-u", "-B")

# Reads with os.read (unbuffered) so no protocol byte is swallowed by a buffer before main()
# takes fd 0 over.  Kept short: it travels on the command line of every agent start.
BOOTSTRAP = (
    "import os,sys,zlib\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c:sys.exit(3)\n"
    "  b+=c\n"
    " return b\n"
    "h=b''\n"
    "while not h.endswith(b'\\n'):h+=r(1)\n"
    "g={'__name__':'__gpuhost_agent__'}\n"
    "exec(compile(zlib.decompress(r(int(h))),'<gpuhost-agent>','exec'),g)\n"
)


# A probe's import of another probe: that probe is loaded first, and the import finds it.
_PROBE_IMPORT = re.compile(r"^from pytest_gpuhost\.exec\.agent\.(probe_\w+) import ", re.MULTILINE)


def probe_needs(path: Path) -> list[str]:
    """Return the stems of the probes `path` imports from."""
    return sorted(set(_PROBE_IMPORT.findall(path.read_text(encoding="utf-8"))))


@functools.lru_cache(maxsize=1)
def _probe_order() -> tuple[Path, ...]:
    return load_order(_HERE.glob("probe_*.py"))


def load_order(paths: Iterable[Path]) -> tuple[Path, ...]:
    """Return probe files by name, each after the probes it imports from; ValueError on a cycle
    or an import of a probe that is not there."""
    by_stem = {p.stem: p for p in sorted(paths)}
    done: dict[str, Path] = {}

    def visit(stem: str, path: tuple[str, ...]) -> None:
        if stem in done:
            return
        if stem in path:
            raise ValueError(f"agent probes import each other in a cycle: {' -> '.join(path + (stem,))}")
        if stem not in by_stem:
            raise ValueError(f"{path[-1]}.py imports {stem}, which is no agent probe")
        for need in probe_needs(by_stem[stem]):
            visit(need, path + (stem,))
        done[stem] = by_stem[stem]

    for stem in by_stem:
        visit(stem, ())
    return tuple(done.values())


def probe_files() -> list[Path]:
    """Return the probe modules that are part of the agent, in the order they are loaded: by
    name, each after the probes it imports from."""
    return list(_probe_order())


def _with_needs(stem: str) -> list[Path]:
    """The probe `stem` and every probe it needs, in load order (each file read once a process)."""
    order, needs = _probe_order(), _needs_map()
    want: set[str] = set()
    todo = [stem]
    while todo:
        s = todo.pop()
        if s not in want:
            want.add(s)
            todo.extend(needs[s])
    return [p for p in order if p.stem in want]


@functools.lru_cache(maxsize=1)
def _needs_map() -> dict[str, list[str]]:
    return {p.stem: probe_needs(p) for p in _probe_order()}


def _core_source(path: Path) -> str:
    text = _FUTURE.sub("", path.read_text(encoding="utf-8"))
    for found in _CORE_IMPORT.findall(text):
        # Stripped, an alias would leave its name undefined on the target (`x as x` re-exports).
        if any(a != b for a, b in re.findall(r"(\w+) as (\w+)", found)) or "*" in found:
            raise ValueError(f"{path.name}: core files import each other without `as`: {found.strip()}")
    return _CORE_IMPORT.sub("", text)


def _probe_call(path: Path) -> str:
    # The probe travels as a string constant and is compiled in its own module by load_probe.
    source = _FUTURE.sub("", path.read_text(encoding="utf-8"))
    return f"load_probe({path.stem!r}, {source!r})\n"


@functools.lru_cache(maxsize=1)
def _core() -> str:
    return "".join(f"\n# ---- {name}\n" + _core_source(_HERE / name) for name in CORE_FILES)


@functools.lru_cache(maxsize=1)
def agent_source() -> str:
    """Return the agent program: the core files, each probe loaded in its own module, `main()`.

    `from __future__` lines are dropped: they are only legal at the top of a program, and the
    agent keeps to syntax that old target Pythons understand anyway.
    """
    return _core() + "\n" + "".join(_probe_call(path) for path in probe_files()) + "main()\n"


def probe_program(probe: str, call: str) -> str:
    """Return a program that loads the core and one probe (no protocol loop), then runs `call`.

    `call` is Python run in the probe's module, for a probe that also works alone on a channel
    of its own: `["python3", "-c", probe_program("probe_backup", "_bk_send_main()")]`.
    """
    path = _HERE / f"{probe}.py"
    if path not in probe_files():
        raise ValueError(f"no agent probe named {probe!r} in {_HERE}")
    needs = "".join(_probe_call(p) for p in _with_needs(probe) if p != path)
    return _core() + "\n" + needs + f"exec({call!r}, {_probe_call(path).rstrip()}.__dict__)\n"


@functools.lru_cache(maxsize=1)
def agent_needs() -> tuple[str, ...]:
    """Return the modules the agent cannot start without: the core files' imports and zlib.

    Read from the core's own import lines, so the list cannot drift from the code.  Probes'
    imports are not in it: a probe whose module is missing is unavailable, not fatal.  `sys`
    is left out (every interpreter has it built in).
    """
    names = {"os", "zlib"}  # the bootstrap's
    for name in CORE_FILES:
        tree = ast.parse((_HERE / name).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    names -= {"pytest_gpuhost", "__future__", "sys"}
    return tuple(sorted(names))


@functools.lru_cache(maxsize=1)
def agent_payload() -> bytes:
    """Return the bytes written to the bootstrap's stdin: length line, compressed program."""
    body = zlib.compress(agent_source().encode("utf-8"), 9)
    return b"%d\n" % len(body) + body

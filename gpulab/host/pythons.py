"""The node's Python in a lab host (profile key ``node_python``): what ``python3`` is, and where.

Real nodes do not all have the lab machine's Debian ``python3``; each shape here is built from
real interpreters, never from a script that imitates one (docs/LAB-SOURCES.md):

- ``system``: this machine's ``/usr/bin/python3`` (Debian's CPython 3.11).
- ``cpython-3.6``: ``python3`` is a real CPython 3.6.15 (the agent's floor), this machine's pyenv
  build under ``/root/.pyenv/versions``; nothing else changes.
- ``minimal``: ``python3`` and ``python3.11`` are Debian's CPython with exactly the standard
  library that Debian's ``libpython3.11-minimal`` package installs (``dpkg -L``): no ``json``,
  ``ctypes``, ``statistics`` or ``queue``, as on a node with only ``python3-minimal``.
- ``python2``: ``python3`` is a real CPython 2.7.18 (pyenv), and the system's ``python3`` and
  ``python3.11`` are gone.
- ``platform-python``: no ``python3`` at all, only ``/usr/libexec/platform-python`` (RHEL 8's
  layout; there it is CPython 3.6.8, here the real 3.6.15).
- ``none``: no Python anywhere the node's users would look.

In every shape but ``system`` the lab's own tools in the host (nvidia-smi, dmesg,
nvidia-persistenced, pct: Python scripts) run under a copy of the system's interpreter at
``LAB_PYTHON``, a path no node has (their ``#!/usr/bin/python3`` lines are rewritten to it), so
they work whatever the node's ``python3`` is; a profile's service may run under it too, as an
inference server runs under its own virtualenv's interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from gpulab.errors import LabError
from gpulab.host.layer import HOST_TOOL_PATHS, TOOL_PATHS
from gpulab.profiles.python_variants import LAB_PYTHON, SHAPES

__all__ = ["HIDES", "LAB_PYTHON", "PYENV", "SHAPES", "install_node_python", "minimal_stdlib", "missing"]

#: Shapes that remove the system's python3 and python3.11.
HIDES = ("python2", "platform-python", "none")
#: Real CPython builds on this machine (pyenv, in the machine's image); a shape that needs one
#: that is missing cannot be built (`missing`), and its tests skip saying so.
PYENV = Path("/root/.pyenv/versions")
INTERPRETERS = {
    "cpython-3.6": PYENV / "3.6.15/bin/python3.6",
    "platform-python": PYENV / "3.6.15/bin/python3.6",
    "python2": PYENV / "2.7.18/bin/python2.7",
}
SYSTEM_PYTHON = Path("/usr/bin/python3.11")
MINIMAL_HOME = "usr/local/lib/gpulab-python-minimal"  # the minimal layout: bin/python3.11, lib/python3.11
MINIMAL_PACKAGE = "libpython3.11-minimal"
STDLIB = "/usr/lib/python3.11/"


def missing(shape: str) -> str | None:
    """Say what this machine lacks to build `shape` in a lab host, or None when it has it all."""
    if shape not in SHAPES:
        return f"unknown node_python {shape!r} (one of {', '.join(SHAPES)})"
    need = INTERPRETERS.get(shape)
    if need is not None and not os.access(need, os.X_OK):
        return f"node_python {shape} needs a real interpreter at {need}, which this machine lacks"
    if shape in ("minimal", *HIDES) and not SYSTEM_PYTHON.is_file():
        return f"node_python {shape} needs {SYSTEM_PYTHON}"
    if shape == "minimal" and shutil.which("dpkg") is None:
        return f"node_python minimal needs dpkg (the file list of {MINIMAL_PACKAGE})"
    return None


def _minimal_files() -> list[str]:
    out = subprocess.run(["dpkg", "-L", MINIMAL_PACKAGE], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise LabError(f"dpkg -L {MINIMAL_PACKAGE}: {out.stderr.strip() or out.returncode}")
    return [p for p in out.stdout.splitlines() if p.startswith(STDLIB) and os.path.isfile(p)]


def minimal_stdlib(home: Path) -> Path:
    """Lay out Debian's python3-minimal under `home` and return its interpreter.

    `home/bin/python3.11` is a copy of Debian's interpreter binary (a copy, not a link: CPython
    finds its standard library from where the binary is, following links); `home/lib/python3.11`
    holds a link to each file of ``libpython3.11-minimal`` and nothing else, so CPython's
    landmark search (``lib/python3.11/os.py`` above the binary) makes `home` its prefix.  The
    links are absolute: a lab host sees this machine's /usr through its overlay root. The
    modules are byte-compiled there, as Debian's install does.
    """
    binary = home / "bin/python3.11"
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(SYSTEM_PYTHON, binary)
    lib = home / "lib/python3.11"
    for path in _minimal_files():
        dst = lib / path[len(STDLIB) :]
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.is_symlink():
            dst.symlink_to(path)
    (lib / "lib-dynload").mkdir(parents=True, exist_ok=True)
    # Debian byte-compiles the standard library when the package is installed (the postinst's
    # py3compile; the .pyc are in no package's file list): without them a node's first import
    # would write __pycache__, a write no real node of this shape sees.
    subprocess.run(
        [str(SYSTEM_PYTHON), "-m", "compileall", "-q", "-j", "0", str(lib)], check=True, timeout=300
    )
    return binary


def _link(root: Path, rel: str, target: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    path.symlink_to(target)


def _hide(root: Path, rel: str) -> None:
    # `root` is the layer's build overlay over this machine's /: removing a file there leaves a
    # whiteout in the layer, so the host does not see it.
    path = root / rel
    if path.is_symlink() or path.exists():
        path.unlink()


def install_node_python(root: Path, shape: str) -> None:
    """Give the lab host whose layer is being built at `root` the node Python `shape`.

    Runs after `layer.install_tools`: where the shape removes the system's interpreter, the lab's
    own scripts it put in the layer move to LAB_PYTHON.
    """
    why = missing(shape)
    if why:
        raise LabError(why)
    if shape == "system":
        return
    # The lab's own tools, and a service that brings its own interpreter (as a venv does),
    # run under a copy of the system's at LAB_PYTHON, whatever the node's python3 is.
    lab_python = root / LAB_PYTHON
    lab_python.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(SYSTEM_PYTHON, lab_python)
    for rel in (*TOOL_PATHS.values(), *HOST_TOOL_PATHS):
        _point_at_lab_python(root / rel)
    if shape in HIDES:
        for rel in ("usr/bin/python3", "usr/bin/python3.11"):
            _hide(root, rel)
    if shape == "cpython-3.6" or shape == "python2":
        _link(root, "usr/local/bin/python3", str(INTERPRETERS[shape]))
    elif shape == "platform-python":
        _link(root, "usr/libexec/platform-python", str(INTERPRETERS[shape]))
    elif shape == "minimal":
        minimal_stdlib(root / MINIMAL_HOME)
        for name in ("python3", "python3.11"):
            _link(root, f"usr/local/bin/{name}", f"/{MINIMAL_HOME}/bin/python3.11")


def _point_at_lab_python(path: Path) -> None:
    old = b"#!/usr/bin/python3"
    try:
        data = path.read_bytes()
    except OSError:
        return
    if data.startswith(old) and data[len(old) : len(old) + 1] in (b"\n", b" "):
        path.write_bytes(b"#!/" + LAB_PYTHON.encode() + data[len(old) :])

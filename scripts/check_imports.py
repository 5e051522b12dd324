#!/usr/bin/env python3
"""Print import cycles, layer violations and oversized modules in `pytest_gpuhost/`, `suites/`, `gpulab/`.

Every import counts, at module level or inside a function, `importlib.import_module("...")` with a
literal name included: a cycle hidden in a function is still a cycle a reader has to hold in mind.

Layers, lowest first; a module may import only from its own layer or below:

    base      pytest_gpuhost.errors, pytest_gpuhost.redact, pytest_gpuhost.values
    exec      pytest_gpuhost.exec.*           (reaches targets; never imports pytest)
    modules   pytest_gpuhost.modules.*        (host knowledge; never imports pytest)
    run       pytest_gpuhost.run.*, hookspec  (the pytest side)
    report    pytest_gpuhost.report.*
    plugin    pytest_gpuhost.plugin, pytest_gpuhost.nodecheck, pytest_gpuhost.merge, suites.*

gpulab/ has layers of its own, lowest first (no module of the plugin or the suites may import it):

    lab-base  gpulab.errors, gpulab.profiles.types, gpulab.kernel.acs (pure rules over a profile)
    profiles  gpulab.profiles.*                (load and validate; the variants)
    kernel    gpulab.kernel.*                  (the emulated kernel, served over FUSE)
    host      gpulab.host.*, gpulab.nvml       (lab hosts as machines)
    lab       gpulab.slurm.*, gpulab.vm, gpulab.pytest_fixtures, gpulab.__main__, gpulab

Inside exec, `pytest_gpuhost.exec.inventory` sits above the rest of exec. The lab may use the
plugin's modules (it drives hosts as the plugin does) but never a suite: what a suite and the lab
share lives in `pytest_gpuhost.modules`.
Exit 1 when a problem is found, so CI can run it. A module over `--max-lines N` (default 500) is a
warning only: a module grows until it holds two ideas, and then splits along them.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pytest_gpuhost", "suites", "gpulab")
LAYERS = ("base", "exec", "modules", "run", "report", "plugin")
LAB_LAYERS = ("lab-base", "profiles", "kernel", "host", "lab")
NO_PYTEST = ("exec", "modules", "base")
# Inside exec, the inventory (which hosts, from files and ranges) is built on the rest (targets,
# host names, transports); nothing else in exec imports it.
UPPER_EXEC = "pytest_gpuhost.exec.inventory"


def in_package(mod: str, package: str) -> bool:
    return mod == package or mod.startswith(package + ".")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def lab_layer(mod: str) -> str:
    if mod in ("gpulab.errors", "gpulab.profiles.types", "gpulab.kernel.acs"):
        return "lab-base"
    for name, pkgs in (("profiles", ("profiles",)), ("kernel", ("kernel",)), ("host", ("host", "nvml"))):
        if any(mod == f"gpulab.{p}" or mod.startswith(f"gpulab.{p}.") for p in pkgs):
            return name
    return "lab"


def layer(mod: str) -> str:
    if mod in ("pytest_gpuhost.errors", "pytest_gpuhost.redact", "pytest_gpuhost.values", "pytest_gpuhost"):
        return "base"
    for name in ("exec", "modules", "run", "report"):
        if mod == f"pytest_gpuhost.{name}" or mod.startswith(f"pytest_gpuhost.{name}."):
            return name
    if mod == "pytest_gpuhost.hookspec":
        return "run"
    return "plugin"


def imports_of(path: Path, mod: str, known: set[str]) -> set[str]:
    """Return the project modules `path` imports (resolved to the longest known module name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != mod:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in known else base)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value)
    return found


def uses_pytest(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] in ("pytest", "_pytest") for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("pytest", "_pytest"):
            return True
    return False


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-lines", type=int, default=500)
    args = ap.parse_args(argv)
    paths = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    known = set(paths)
    graph = {mod: imports_of(path, mod, known) for mod, path in paths.items()}
    problems: list[str] = []
    for comp in cycles(graph):
        problems.append("cycle: " + " <-> ".join(comp))
    for mod, deps in sorted(graph.items()):
        mine = LAYERS.index(layer(mod))
        for dep in sorted(deps):
            if mod.startswith(("pytest_gpuhost", "gpulab")) and dep.startswith("suites"):
                problems.append(f"layer: {mod} imports the suite module {dep}")
            elif mod.startswith(("pytest_gpuhost", "suites")) and dep.startswith("gpulab"):
                problems.append(f"layer: {mod} imports the lab module {dep} (the plugin knows no lab)")
            elif mod.startswith("gpulab") and dep.startswith("gpulab"):
                if LAB_LAYERS.index(lab_layer(dep)) > LAB_LAYERS.index(lab_layer(mod)):
                    problems.append(f"layer: {mod} ({lab_layer(mod)}) imports {dep} ({lab_layer(dep)})")
            elif LAYERS.index(layer(dep)) > mine:
                problems.append(f"layer: {mod} ({layer(mod)}) imports {dep} ({layer(dep)})")
            elif in_package(dep, UPPER_EXEC) and layer(mod) == "exec" and not in_package(mod, UPPER_EXEC):
                problems.append(f"layer: {mod} (exec) imports {dep} ({UPPER_EXEC}, above the rest of exec)")
        if layer(mod) in NO_PYTEST and uses_pytest(paths[mod]):
            problems.append(f"layer: {mod} ({layer(mod)}) imports pytest")
    warnings = []
    for _mod, path in sorted(paths.items()):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > args.max_lines:
            warnings.append(
                f"warning: {path.relative_to(ROOT)} has {n} lines: split it where it holds two ideas"
            )
    for line in problems + warnings:
        print(line)
    print(f"check_imports: {len(paths)} modules, {len(problems)} problem(s), {len(warnings)} warning(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

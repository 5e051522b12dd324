"""Every module, function, class and path the prose names exists.

The prose is docs/*.md, README.md (the CHANGELOG is history and keeps old names) and the
docstrings of pytest_gpuhost/, suites/ and gpulab/. The rule, for what reads as a name of ours:

- a repo path (`pytest_gpuhost/...`, `suites/...`, `gpulab/...`, `fixtures/...`, `docs/...`, ...,
  or `modules/...`, `exec/...`, `run/...`, `report/...` under pytest_gpuhost/) exists, as a file,
  a folder, the same with `.py`, or a prefix of one (`fixtures/outputs/kernlog-xid-*`); a
  `.name` after a module's path (`modules/backup/destination.per_target`) is defined there;
  `NAME`, `ID`, `N` and `<name>` stand for any one component, `{x}` likewise;
- a dotted name that starts with a package of ours (`pytest_gpuhost.run.remediation.Check`) is a
  module, and what follows it is defined in that module;
- a dotted name whose first part is a module of ours with an underscore in its name
  (`xid_catalogue.CATALOGUE`) is defined in one module of that name; one named like a module of
  a package's old flat layout (`health_xid.settle`, now `health/xid.py`) is stale;
- a bare `x.py` is some file of the repo.

"Defined" is read from the module's source (a def, class, assignment or import, at the top or
in a class), so nothing is imported. Names of other projects' files and fields (nvidia-smi's
`reset_status.reset_required`, SGLang's `server_args.py`) match none of these shapes or are
listed in NOT_OURS with the reason.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKGS = ("pytest_gpuhost", "suites", "gpulab")
# the installed names (pyproject's package-dir) of what the checkout holds elsewhere
INSTALLED = {"gpuhost_suites/manifests": "fixtures/manifests", "gpuhost_suites": "suites"}
TOPS = (*PKGS, "gpuhost_suites", "docs", "tests", "scripts", "benchmarks", "deploy", "fixtures", ".ci")
SUBS = ("modules", "exec", "run", "report")  # short forms of pytest_gpuhost/<sub>/...
PLACEHOLDER = re.compile(r"\b(?:NAME|ID|N)\b|<[^>]*>|\{[^}]*\}")
EXTS = {"py", "md", "json", "yml", "yaml", "cpp", "h", "toml", "txt", "sh", "cfg", "ini", "html", "xml"}

_ROOTS = "|".join(map(re.escape, TOPS + SUBS))
PATH_RE = re.compile(r"(?<![\w./-])((?:" + _ROOTS + r")/[\w./*{}<>-]*[\w*}>])")
PYFILE_RE = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.py)\b(?!::)")
DOTTED_RE = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w/-])")

# (where, name): why it is not a name of ours
NOT_OURS = {
    ("docs/FACTS.md", "server_args.py"): "SGLang's file",
    ("docs/SSH.md", "pytest_gpuhost.paramiko"): "a logger's name",
    ("docs/INTERNALS.md", "suites.x"): "the import a suite never writes",
    ("gpulab/host/cgroups.py", "gpulab/NAME/lxc/ID"): "a cgroup, not a file",
    ("gpulab/host/lab.py", "gpulab/NAME/lxc/ID"): "a cgroup, not a file",
    ("pytest_gpuhost/run/record.py", "suites/x/test_a.py"): "an example node id",
}


def prose() -> Iterator[tuple[str, str]]:
    """Yield (where, text): each doc, and each docstring of the three packages."""
    for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        yield str(p.relative_to(ROOT)), p.read_text()
    for pkg in PKGS:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        yield str(p.relative_to(ROOT)), doc


@functools.cache
def modules_named() -> dict[str, list[Path]]:
    named: dict[str, list[Path]] = {}
    for pkg in PKGS:
        for p in (ROOT / pkg).rglob("*.py"):
            named.setdefault(p.parent.name if p.stem == "__init__" else p.stem, []).append(p)
    return named


@functools.cache
def file_names() -> frozenset[str]:
    names: set[str] = set()
    for _folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "node_modules")]
        names.update(f for f in files if f.endswith(".py"))
    return frozenset(names)


@functools.cache
def package_names() -> frozenset[str]:
    return frozenset(p.parent.name for p in (ROOT / "pytest_gpuhost").rglob("__init__.py"))


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, (ast.If, ast.Try)):
        return [n for child in node.body for n in _names(child)]
    return []


def defined(path: Path, chain: list[str]) -> bool:
    """Say whether `a.b` of `chain` is defined in the module at `path` (or its `__all__`)."""
    body: list[ast.stmt] = _tree(path).body
    for depth, name in enumerate(chain):
        found = next((n for n in body if name in _names(n)), None)
        if found is None:
            exported = depth == 0 and any("__all__" in _names(n) and name in ast.unparse(n) for n in body)
            return exported and len(chain) == 1
        body = getattr(found, "body", [])
    return True


def _module_path(base: Path) -> Path | None:
    for mod in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if mod.exists():
            return mod
    return None


def path_exists(token: str) -> bool:
    token = re.sub(r"(::.*|:\d+)$", "", token)
    for installed, here in INSTALLED.items():
        if token == installed or token.startswith(installed + "/"):
            token = here + token[len(installed) :]
            break
    token = "/".join("*" if PLACEHOLDER.fullmatch(c) else PLACEHOLDER.sub("*", c) for c in token.split("/"))
    bases = [ROOT, ROOT / "pytest_gpuhost"] if token.split("/")[0] in SUBS else [ROOT]
    for base in bases:
        if "*" in token:
            if any(base.glob(token)) or any(base.glob(token + ".py")):
                return True
            continue
        p = base / token
        if p.exists() or p.with_name(p.name + ".py").exists() or any(p.parent.glob(p.name + "*")):
            return True
        head, _, attrs = p.name.partition(".")
        mod = _module_path(p.with_name(head))
        if attrs and mod is not None and defined(mod, attrs.split(".")):
            return True
    return False


def dotted_exists(token: str) -> bool | None:
    """Say whether a dotted name of ours exists; None where it is not a name of ours."""
    parts = token.split(".")
    if parts[-1] in EXTS:
        return None  # a file name
    if parts[0] in (*PKGS, "gpuhost_suites"):
        parts[0] = "suites" if parts[0] == "gpuhost_suites" else parts[0]
        if PLACEHOLDER.fullmatch(parts[-1]):
            parts.pop()
        for i in range(len(parts), 0, -1):
            mod = _module_path(ROOT.joinpath(*parts[:i]))
            if mod is not None:
                return i == len(parts) or defined(mod, parts[i:])
        return False
    first = parts[0]
    if "_" not in first.strip("_"):
        return None  # a variable, a standard module, a field of a tool's output
    if first in modules_named():
        return any(defined(m, parts[1:]) for m in modules_named()[first])
    if first.split("_")[0] in package_names():
        return False  # the old flat name of a module now in that package
    return None


def stale_names() -> list[str]:
    stale = []
    for where, text in prose():
        found = [(m.group(1), path_exists(m.group(1))) for m in PATH_RE.finditer(text)]
        found += [(m.group(1), m.group(1) in file_names()) for m in PYFILE_RE.finditer(text)]
        found += [(m.group(1), dotted_exists(m.group(1)) is not False) for m in DOTTED_RE.finditer(text)]
        stale += [f"{where}: {name}" for name, ok in found if not ok and (where, name) not in NOT_OURS]
    return sorted(set(stale))


def test_every_name_in_the_prose_exists() -> None:
    stale = stale_names()
    assert not stale, f"{len(stale)} stale name(s) in docs or docstrings:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    ("text", "stale"),
    [
        ("see `suites/p2p/state.py`", True),
        ("see `suites/p2p/options.py`", False),
        ("`modules/destination.per_target`", True),
        ("`modules/backup/destination.per_target`", False),
        ("`modules/backup/destination.no_such_thing`", True),
        ("settled (health_xid.settle)", True),
        ("pytest_gpuhost.run.remediation.Remediation", False),
        ("pytest_gpuhost.run.remediation.Nope", True),
        ("fixtures/profiles/schema.yaml", True),
        ("fixtures/profiles/NAME.yaml", False),
        ("gpulab/profiles/schema.yaml", False),
        ("in ssh.py", True),
        ("nvidia-smi's reset_status.reset_required", False),
    ],
)
def test_the_rule_finds_a_stale_name(text: str, stale: bool) -> None:
    found = [not path_exists(m.group(1)) for m in PATH_RE.finditer(text)]
    found += [m.group(1) not in file_names() for m in PYFILE_RE.finditer(text)]
    found += [dotted_exists(m.group(1)) is False for m in DOTTED_RE.finditer(text)]
    assert any(found) == stale, (text, found)

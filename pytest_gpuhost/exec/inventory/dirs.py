"""`group_vars/` and `host_vars/` next to an inventory, read as Ansible's host_group_vars plugin does.

For a group or host NAME, the first of `NAME` (a file or a directory), `NAME.yml`, `NAME.yaml`,
`NAME.json` that exists is used; a directory contributes every YAML/JSON file below it (hidden
ones skipped), merged in sorted path order, later files winning. Each directory is listed once,
so 50,000 hosts cost no 200,000 lookups. A file that names no group or host of the inventory is
reported (Ansible ignores it silently; here it is a warning, with the closest name).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.inventory.formats import load_yaml
from pytest_gpuhost.exec.inventory.model import Model

__all__ = ["load_vars_dirs"]

_EXTS = (".yml", ".yaml", ".json")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TargetError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise TargetError(f"{path}: cannot read ({exc.strerror})") from None


def _files_below(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if not f.startswith(".") and (os.path.splitext(f)[1] in _EXTS or "." not in f):
                out.append(Path(dirpath) / f)
    return sorted(out)


def _load_one(model: Model, kind: str, name: str, paths: list[Path]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for path in paths:
        data = load_yaml(path, _read(path))
        if data is not None and not isinstance(data, dict):
            raise TargetError(
                f"{path}: expected a mapping of variable names to values, got {type(data).__name__}"
            )
        model.set_vars(merged, data, str(path), f"{kind} {name!r}")
    return merged


def _load_dir(model: Model, root: Path, kind: str, names: Collection[str]) -> dict[str, dict[str, Any]]:
    try:
        entries = {e.name: e.is_dir() for e in os.scandir(root)}
    except FileNotFoundError:
        return {}
    except NotADirectoryError:
        raise TargetError(f"{root}: expected a directory of {kind} variable files") from None
    except OSError as exc:
        raise TargetError(f"{root}: cannot list ({exc.strerror})") from None
    ranked: dict[str, tuple[int, str]] = {}  # name -> (rank, entry): NAME 0, .yml 1, .yaml 2, .json 3
    for entry, is_dir in entries.items():
        if entry.startswith("."):
            continue
        stem, ext = os.path.splitext(entry)
        cands = [(entry, 0)] + ([(stem, 1 + _EXTS.index(ext))] if ext in _EXTS and not is_dir else [])
        for cand, rank in cands:
            if cand in names and (cand not in ranked or rank < ranked[cand][0]):
                ranked[cand] = (rank, entry)
    chosen = {name: entry for name, (_, entry) in ranked.items()}
    used = set(chosen.values())
    for entry, is_dir in sorted(entries.items()):
        stem, ext = os.path.splitext(entry)
        if entry.startswith(".") or entry in used or not (is_dir or ext in _EXTS):
            continue
        wanted = stem if ext in _EXTS and not is_dir else entry
        if wanted in chosen:
            why = f"{chosen[wanted]} is read for {kind} {wanted!r}, not this file (Ansible reads only the first)"
        else:
            close = (
                difflib.get_close_matches(wanted, list(names), n=1, cutoff=0.8) if len(names) < 5000 else []
            )
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            why = f"no {kind} {wanted!r} in the inventory{hint}"
        model.notes.append(f"{root / entry}: {why}; ignored")
    out = {}
    for name, entry in chosen.items():
        path = root / entry
        paths = _files_below(path) if entries[entry] else [path]
        out[name] = _load_one(model, kind, name, paths)
    return out


def load_vars_dirs(model: Model, base: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Return (group vars, host vars) read from `base/group_vars` and `base/host_vars`."""
    return (
        _load_dir(model, base / "group_vars", "group", model.groups.keys()),
        _load_dir(model, base / "host_vars", "host", model.hosts.keys()),
    )

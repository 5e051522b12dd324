"""Load target inventories as Ansible does: YAML, INI, `ansible-inventory --list` JSON, vars directories.

Or through Ansible itself (`inventory.ansible`): plugin configs always, any source with
`--inventory-reader=ansible`.

YAML::

    all:
      vars: {ansible_user: root}
      children:
        proxmox:
          vars: {container: "pct:101"}
          hosts:
            gpu-01: {ansible_host: 198.18.1.2, gpu_count: 8}
            node[02:04]: {}                      # ranges expand to node02, node03, node04

INI::

    gpu-00 ansible_host=198.18.9.2            # before any section: group "ungrouped"
    [proxmox]
    gpu-01 ansible_host=198.18.1.2 ansible_port=2222 gpu_count=8
    [proxmox:vars]
    container=pct:101
    [fleet:children]
    proxmox

JSON: what `ansible-inventory -i SOURCE --list` prints (so any dynamic inventory, exported to a
file); see `inventory.formats`. `group_vars/` and `host_vars/` next to the file are read as
Ansible reads them (`inventory.dirs`), and variables merge in Ansible's order (`inventory.model`):
inventory `all` < inventory groups < `group_vars/all` < `group_vars/GROUP` < inventory host <
`host_vars/HOST`. Connection variables (`ansible_host`, `ansible_ssh_*`, `ansible_become*`, ...)
become the target's URL (`inventory.vars`); host names and ranges are checked in `inventory.names`
(at most 100,000 hosts; names with markup or control characters are refused).

The expected GPU count is `gpu_count` (`expected_gpus` is accepted as an alias). Every spec's
`vars["groups"]` lists its groups, sorted. `select_targets` applies a `--limit` pattern
(`inventory.pattern`: Ansible's syntax and `and`/`or`/`not`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.inventory.ansible import READERS, is_plugin_config, list_inventory
from pytest_gpuhost.exec.inventory.dirs import load_vars_dirs
from pytest_gpuhost.exec.inventory.formats import (
    is_script_json,
    load_yaml,
    read_ini,
    read_json,
    read_script,
    read_yaml,
)
from pytest_gpuhost.exec.inventory.model import Model
from pytest_gpuhost.exec.inventory.names import MAX_HOSTS
from pytest_gpuhost.exec.inventory.pattern import HostPattern, PatternError, compile_pattern
from pytest_gpuhost.exec.inventory.vars import KeyCheck
from pytest_gpuhost.exec.targets import TargetSpec

__all__ = [
    "MAX_HOSTS",
    "HostPattern",
    "Inventory",
    "InventoryWarning",
    "PatternError",
    "compile_pattern",
    "load_inventory",
    "read_inventory",
    "select_targets",
]


class InventoryWarning(UserWarning):
    """Something in an inventory is probably a mistake but is kept (a misspelled variable name)."""


@dataclass
class Inventory:
    """What one inventory gave: its targets, and one line per thing that looks like a mistake."""

    path: Path
    specs: list[TargetSpec]
    warnings: list[str]


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TargetError(f"inventory file {p} not found") from None
    except IsADirectoryError:
        raise TargetError(
            f"inventory {p} is a directory, not a file (--inventory-reader=ansible reads directories)"
        ) from None
    except OSError as exc:
        raise TargetError(f"cannot read inventory {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TargetError(f"inventory {p} is not UTF-8 text") from None


def _looks_ini(text: str) -> bool:
    """Return whether text without a telling suffix is INI: its first line is no YAML key or document."""
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith(("#", ";")):
            continue
        return not (s.startswith(("{", "---", "- ")) or _YAML_KEY.match(s))
    return False


_YAML_KEY = re.compile(r"^[^\s:#\[]+:(?:\s|$)")  # `all:` (INI's `host:port` has no space after the colon)


def read_inventory(path: str | Path, known_vars: Iterable[str] = (), reader: str = "auto") -> Inventory:
    """Load an inventory and the vars directories next to it; nothing is printed.

    `known_vars` adds variable names (e.g. the health thresholds) to those a misspelling is
    compared with. `reader` says who reads it (`inventory.ansible`): `auto` this project's
    readers, Ansible for a plugin config; `ansible` Ansible for any source; `builtin` never Ansible.
    """
    if reader not in READERS:
        raise TargetError(f"inventory reader {reader!r}: choose one of {', '.join(READERS)}")
    p = Path(path)
    check = KeyCheck(known_vars)
    try:
        if reader == "ansible":
            return _from_ansible(p, check)
        return _read(p, _read_text(p), check, ansible_plugins=reader == "auto")
    except RecursionError:  # a hostile file nesting groups thousands deep
        raise TargetError(f"inventory {p}: groups or values are nested too deeply") from None


def _from_ansible(p: Path, check: KeyCheck) -> Inventory:
    """Read what `ansible-inventory --list` makes of `p`; its hostvars already hold the vars directories."""
    model = Model(f"inventory {p}", check)
    read_script(model, p, list_inventory(p))
    specs = model.specs({}, {})
    return Inventory(p, specs, model.notes + check.warnings())


def _read(p: Path, text: str, check: KeyCheck, ansible_plugins: bool = False) -> Inventory:
    model = Model(f"inventory {p}", check)
    suffix = p.suffix.lower()
    if suffix in (".ini", ".cfg", ".hosts") or (
        suffix not in (".yaml", ".yml", ".json") and _looks_ini(text)
    ):
        read_ini(model, p, text)
    else:
        data = read_json(p, text) if suffix == ".json" else load_yaml(p, text)
        if is_script_json(data):
            read_script(model, p, data)
        elif is_plugin_config(data):
            if not ansible_plugins:
                raise TargetError(
                    f"inventory {p}: an Ansible inventory plugin config (plugin: {data['plugin']}); "
                    "only Ansible reads it (--inventory-reader=auto or ansible)"
                )
            return _from_ansible(p, check)
        else:
            read_yaml(model, p, data)
    group_files, host_files = load_vars_dirs(model, p.parent)
    specs = model.specs(group_files, host_files)
    return Inventory(p, specs, model.notes + check.warnings())


def load_inventory(
    path: str | Path, known_vars: Iterable[str] = (), reader: str = "auto"
) -> list[TargetSpec]:
    """Load an inventory; one TargetSpec per host. Each warning is issued as an InventoryWarning."""
    inv = read_inventory(path, known_vars, reader)
    for line in inv.warnings:
        warnings.warn(line, InventoryWarning, stacklevel=2)
    return inv.specs


def select_targets(specs: Iterable[TargetSpec], expr: str | None) -> list[TargetSpec]:
    """Return the specs a `--limit` pattern selects (all of them for no pattern).

    Raise PatternError (a TargetError) naming the term when a term matches nothing.
    """
    if not expr:
        return list(specs)
    return compile_pattern(expr).select(specs)

"""Inventory readers: Ansible YAML, Ansible INI and `ansible-inventory --list` JSON, into a Model.

`ansible-inventory -i SOURCE --list > fleet.json` exports any inventory, dynamic ones (cloud
plugins, scripts) included, in the JSON read here::

    {"_meta": {"hostvars": {"gpu-01": {"ansible_host": "198.18.1.2"}}},
     "all": {"children": ["ungrouped", "rack1"]},
     "rack1": {"hosts": ["gpu-01"], "vars": {"temperature_max": 83}}}

(a group may also be a bare list of host names, as inventory scripts print). Errors name the file
and the line (INI, JSON syntax) or the key path (YAML, JSON structure).
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.inventory.model import Model

__all__ = ["is_script_json", "load_yaml", "read_ini", "read_script", "read_yaml"]

_BASE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 50,000 hosts in ~1 s, not ~8 s


class _Loader(_BASE_LOADER):  # type: ignore[misc,valid-type]
    """Safe YAML with Ansible's `!unsafe` (a plain string) and `!vault` (refused, one line)."""


class _VaultValue(TargetError):
    """An ansible-vault encrypted value, which this loader cannot decrypt."""


def _unsafe(loader: Any, node: yaml.Node) -> Any:
    return loader.construct_scalar(node)


def _vault(loader: Any, node: yaml.Node) -> Any:
    raise _VaultValue(
        f"line {node.start_mark.line + 1}: an ansible-vault value (!vault) cannot be read; decrypt it"
    )


_Loader.add_constructor("!unsafe", _unsafe)
_Loader.add_constructor("!vault", _vault)


def load_yaml(path: Path | str, text: str) -> Any:
    """Parse YAML (or JSON) text; raise TargetError naming the file and line."""
    if text.startswith("$ANSIBLE_VAULT"):
        raise TargetError(
            f"{path}: the file is encrypted with ansible-vault; decrypt it (ansible-vault view)"
        )
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except _VaultValue as exc:
        raise TargetError(f"{path} {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise TargetError(f"bad YAML in inventory {path}{where}: {problem}") from None


def read_yaml(model: Model, path: Path, data: Any) -> None:
    """Fill `model` from Ansible's YAML inventory structure (groups with hosts/vars/children)."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise TargetError(f"inventory {path}: the top level must be a mapping of groups (e.g. 'all:')")

    def walk(gname: str, body: Any, parent: str | None, at: str) -> None:
        where = f"inventory {path}: {at}"
        model.group(gname, where)
        if parent is not None:
            model.add_child(parent, gname, where)
        if body is None:
            return
        if not isinstance(body, dict):
            raise TargetError(f"{where}: a group must be a mapping with hosts, vars, children")
        unknown = set(body) - {"hosts", "vars", "children"}
        if unknown:
            raise TargetError(
                f"{where}: group {gname!r} has unknown key(s) {', '.join(sorted(map(str, unknown)))}"
                " (expected hosts, vars, children)"
            )
        model.set_vars(model.groups[gname].vars, body.get("vars"), f"{where}.vars", f"group {gname!r}")
        hosts = body.get("hosts") or {}
        if isinstance(hosts, list):  # a list of names is a common shorthand
            hosts = dict.fromkeys(hosts)
        if not isinstance(hosts, dict):
            raise TargetError(f"{where}.hosts: expected a mapping of host names")
        for hname, hvars in hosts.items():
            model.add_hosts(gname, str(hname), hvars, f"{where}.hosts")
        children = body.get("children") or {}
        if not isinstance(children, dict):
            raise TargetError(f"{where}.children: expected a mapping of group names")
        for cname, cbody in children.items():
            walk(str(cname), cbody, gname, f"{at}.children.{cname}")

    for gname, body in data.items():
        walk(str(gname), body, None, str(gname))


def is_script_json(data: Any) -> bool:
    """Return whether parsed data is `ansible-inventory --list` / inventory-script JSON."""
    if not isinstance(data, dict):
        return False
    if "_meta" in data:
        return True
    return any(
        isinstance(b, list) or (isinstance(b, dict) and isinstance(b.get("children"), list))
        for b in data.values()
    )


def read_script(model: Model, path: Path, data: dict[str, Any]) -> None:
    """Fill `model` from `ansible-inventory --list` JSON (groups list hosts; vars in `_meta`)."""
    meta = data.get("_meta") or {}
    if not isinstance(meta, dict) or not isinstance(meta.get("hostvars", {}), dict):
        raise TargetError(f"inventory {path}: _meta.hostvars must be a mapping of host names to vars")
    hostvars: dict[str, Any] = meta.get("hostvars") or {}
    pending: list[tuple[str, str]] = []
    for gname, body in data.items():
        if gname == "_meta":
            continue
        where = f"inventory {path}: {gname}"
        model.group(str(gname), where)
        if isinstance(body, list):
            body = {"hosts": body}
        if not isinstance(body, dict):
            raise TargetError(
                f"{where}: a group must be a list of hosts or a mapping with hosts, vars, children"
            )
        unknown = set(body) - {"hosts", "vars", "children"}
        if unknown:
            raise TargetError(
                f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))} (expected hosts, vars, children)"
            )
        for part in ("hosts", "children"):
            if not isinstance(body.get(part) or [], list):
                raise TargetError(f"{where}.{part}: expected a list of names")
        model.set_vars(model.groups[str(gname)].vars, body.get("vars"), f"{where}.vars", f"group {gname!r}")
        for hname in body.get("hosts") or []:
            hname = str(hname)
            model.add_hosts(str(gname), hname, hostvars.get(hname), f"{where}.hosts")
        pending.extend((str(gname), str(c)) for c in body.get("children") or [])
    for parent, child in pending:
        model.add_child(parent, child, f"inventory {path}: {parent}.children")
    for hname in hostvars:  # hosts only in _meta: Ansible lists them under all
        if str(hname) not in model.hosts:
            model.add_hosts("all", str(hname), hostvars[hname], f"inventory {path}: _meta.hostvars")


def read_json(path: Path, text: str) -> Any:
    """Parse JSON; raise TargetError naming the file and line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TargetError(f"bad JSON in inventory {path} line {exc.lineno}: {exc.msg}") from None


def _ini_value(text: str) -> Any:
    """Read an INI value as Ansible does (a Python literal, else the text), with yes/no as booleans."""
    if text.isdigit() and (text[0] != "0" or len(text) == 1):  # the common case, without the parser
        return int(text)
    first = text[:1]
    maybe_literal = first in ("'", '"', "[", "{", "(") or text in ("True", "False", "None")
    if first and first in "-+.0123456789" and text.count(".") < 2 and not _NOT_NUMBER.search(text):
        maybe_literal = True
    if maybe_literal:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    low = text.lower()
    return True if low in ("true", "yes") else False if low in ("false", "no") else text


_NOT_NUMBER = re.compile(r"[^0-9a-fA-FxXoObBjJ_.eE+-]")  # a character no Python number has
_IPV6_LINE = re.compile(
    r"\[[0-9A-Fa-f]*:[0-9A-Fa-f:.]*\](?::[0-9]+)?(?:\s|$)"
)  # a host `[fe80::1]:22`, no section
_QUOTING = re.compile(r"['\"\\#]")


def read_ini(model: Model, path: Path, text: str) -> None:
    """Fill `model` from Ansible INI: host lines, `[g]`, `[g:vars]`, `[g:children]`."""
    section, kind = "ungrouped", "hosts"
    pending_children: list[tuple[int, str, str]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        where = f"inventory {path} line {lineno}"
        bad = f"bad INI in {where}"
        if line.startswith("[") and not _IPV6_LINE.match(line):
            if not line.endswith("]") or len(line) < 3:
                raise TargetError(f"{bad}: unterminated section header {line!r}")
            section, _, kind = line[1:-1].strip().partition(":")
            kind = kind or "hosts"
            if kind not in ("hosts", "vars", "children"):
                raise TargetError(
                    f"{bad}: unknown section kind {kind!r} (use [group], [group:vars] or [group:children])"
                )
            model.group(section, where)
            continue
        if _QUOTING.search(line):  # shlex only where quoting needs it: 10x faster on plain lines
            try:
                words = shlex.split(line, comments=True)
            except ValueError as exc:
                raise TargetError(f"{bad}: {exc}") from None
        else:
            words = line.split()
        if not words:
            continue
        if kind == "vars":
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise TargetError(f"{bad}: expected key=value in [{section}:vars], got {line!r}")
            model.set_vars(
                model.groups[section].vars,
                {key.strip(): _ini_value(value.strip())},
                where,
                f"group {section!r}",
            )
        elif kind == "children":
            pending_children.append((lineno, section, words[0]))
        else:
            hvars: dict[str, Any] = {}
            for word in words[1:]:
                key, sep, value = word.partition("=")
                if not sep or not key:
                    raise TargetError(f"{bad}: expected key=value after the host name, got {word!r}")
                hvars[key] = _ini_value(value)
            model.add_hosts(section, words[0], hvars, where)
    for lineno, parent, child in pending_children:
        if child not in model.groups:
            raise TargetError(f"bad INI in inventory {path} line {lineno}: unknown child group {child!r}")
        model.add_child(parent, child, f"inventory {path} line {lineno}")

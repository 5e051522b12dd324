"""Load target inventories: Ansible-style YAML and Ansible INI, with groups and variables.

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

Variables merge as in Ansible: `all` < parent group < child group < host.  A host's URL is
`gpuhost_url` when set, `local://` for `ansible_connection=local`, else
`ssh://[ansible_user@]ansible_host[:ansible_port]`; `container` (or `gpuhost_container`) names
its container.  The expected GPU count is `gpu_count` (`expected_gpus` is accepted as an alias;
the health suite reads `gpu_count`).  Every spec's `vars["groups"]` lists its groups, sorted.  `select_targets`
filters by name or group the way `ansible --limit` does.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.targets import TargetSpec, parse_container, parse_host_url

__all__ = ["load_inventory", "select_targets"]

_RANGE = re.compile(r"\[([0-9]+):([0-9]+)\]|\[([a-z]):([a-z])\]")


class _Inv:
    def __init__(self, source: str) -> None:
        self.source = source
        self.group_vars: dict[str, dict[str, Any]] = {}
        self.group_children: dict[str, list[str]] = {}
        self.group_hosts: dict[str, list[str]] = {}
        self.host_vars: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []

    def group(self, name: str) -> None:
        self.group_vars.setdefault(name, {})
        self.group_children.setdefault(name, [])
        self.group_hosts.setdefault(name, [])

    def add_host(self, group: str, name: str, hvars: dict[str, Any]) -> None:
        self.group(group)
        if name not in self.host_vars:
            self.host_vars[name] = {}
            self.order.append(name)
        self.host_vars[name].update(hvars)
        if name not in self.group_hosts[group]:
            self.group_hosts[group].append(name)

    def specs(self) -> list[TargetSpec]:
        # Each host's groups, with their depth so child groups override parents.
        depth: dict[str, int] = {}
        parents: dict[str, set[str]] = {}
        for g, children in self.group_children.items():
            for c in children:
                if c not in self.group_vars:
                    raise TargetError(f"inventory {self.source}: group {g!r} lists unknown child group {c!r}")
                parents.setdefault(c, set()).add(g)

        def level(g: str, seen: tuple[str, ...] = ()) -> int:
            if g in seen:
                raise TargetError(f"inventory {self.source}: group {g!r} is its own ancestor")
            if g not in depth:
                depth[g] = 1 + max((level(p, (*seen, g)) for p in parents.get(g, ())), default=0)
            return depth[g]

        def ancestors(g: str) -> set[str]:
            out = {g}
            for p in parents.get(g, ()):
                out |= ancestors(p)
            return out

        specs = []
        for name in self.order:
            groups: set[str] = set()
            for g, hosts in self.group_hosts.items():
                if name in hosts:
                    groups |= ancestors(g)
            groups.discard("all")
            merged: dict[str, Any] = dict(self.group_vars.get("all", {}))
            for g in sorted(groups, key=lambda x: (level(x), x)):
                merged.update(self.group_vars.get(g, {}))
            merged.update(self.host_vars[name])
            if "gpu_count" not in merged and "expected_gpus" in merged:
                merged["gpu_count"] = merged["expected_gpus"]
            merged["groups"] = sorted(groups)
            specs.append(self._spec(name, merged))
        return specs

    def _spec(self, name: str, hv: dict[str, Any]) -> TargetSpec:
        try:
            url = hv.get("gpuhost_url")
            if not url:
                if hv.get("ansible_connection") == "local":
                    url = "local://"
                else:
                    addr = str(hv.get("ansible_host") or name)
                    if ":" in addr and not addr.startswith("["):
                        addr = f"[{addr}]"
                    user = hv.get("ansible_user")
                    port = hv.get("ansible_port")
                    url = "ssh://" + (f"{user}@" if user else "") + addr + (f":{port}" if port else "")
            spec = parse_host_url(str(url), name=name)
            spec.vars = hv
            container = hv.get("container") or hv.get("gpuhost_container")
            if container:
                spec.container = parse_container(str(container))
            return spec
        except TargetError as exc:
            raise TargetError(f"inventory {self.source}: host {name!r}: {exc}") from None


def _expand(pattern: str) -> list[str]:
    m = _RANGE.search(pattern)
    if not m:
        return [pattern]
    if m.group(1) is not None:
        lo, hi = m.group(1), m.group(2)
        width = len(lo) if lo.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        items = [chr(c) for c in range(ord(m.group(3)), ord(m.group(4)) + 1)]
    out = []
    for item in items:
        out.extend(_expand(pattern[: m.start()] + item + pattern[m.end() :]))
    return out


def _load_yaml(path: Path, text: str) -> _Inv:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise TargetError(f"bad YAML in inventory {path}{where}: {problem}") from None
    inv = _Inv(str(path))
    if data is None:
        return inv
    if not isinstance(data, dict):
        raise TargetError(f"inventory {path}: the top level must be a mapping of groups (e.g. 'all:')")
    inv.group("all")

    def walk(gname: str, body: Any, parent: str | None) -> None:
        inv.group(gname)
        if parent is not None and gname not in inv.group_children[parent]:
            inv.group_children[parent].append(gname)
        if body is None:
            return
        if not isinstance(body, dict):
            raise TargetError(f"inventory {path}: group {gname!r} must be a mapping with hosts/vars/children")
        unknown = set(body) - {"hosts", "vars", "children"}
        if unknown:
            raise TargetError(
                f"inventory {path}: group {gname!r} has unknown key(s) {', '.join(sorted(map(str, unknown)))}"
                " (expected hosts, vars, children)"
            )
        gv = body.get("vars") or {}
        if not isinstance(gv, dict):
            raise TargetError(f"inventory {path}: vars of group {gname!r} must be a mapping")
        inv.group_vars[gname].update(gv)
        hosts = body.get("hosts") or {}
        if isinstance(hosts, list):  # a list of names is a common shorthand
            hosts = {h: {} for h in hosts}
        if not isinstance(hosts, dict):
            raise TargetError(f"inventory {path}: hosts of group {gname!r} must be a mapping of names")
        for hname, hvars in hosts.items():
            if hvars is not None and not isinstance(hvars, dict):
                raise TargetError(f"inventory {path}: vars of host {hname!r} must be a mapping")
            for name in _expand(str(hname)):
                inv.add_host(gname, name, dict(hvars or {}))
        children = body.get("children") or {}
        if not isinstance(children, dict):
            raise TargetError(f"inventory {path}: children of group {gname!r} must be a mapping")
        for cname, cbody in children.items():
            walk(str(cname), cbody, gname)

    for gname, body in data.items():
        walk(str(gname), body, None if gname == "all" else "all")
    return inv


def _ini_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        low = text.lower()
        if low in ("true", "yes"):
            return True
        if low in ("false", "no"):
            return False
        return text


def _load_ini(path: Path, text: str) -> _Inv:
    inv = _Inv(str(path))
    inv.group("all")
    inv.group("ungrouped")
    inv.group_children["all"].append("ungrouped")
    section, kind = "ungrouped", "hosts"
    pending_children: list[tuple[int, str, str]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue

        def bad(why: str, lineno: int = lineno) -> TargetError:
            return TargetError(f"bad INI in inventory {path} line {lineno}: {why}")

        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise bad(f"unterminated section header {line!r}")
            name = line[1:-1].strip()
            section, _, kind = name.partition(":")
            kind = kind or "hosts"
            if kind not in ("hosts", "vars", "children"):
                raise bad(f"unknown section kind {kind!r} (use [group], [group:vars] or [group:children])")
            if not section or not re.match(r"^[A-Za-z0-9_.-]+$", section):
                raise bad(f"bad group name {section!r}")
            inv.group(section)
            if section not in ("all",) and section not in inv.group_children["all"]:
                inv.group_children["all"].append(section)
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise bad(str(exc)) from None
        if not words:
            continue
        if kind == "vars":
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise bad(f"expected key=value in [{section}:vars], got {line!r}")
            inv.group_vars[section][key.strip()] = _ini_value(value.strip())
        elif kind == "children":
            pending_children.append((lineno, section, words[0]))
        else:
            hvars: dict[str, Any] = {}
            for word in words[1:]:
                key, sep, value = word.partition("=")
                if not sep or not key:
                    raise bad(f"expected key=value after the host name, got {word!r}")
                hvars[key] = _ini_value(value)
            for name in _expand(words[0]):
                inv.add_host(section, name, hvars)
    for lineno, parent, child in pending_children:
        if child not in inv.group_vars:
            raise TargetError(f"bad INI in inventory {path} line {lineno}: unknown child group {child!r}")
        if child not in inv.group_children[parent]:
            inv.group_children[parent].append(child)
        if child in inv.group_children["all"] and parent != "all":
            inv.group_children["all"].remove(child)
    return inv


def load_inventory(path: str | Path) -> list[TargetSpec]:
    """Load a YAML or INI inventory (chosen by content and suffix); one TargetSpec per host."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TargetError(f"inventory file {p} not found") from None
    except IsADirectoryError:
        raise TargetError(f"inventory {p} is a directory, not a file") from None
    except OSError as exc:
        raise TargetError(f"cannot read inventory {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TargetError(f"inventory {p} is not UTF-8 text") from None
    is_ini = p.suffix.lower() in (".ini", ".cfg", ".hosts") or (
        p.suffix.lower() not in (".yaml", ".yml", ".json") and _looks_ini(text)
    )
    inv = _load_ini(p, text) if is_ini else _load_yaml(p, text)
    specs = inv.specs()
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:  # pragma: no cover - names are unique by construction
            raise TargetError(f"inventory {p}: host {spec.name!r} appears twice")
        seen.add(spec.name)
    return specs


def _looks_ini(text: str) -> bool:
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith(("#", ";")):
            continue
        return s.startswith("[") or ("=" in s and ":" not in s.split("=", 1)[0])
    return False


def select_targets(specs: Iterable[TargetSpec], expr: str | None) -> list[TargetSpec]:
    """Filter like `ansible --limit`: `a,b` union, `&g` must also match, `!g` excludes.

    Each term is a glob matched against the host name and each of its groups.
    """
    specs = list(specs)
    if not expr:
        return specs
    terms = [t.strip() for t in re.split(r"[,:]", expr) if t.strip()]

    def match(spec: TargetSpec, pat: str) -> bool:
        names = [spec.name, *spec.vars.get("groups", []), "all"]
        return any(fnmatch.fnmatchcase(n, pat) for n in names)

    plain = [t for t in terms if t[0] not in "!&"]
    required = [t[1:] for t in terms if t[0] == "&"]
    excluded = [t[1:] for t in terms if t[0] == "!"]
    out = []
    for spec in specs:
        if plain and not any(match(spec, t) for t in plain):
            continue
        if any(not match(spec, t) for t in required):
            continue
        if any(match(spec, t) for t in excluded):
            continue
        out.append(spec)
    return out

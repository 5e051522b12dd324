"""The inventory's groups and hosts, and the merge of their variables into one TargetSpec per host.

Every reader (YAML, INI, `ansible-inventory --list` JSON) fills a `Model`; `Model.specs` then
merges variables in Ansible's order (its default `VARIABLE_PRECEDENCE`), lowest first:

1. the inventory file's `all` vars, then each group's vars by depth (parents before children,
   then by name);
2. `group_vars/all`, then `group_vars/<group>` in the same order;
3. the inventory file's host vars, then `host_vars/<host>`.

So `group_vars/all.yml` overrides a `[rack1:vars]` line of the inventory file, as in Ansible.
Every structure is a dict (an ordered set where order matters), and the merged group variables
are computed once per distinct set of groups, so loading is linear in the number of hosts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.errors import TargetError
from pytest_gpuhost.exec.inventory.names import MAX_HOSTS, expand_host_key, valid_group_name
from pytest_gpuhost.exec.inventory.vars import KeyCheck, check_var_name, make_spec
from pytest_gpuhost.exec.targets import TargetSpec

__all__ = ["Group", "Model"]


@dataclass
class Group:
    """One inventory group: its own vars, and its direct children, parents and hosts."""

    name: str
    vars: dict[str, Any] = field(default_factory=dict)
    children: dict[str, None] = field(default_factory=dict)
    parents: dict[str, None] = field(default_factory=dict)
    hosts: dict[str, None] = field(default_factory=dict)


class Model:
    """Groups and hosts as read from one inventory source (`source` names it in every error)."""

    def __init__(self, source: str, check: KeyCheck) -> None:
        self.source = source
        self.check = check
        self.groups: dict[str, Group] = {}
        self.hosts: dict[str, dict[str, Any]] = {}
        self.host_groups: dict[str, dict[str, None]] = {}
        self._fine_keys: set[str] = set()  # names already checked and known to be fine
        self.notes: list[str] = []  # warnings other than variable names (KeyCheck has those)
        self.group("all", source)
        self.add_child("all", "ungrouped", source)

    def group(self, name: str, where: str) -> Group:
        """Return group `name`, made on first use; refuse a name that is not a group name."""
        g = self.groups.get(name)
        if g is None:
            if not valid_group_name(name):
                raise TargetError(
                    f"{where}: group name {name!r} is not a group name (letters, digits, '_', '.', '-')"
                )
            g = self.groups[name] = Group(name)
        return g

    def add_child(self, parent: str, child: str, where: str) -> None:
        """Make `child` (made if needed) a child group of `parent`."""
        p, c = self.group(parent, where), self.group(child, where)
        if child == "all":
            raise TargetError(f"{where}: group 'all' cannot be the child of {parent!r}")
        p.children[child] = None
        c.parents[parent] = None

    def set_vars(self, into: dict[str, Any], values: Any, where: str, owner: str) -> None:
        """Check `values` (a mapping of variable names) and merge it into `into`."""
        if values is None:
            return
        if not isinstance(values, Mapping):
            raise TargetError(f"{where}: the vars of {owner} must be a mapping of names to values")
        fine = self._fine_keys
        for key in values:
            if key not in fine:
                check_var_name(key, where, owner)
                if self.check.seen(key, owner, where):
                    fine.add(key)
        into.update(values)

    def add_hosts(self, group: str, key: str, hvars: Any, where: str) -> None:
        """Add the host(s) of one host key (a name, a range, `name:port`) to `group`."""
        g = self.group(group, where)
        own: dict[str, Any] = {}
        self.set_vars(own, hvars, where, f"host {key!r}")
        _, names, port = expand_host_key(key, where)
        if port is not None:
            own["ansible_port"] = port
        for name in names:
            hv = self.hosts.get(name)
            if hv is None:
                if len(self.hosts) >= MAX_HOSTS:  # counted as made: a key may repeat known names
                    raise TargetError(
                        f"{where}: host key {key!r} brings the inventory over {MAX_HOSTS:,} hosts"
                        " (split the fleet into several inventories)"
                    )
                hv = self.hosts[name] = {}
                self.host_groups[name] = {}
            hv.update(own)
            self.host_groups[name][group] = None
            g.hosts[name] = None

    def _depths(self) -> dict[str, int]:
        """Return each group's depth (`all` 0, a child one more than its deepest parent)."""
        for g in self.groups.values():
            if g.name != "all" and not g.parents:  # as Ansible: a group with no parent is under all
                self.add_child("all", g.name, self.source)
        depth: dict[str, int] = {"all": 0}
        visiting: set[str] = set()

        def level(name: str) -> int:
            if name in depth:
                return depth[name]
            if name in visiting:
                raise TargetError(f"{self.source}: group {name!r} is its own ancestor (a cycle of children)")
            visiting.add(name)
            depth[name] = 1 + max(level(p) for p in self.groups[name].parents)
            visiting.discard(name)
            return depth[name]

        for name in self.groups:
            level(name)
        return depth

    def specs(
        self,
        group_files: Mapping[str, dict[str, Any]] | None = None,
        host_files: Mapping[str, dict[str, Any]] | None = None,
    ) -> list[TargetSpec]:
        """Return one TargetSpec per host, in inventory order, with variables merged as Ansible does.

        `group_files` and `host_files` hold what `group_vars/` and `host_vars/` gave, by name.
        """
        group_files = group_files or {}
        host_files = host_files or {}
        try:
            depth = self._depths()
        except RecursionError:
            raise TargetError(
                f"{self.source}: groups are nested too deeply (over about 900 levels)"
            ) from None
        ungrouped = self.groups["ungrouped"]
        for name, member in self.host_groups.items():  # Ansible's reconcile: ungrouped = no other group
            if set(member) <= {"all", "ungrouped"}:
                member["ungrouped"] = None
                ungrouped.hosts[name] = None
            elif "ungrouped" in member:
                del member["ungrouped"]
                ungrouped.hosts.pop(name, None)
        ancestors: dict[str, frozenset[str]] = {}

        def up(name: str) -> frozenset[str]:
            if name not in ancestors:
                out = {name}
                for p in self.groups[name].parents:
                    out |= up(p)
                ancestors[name] = frozenset(out)
            return ancestors[name]

        merged_by_groups: dict[frozenset[str], tuple[list[str], dict[str, Any]]] = {}
        specs = []
        for name, hvars in self.hosts.items():
            key = frozenset(self.host_groups[name])
            cached = merged_by_groups.get(key)
            if cached is None:
                groups: set[str] = set()
                for g in key:
                    groups |= up(g)
                groups.discard("all")
                order = sorted(groups, key=lambda x: (depth[x], x))
                merged: dict[str, Any] = dict(self.groups["all"].vars)
                for g in order:
                    merged.update(self.groups[g].vars)
                merged.update(group_files.get("all", {}))
                for g in order:
                    merged.update(group_files.get(g, {}))
                cached = merged_by_groups[key] = (sorted(groups), merged)
            hv = dict(cached[1])
            hv.update(hvars)
            hv.update(host_files.get(name, {}))
            if "gpu_count" not in hv and "expected_gpus" in hv:
                hv["gpu_count"] = hv["expected_gpus"]
            hv["groups"] = list(cached[0])
            specs.append(make_spec(name, hv, self.source))
        return specs

"""A Slurm node's drain state through `scontrol`, run on the node over its Connection.

The rules (the same as LBNL NHC's and Azure's node health checks, docs/nodecheck.md):

- a node gpuhost finds unhealthy is drained with the reason `gpuhost: <check>: <value>`
  (`scontrol update NodeName=N State=DRAIN Reason=...`): running jobs finish, no new ones start;
- a node drained by anyone else (its reason does not start with `gpuhost:`) is never touched:
  its reason is not overwritten and it is never resumed;
- a healthy node that gpuhost drained is resumed (`State=RESUME`); a gpuhost drain whose failure
  changed gets the new reason.

`read_node` parses `scontrol show node NAME` (Slurm's src/api/node_info.c,
slurm_sprint_node_table: `State=BASE+FLAG+...` among space-separated `Key=Value` pairs, and the
reason on a line of its own as `Reason=TEXT [USER@TIME]`); `plan` decides from it, pure; `act`
runs the one command a plan holds. Node names and reasons are hostile strings: a node name must be
one plain Slurm node name (a comma or `[1-3]` would name several nodes to scontrol), and a reason is
made one printable ASCII line of at most MAX_REASON characters, redacted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.redact import redact

__all__ = [
    "MAX_REASON",
    "PREFIX",
    "NodeState",
    "Plan",
    "SlurmError",
    "act",
    "check_node",
    "parse_show_node",
    "plan",
    "read_node",
    "reason_for",
]

#: What starts the reason of every drain gpuhost makes, and of no other.
PREFIX = "gpuhost:"
MAX_REASON = 200
SCONTROL = "scontrol"

_NODE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
_STAMP = re.compile(r"\s*\[[^\[\]@]*@[^\[\]]*\]\s*$")
_KEYVAL = re.compile(r"(?:^|\s)([A-Za-z_]+)=(\S*)")


class SlurmError(GpuhostError):
    """scontrol failed or printed what is not a node's state; the message says which and why."""


def check_node(name: str) -> str:
    """Return `name` when it is one plain Slurm node name, else raise SlurmError naming it."""
    if not _NODE.match(name or ""):
        raise SlurmError(
            f"Slurm node name {name!r} is not one plain node name (letters, digits, '_', '.', '-'); "
            "give it with --node-name"
        )
    return name


@dataclass(frozen=True)
class NodeState:
    """One node as `scontrol show node` prints it."""

    name: str
    state: str  # e.g. IDLE+DRAIN, MIXED+DRAIN, DOWN+NOT_RESPONDING
    reason: str = ""  # without the "[user@time]" stamp
    stamp: str = ""  # "user@time" of the reason, as scontrol prints it
    fields: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def base(self) -> str:
        return self.state.split("+", 1)[0]

    @property
    def flags(self) -> set[str]:
        return set(self.state.split("+")[1:])

    @property
    def drained(self) -> bool:
        """Drain asked for (Slurm's DRAIN flag): draining while jobs run, drained after."""
        return "DRAIN" in self.flags

    @property
    def ours(self) -> bool:
        """Whether gpuhost set the node's reason."""
        return self.reason.startswith(PREFIX)

    def describe(self) -> str:
        why = f", reason {self.reason!r}" + (f" [{self.stamp}]" if self.stamp else "") if self.reason else ""
        return f"{self.name}: {self.state}{why}"


def parse_show_node(text: str, name: str) -> NodeState:
    """Parse `scontrol show node NAME`; raise SlurmError when it is not that node's record."""
    fields: dict[str, str] = {}
    reason = stamp = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Reason="):
            raw = stripped[len("Reason=") :]
            m = _STAMP.search(raw)
            if m:
                stamp = m.group(0).strip()[1:-1]
                raw = raw[: m.start()]
            reason = raw.strip()
            continue
        for key, value in _KEYVAL.findall(stripped):
            fields.setdefault(key, value)
    got = fields.get("NodeName")
    if got != name or "State" not in fields:
        head = text.strip().splitlines()[0][:120] if text.strip() else "nothing"
        raise SlurmError(f"scontrol show node {name}: expected NodeName={name} and State=, got {head!r}")
    return NodeState(name=name, state=fields["State"], reason=reason, stamp=stamp, fields=fields)


def reason_for(failure: str) -> str:
    """Return the drain reason for a failure line: `gpuhost: ...`, one printable ASCII line."""
    text = redact(failure)
    text = "".join(ch if " " <= ch <= "~" else " " for ch in text)
    text = " ".join(text.split())
    reason = f"{PREFIX} {text}"
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."


@dataclass(frozen=True)
class Plan:
    """What to do with a node: `drain`, `resume` or `keep`, why, and the scontrol argv."""

    action: str
    why: str
    argv: tuple[str, ...] = ()

    @property
    def changes(self) -> bool:
        return bool(self.argv)


def plan(node: NodeState, failure: str | None) -> Plan:
    """Decide from the node's state and the first failure (None: healthy); pure."""
    name = check_node(node.name)
    if failure is not None:
        reason = reason_for(failure)
        if node.drained and not node.ours:
            return Plan("keep", f"{node.name} is drained by someone else ({node.reason!r}): left as it is")
        if "FAIL" in node.flags and not node.ours:
            return Plan(
                "keep", f"{node.name} is marked FAIL by someone else ({node.reason!r}): left as it is"
            )
        if node.drained and node.reason == reason:
            return Plan("keep", f"{node.name} is already drained by gpuhost for this: {reason!r}")
        what = "drain again with the new reason" if node.drained else "drain"
        drain = (SCONTROL, "update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}")
        return Plan("drain", f"{what} {node.name}: {reason!r}", drain)
    if node.drained and node.ours:
        resume = (SCONTROL, "update", f"NodeName={name}", "State=RESUME")
        return Plan(
            "resume", f"resume {node.name}: healthy again (gpuhost drained it: {node.reason!r})", resume
        )
    if node.drained:
        return Plan(
            "keep", f"{node.name} is healthy but drained by someone else ({node.reason!r}): left drained"
        )
    return Plan("keep", f"{node.name} is healthy and not drained ({node.state})")


def _run(conn: Any, argv: list[str] | tuple[str, ...], timeout: float) -> Any:
    res = conn.run(list(argv), timeout=timeout)
    if res.timed_out:
        raise SlurmError(f"{' '.join(argv[:3])} timed out after {timeout:.1f} s (is slurmctld reachable?)")
    if res.rc != 0:
        err = (res.stderr or res.stdout or "").strip().splitlines()
        tail = f": {err[-1][:200]}" if err else ""
        if res.rc == 127:
            raise SlurmError(f"{argv[0]}: command not found on {conn.name} (install slurm-client)")
        raise SlurmError(f"{' '.join(argv[:3])} exited {res.rc}{tail}")
    return res


def read_node(conn: Any, name: str, timeout: float = 10.0) -> NodeState:
    """Run `scontrol show node NAME` on the node's connection and parse it."""
    check_node(name)
    res = _run(conn, [SCONTROL, "show", "node", name], timeout)
    return parse_show_node(res.stdout, name)


def act(conn: Any, p: Plan, timeout: float = 10.0) -> None:
    """Run the plan's scontrol command (nothing for `keep`); raise SlurmError when it fails."""
    if p.changes:
        _run(conn, p.argv, timeout)

"""What each step of the P2P procedure runs, as the `Action`s its plan shows and its evidence keeps.

`--check-only` prints these for every step (prepare.py's plan step joins them); a step that acts
runs the same commands. Each function reads the one `P2PProcedure` of the target.
"""

from __future__ import annotations

from pytest_gpuhost.modules import iommu, pci
from pytest_gpuhost.modules import p2p_boot as persist
from pytest_gpuhost.run.remediation import Action

from .procedure import P2PProcedure

__all__ = [
    "bind_actions",
    "group_actions",
    "persist_actions",
    "release_actions",
    "start_action",
    "stop_actions",
]


def stop_actions(run: P2PProcedure) -> list[Action]:
    """Stopping the service, as its commands (none when no unit holds the GPUs)."""
    if not run.has_service:
        return []
    return [
        Action(f"stop {run.service.unit}", cmd, run.svc_conn.name)
        for cmd in run.service.commands(run.opts.stop_timeout)
    ]


def release_actions(run: P2PProcedure) -> list[Action]:
    """Stopping nvidia-persistenced and turning legacy persistence off."""
    t = run.conn.name
    acts = [
        Action(f"stop {run.persistenced.unit}", cmd, t)
        for cmd in run.persistenced.commands(run.opts.stop_timeout)[:1]
    ]
    for b in run.legacy_on() if run.facts.get("persistence") else []:
        acts.append(
            Action(
                f"persistence mode off on {b} (if still on once nvidia-persistenced is stopped)",
                f"nvidia-smi -i {b} -pm 0",
                t,
            )
        )
    return acts


def group_actions(run: P2PProcedure) -> list[Action]:
    """Unbinding each group's functions and writing identity."""
    assert run.plan is not None
    t = run.conn.name
    acts: list[Action] = []
    for g in run.plan.groups_to_fix:
        for f in g.unbind_order:
            if f.current:
                acts.append(
                    Action(
                        f"unbind {f.bdf} from {f.current} (group {g.number})",
                        pci.unbind_command(f.bdf, f.current),
                        t,
                    )
                )
        if not g.identity:
            acts.append(
                Action(f"group {g.number}: {g.type} -> identity", iommu.type_command(g.number, "identity"), t)
            )
    return acts


def bind_actions(run: P2PProcedure, all_functions: bool = False) -> list[Action]:
    """Binding functions to their original drivers, in the original order."""
    assert run.plan is not None
    todo = run.plan.rebind_order
    if not all_functions:
        todo = [f for f in todo if f.current != f.driver]
    t = run.conn.name
    return [Action(f"bind {f.bdf} to {f.driver}", pci.bind_command(f.bdf, f.driver), t) for f in todo]


def persist_actions(run: P2PProcedure) -> list[Action]:
    """Installing and enabling the boot unit."""
    t = run.conn.name
    return [
        Action("install the boot script", f"write {persist.SCRIPT} (mode 0755)", t, False),
        Action("install the unit", f"write {persist.UNIT}", t, False),
        Action("reload systemd", "systemctl daemon-reload", t, False),
        Action("enable the unit", f"systemctl reenable {persist.UNIT_NAME}", t, False),
    ]


def start_action(run: P2PProcedure, destructive: bool = True) -> Action:
    """Starting the service again."""
    return Action(
        f"start {run.service.unit}",
        f"systemctl start {run.service.unit}",
        run.svc_conn.name,
        destructive,
    )

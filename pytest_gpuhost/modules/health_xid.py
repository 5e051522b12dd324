"""NVIDIA's Xid catalogue: the action each Xid asks for, and the reset/reboot a node still owes.

Pure logic, no I/O. The actions follow NVIDIA's Xid documentation ("Xid Errors",
docs.nvidia.com/deploy/xid-errors/, its table of Xids with the immediate action / resolution:
restart the application, reset the GPU, reboot the node, check NVLink / the fabric, or nothing).
An Xid asking for a GPU reset or a reboot leaves the node *owing* that action: `pending_after`
keeps it in the health state (health_facts.commit_state) across nights until the host shows the
action happened. The marker chosen: the host's boot id (/proc/sys/kernel/random/boot_id) differs
from the one recorded with the Xid, i.e. the node was rebooted, which also resets every GPU. A GPU
reset alone is not yet detected (docs/health-checks.md says why), so a reset-class Xid is owed
until the next reboot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ACTIONS", "FAILING", "OWED", "XID_CATALOGUE", "action_of", "pending_after", "worst"]

#: Actions, mildest first (the order `worst` ranks them in).
ACTIONS: tuple[str, ...] = ("none", "restart_app", "check_fabric", "unknown", "reset_gpu", "reboot")
#: Actions that fail the node's xid check.
FAILING = frozenset({"check_fabric", "unknown", "reset_gpu", "reboot"})
#: Actions the node owes until the host shows they happened (kept across nights).
OWED = frozenset({"reset_gpu", "reboot"})

#: code -> (action, NVIDIA's name for the Xid).
XID_CATALOGUE: Mapping[int, tuple[str, str]] = {
    13: ("restart_app", "Graphics Engine Exception"),
    31: ("restart_app", "GPU memory page fault"),
    43: ("restart_app", "GPU stopped processing"),
    45: ("none", "Preemptive cleanup, due to previous errors"),
    48: ("reset_gpu", "Double Bit ECC Error"),
    61: ("reset_gpu", "Internal micro-controller breakpoint/warning"),
    62: ("reset_gpu", "Internal micro-controller halt"),
    63: ("reset_gpu", "ECC page retirement or row remapping recording event"),
    64: ("reset_gpu", "ECC page retirement or row remapper recording failure"),
    68: ("restart_app", "NVDEC0 Exception"),
    74: ("check_fabric", "NVLINK Error"),
    79: ("reboot", "GPU has fallen off the bus"),
    92: ("none", "High single-bit ECC error rate"),
    94: ("restart_app", "Contained ECC error"),
    95: ("reset_gpu", "Uncontained ECC error"),
    109: ("restart_app", "Context Switch Timeout Error"),
    119: ("reset_gpu", "GSP RPC Timeout"),
    120: ("reset_gpu", "GSP Error"),
    140: ("reset_gpu", "Unrecovered ECC Error"),
    144: ("check_fabric", "NVLINK: SAW MVB error"),
    145: ("check_fabric", "NVLINK: RLW error"),
    146: ("check_fabric", "NVLINK: TLW error"),
    147: ("check_fabric", "NVLINK: TREX error"),
    148: ("check_fabric", "NVLINK: NVLPW_CTRL error"),
    149: ("check_fabric", "NVLINK: NETIR error"),
    150: ("check_fabric", "NVLINK: MSE error"),
    154: ("reset_gpu", "GPU Recovery Action Changed"),
}


def action_of(code: int) -> tuple[str, str]:
    """Return (action, name) of an Xid code; an Xid not in the catalogue is ("unknown", "")."""
    return XID_CATALOGUE.get(int(code), ("unknown", ""))


def worst(actions: Sequence[str]) -> str:
    """Return the strongest of `actions` ("none" for none)."""
    return max(actions, key=ACTIONS.index, default="none")


def pending_after(part: Mapping[str, Any], ignore: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Return what the node still owes after this run: the owed actions not yet done, and the new ones.

    `part` is the `kernel_log` facts part: `pending` (what the state carried in), `xid` (this
    run's lines) and `cursor.boot_id` (this boot). A pending entry is done when the boot id now
    differs from the one recorded with it.
    """
    boot = (part.get("cursor") or {}).get("boot_id")
    out = []
    for p in part.get("pending") or []:
        if isinstance(p, Mapping) and (boot is None or p.get("boot_id") in (None, boot)):
            out.append(dict(p))
    skip = set(ignore)
    for e in part.get("xid") or []:
        code = int(e.get("code", -1))
        action, _ = action_of(code)
        if action in OWED and code not in skip:
            out.append(
                {
                    "code": code,
                    "action": action,
                    "bdf": e.get("bdf"),
                    "ts": e.get("ts"),
                    "msg": e.get("msg"),
                    "boot_id": boot,
                }
            )
    return out

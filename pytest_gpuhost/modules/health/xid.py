"""NVIDIA's Xid catalogue: the action each Xid asks for, and the reset/reboot a node still owes.

Pure logic, no I/O. The actions follow NVIDIA's Xid documentation ("Xid Errors",
docs.nvidia.com/deploy/xid-errors/, its table of Xids with the immediate action / resolution:
restart the application, reset the GPU, reboot the node, check NVLink / the fabric, or nothing).
An Xid asking for a GPU reset or a reboot leaves the node *owing* that action: `settle` keeps it
in the health state (health_facts.commit_state) across nights until the host shows the action
happened:

- a reboot: the host's boot id (/proc/sys/kernel/random/boot_id, drawn anew at each boot) differs
  from the one recorded with the Xid; a reboot resets every GPU, so it settles both actions;
- a GPU reset (settles a reset-class Xid only): the GPU said it needed a reset - `reset_status.
  reset_required` Yes, a pending row remap, or NVML's "GPU requires reset" in its cells - on a
  night since the Xid, and now says No on each of those. The driver reads reset-required from a
  hardware scratch bit only a reset clears (open-gpu-kernel-modules src/nvidia/src/kernel/gpu/
  gpu.c, `_gpuRefreshRecoveryActionInLock` / `gpuIsDeviceMarkedForReset`), a pending remap is
  applied only by a GPU reset (NVIDIA "GPU Memory Error Management"); the driver logs no kernel
  line for a reset (docs/health-checks.md). A GPU that never said so stays owed until a reboot:
  stricter, never a false recovery.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ACTIONS",
    "FAILING",
    "OWED",
    "RESET_SIGNALS",
    "XID_CATALOGUE",
    "action_of",
    "pending_after",
    "reset_signals",
    "settle",
    "worst",
]

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


#: What says a GPU needs a reset, by name in a pending entry's `marks`.
RESET_SIGNALS: tuple[str, ...] = ("reset_required", "remap_pending", "nvml_reset_required")


def _bus_key(bdf: Any) -> str:
    """Return "dddd:bb:dd" of a PCI address in either form (Xid lines omit the function)."""
    text = str(bdf or "").lower()
    parts = text.split(":")
    if len(parts) == 3 and "." in parts[2]:
        parts[2] = parts[2].split(".")[0]
    if len(parts) == 2:
        parts.insert(0, "0000")
    return ":".join(parts)


def reset_signals(facts: Mapping[str, Any]) -> dict[str, dict[str, int | None]]:
    """Return per GPU ("dddd:bb:dd") whether it says it needs a reset: 1 yes, 0 no, None unknown.

    From the `gpus` part (`reset_status.reset_required`; a cell nvidia-smi printed as
    `[GPU requires reset]`) and the `remap` part (`remapped_rows.pending`).
    """
    out: dict[str, dict[str, int | None]] = {}
    gpus = facts.get("gpus")
    if isinstance(gpus, Mapping) and gpus.get("ok"):
        for g in gpus.get("gpus") or []:
            if not isinstance(g, Mapping):
                continue
            errors = g.get("cell_errors") if isinstance(g.get("cell_errors"), Mapping) else {}
            req = g.get("reset_status.reset_required")
            out[_bus_key(g.get("bdf"))] = {
                "reset_required": req if req in (0, 1) else None,
                "nvml_reset_required": 1 if "GPU requires reset" in (errors or {}).values() else 0,
                "remap_pending": None,
            }
    remap = facts.get("remap")
    if isinstance(remap, Mapping) and remap.get("ok"):
        for bdf, row in (remap.get("gpus") or {}).items():
            pending = row.get("remapped_rows.pending") if isinstance(row, Mapping) else None
            if pending in (0, 1):
                out.setdefault(_bus_key(bdf), dict.fromkeys(RESET_SIGNALS))["remap_pending"] = pending
    return out


def settle(
    part: Mapping[str, Any],
    ignore: Sequence[int] = (),
    signals: Mapping[str, Mapping[str, int | None]] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Return (owed, done): what the node still owes after this run, and what it settled.

    `part` is the `kernel_log` facts part: `pending` (what the state carried in), `xid` (this
    run's lines) and `cursor.boot_id` (this boot); `signals` is `reset_signals(facts)` of this
    run. An entry is done by a reboot when the boot id differs from the one recorded with it; a
    reset-class entry is done by a GPU reset when its GPU said it needed a reset (`marks`, kept
    across nights) and now says No on each of those. Done entries carry `by`.
    """
    boot = (part.get("cursor") or {}).get("boot_id")
    signals = signals or {}
    owed: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    for p in part.get("pending") or []:
        if not isinstance(p, Mapping):
            continue
        entry = dict(p)
        if boot is not None and entry.get("boot_id") not in (None, boot):
            done.append({**entry, "by": "reboot"})
            continue
        sig = signals.get(_bus_key(entry.get("bdf"))) or {}
        marks = sorted(set(entry.get("marks") or []) | {k for k, v in sig.items() if v == 1})
        if (
            entry.get("action") == "reset_gpu"
            and entry.get("marks")
            and not any(v == 1 for v in sig.values())
            and all(sig.get(m) == 0 for m in entry["marks"])
        ):
            done.append({**entry, "by": "gpu_reset"})
            continue
        if marks:
            entry["marks"] = marks
        owed.append(entry)
    skip = set(ignore)
    for e in part.get("xid") or []:
        code = int(e.get("code", -1))
        action, _ = action_of(code)
        if action in OWED and code not in skip:
            sig = signals.get(_bus_key(e.get("bdf"))) or {}
            owed.append(
                {
                    "code": code,
                    "action": action,
                    "bdf": e.get("bdf"),
                    "ts": e.get("ts"),
                    "msg": e.get("msg"),
                    "boot_id": boot,
                    "marks": sorted(k for k, v in sig.items() if v == 1),
                }
            )
    return owed, done


def pending_after(
    part: Mapping[str, Any],
    ignore: Sequence[int] = (),
    signals: Mapping[str, Mapping[str, int | None]] | None = None,
) -> list[dict[str, Any]]:
    """Return what the node still owes after this run (`settle`'s first half)."""
    return settle(part, ignore, signals)[0]

"""NVIDIA's Xid catalogue: the action each Xid asks for, and the reset/reboot a node still owes.

Pure logic, no I/O. The actions follow NVIDIA's Xid catalogue ("Xid Errors",
docs.nvidia.com/deploy/xid-errors/, each Xid's immediate resolution bucket: RESTART_APP,
RESET_GPU, RESTART_BM, IGNORE, ...), generated into xid_catalogue.py by
scripts/gen_xid_catalogue.py (its BUCKET_ACTIONS maps each bucket to one of `ACTIONS`), with a few
codes decided here instead (`OVERRIDES`). An Xid in no catalogue is "unknown" and fails the node.
An Xid asking for a GPU reset or a reboot leaves the node *owing* that action: `settle` keeps it
in the health state (modules/health/facts.commit_state) across nights until the host shows the action
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

An Xid is judged by its line, not only its code (`event_action`):

- "Xid 45 ... caused by previous Xid 149": the driver tearing down channels after an earlier
  error (NVIDIA's catalogue: Xid 45 "not solo: follow the other Xid"); it is judged as the worse of
  itself and the Xid it names, so an NVLink or ECC error behind it is never read as harmless
  (fixtures/outputs/kernlog-xid45-caused-by-previous.txt);
- Xid 154 "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)": the
  driver's new recovery action, NVML's `nvmlDeviceGpuRecoveryAction_t` (nvml.h: 0 NONE,
  1 GPU_RESET, 2 NODE_REBOOT, 3 DRAIN_P2P, 4 DRAIN_AND_RESET, 5 GPU_RESET_BUS) with the driver's
  words for it, which differ between drivers ("GPU Reset Required" and "Node Reboot Required" in
  580 and 595 logs, "PF FLR" and "OS Reboot" in later ones; fixtures/outputs/kernlog-xid154-*.txt);
  a change to None asks for nothing, one the table does not know is "unknown";
- the driver's own "fallen off the bus" records arrive as an Xid 79 from the probe
  (exec/agent/probe_health_kernel.py).

"Drain P2P" (stop the GPU's peer-to-peer traffic, then ask the driver again) is owed like a
reset: settled by a reboot, or by the GPU's signals clearing - on drivers from 590, whose
nvidia-smi has no `reset_status.reset_required`, the `gpu_recovery_action` query field reading
None again after it asked for something (`reset_signals`). A GPU whose recovery action is not
None fails the check by itself (`recovery_owed`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pytest_gpuhost.modules.health.xid_catalogue import CATALOGUE

__all__ = [
    "ACTIONS",
    "bus_key",
    "FAILING",
    "OVERRIDES",
    "OWED",
    "RESET_SIGNALS",
    "XID_CATALOGUE",
    "RECOVERY_ACTIONS",
    "action_of",
    "event_action",
    "is_ignored",
    "recovery_action",
    "recovery_owed",
    "pending_after",
    "reset_signals",
    "settle",
    "worst",
]

#: Actions, mildest first (the order `worst` ranks them in).
ACTIONS: tuple[str, ...] = (
    "none",
    "restart_app",
    "check_fabric",
    "unknown",
    "drain_p2p",
    "reset_gpu",
    "reboot",
)
#: Actions that fail the node's xid check.
FAILING = frozenset({"check_fabric", "unknown", "drain_p2p", "reset_gpu", "reboot"})
#: Actions the node owes until the host shows they happened (kept across nights).
OWED = frozenset({"drain_p2p", "reset_gpu", "reboot"})
#: Owed actions a GPU's own signals can settle (a reboot settles every one).
_GPU_SETTLED = frozenset({"drain_p2p", "reset_gpu"})

#: Codes where this project decides against NVIDIA's bucket: code -> (action, why). Applied on top
#: of the generated catalogue (xid_catalogue.py); every other code follows its bucket.
OVERRIDES: Mapping[int, tuple[str, str]] = {
    # The catalogue calls 61 unused (CONTACT_SUPPORT: failing one night only). Drivers that still
    # log it report a halted internal micro-controller (PMU breakpoint), which NVIDIA's Xid table
    # before the catalogue answered with a GPU reset: owed until the GPU is reset.
    61: ("reset_gpu", "internal micro-controller breakpoint: the GPU needs a reset"),
    # The catalogue ignores 63 (the remap event itself is benign), but a recorded row remap or
    # page retirement applies only at the next GPU reset (NVIDIA "GPU Memory Error Management"):
    # owed until the GPU's remap-pending signal clears, as reset_signals reads it.
    63: ("reset_gpu", "a recorded row remap applies only at the next GPU reset"),
}

#: code -> (action, NVIDIA's name, NVIDIA's immediate resolution bucket): the generated catalogue
#: (scripts/gen_xid_catalogue.py) with OVERRIDES applied.
XID_CATALOGUE: Mapping[int, tuple[str, str, str]] = {
    code: (OVERRIDES[code][0] if code in OVERRIDES else action, name, bucket)
    for code, (action, name, bucket) in CATALOGUE.items()
}


def action_of(code: int) -> tuple[str, str]:
    """Return (action, name) of an Xid code; an Xid not in the catalogue is ("unknown", "")."""
    action, name, _ = XID_CATALOGUE.get(int(code), ("unknown", "", ""))
    return action, name


#: NVML's GPU recovery action (nvml.h `nvmlDeviceGpuRecoveryAction_t`) -> the action owed.
RECOVERY_ACTIONS: Mapping[int, str] = {
    0: "none",
    1: "reset_gpu",
    2: "reboot",
    3: "drain_p2p",
    4: "reset_gpu",  # DRAIN_AND_RESET: drain the work, then reset the GPU
    5: "reset_gpu",  # GPU_RESET_BUS
}
#: The driver's and nvidia-smi's words for them (Xid 154 text, `GPU Recovery Action` of -q,
#: the `gpu_recovery_action` query field), lower case.
_RECOVERY_WORDS: Mapping[str, str] = {
    "none": "none",
    "gpu reset required": "reset_gpu",
    "gpu reset": "reset_gpu",
    "reset": "reset_gpu",
    "pf flr": "reset_gpu",
    "drain and reset": "reset_gpu",
    "node reboot required": "reboot",
    "node reboot": "reboot",
    "os reboot": "reboot",
    "reboot": "reboot",
    "drain p2p": "drain_p2p",
}
_XID154_TO = re.compile(r"recovery action changed from .*? to (0x[0-9a-fA-F]+|\d+)\s*(?:\(([^)]*)\))?")


def recovery_action(value: Any) -> str | None:
    """Return the action a GPU recovery action asks for: by NVML's number or the driver's words.

    None for no value (N/A, [Not Supported], empty); "unknown" for a value neither knows.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return RECOVERY_ACTIONS.get(value, "unknown")
    text = str(value or "").strip().strip("[]").lower()
    if not text or text in ("n/a", "not supported", "unknown error"):
        return None
    if text in _RECOVERY_WORDS:
        return _RECOVERY_WORDS[text]
    try:
        return RECOVERY_ACTIONS.get(int(text, 0), "unknown")
    except ValueError:
        return "unknown"


def event_action(e: Mapping[str, Any]) -> tuple[str, str]:
    """Return (action, name) of one Xid line: by its code, its Xid 154 action, its cause.

    An Xid 154 whose text names no action is judged by the catalogue (a reset).
    """
    code = int(e.get("code", -1))
    action, name = action_of(code)
    msg = str(e.get("msg") or "")
    if code == 154:
        m = _XID154_TO.search(msg)
        if m:
            words = (m.group(2) or "").strip()
            action = _RECOVERY_WORDS.get(words.lower()) or recovery_action(int(m.group(1), 0)) or "unknown"
            name = f"{name}: {words or m.group(1)}"
    cause = e.get("cause")
    if isinstance(cause, int) and not isinstance(cause, bool):
        by, by_name = action_of(cause)
        if ACTIONS.index(by) > ACTIONS.index(action):
            action, name = by, f"{by_name or 'Xid ' + str(cause)} (caused by Xid {cause})"
    return action, name


def worst(actions: Sequence[str]) -> str:
    """Return the strongest of `actions` ("none" for none)."""
    return max(actions, key=ACTIONS.index, default="none")


def is_ignored(e: Mapping[str, Any], ignore: Collection[int]) -> bool:
    """Return whether an Xid line is ignored: its code and the code of its cause are all in `ignore`.

    ("Xid 45 ... caused by previous Xid 149" with 45 ignored still counts, as an Xid 149.)
    """
    codes = {int(e.get("code", -1))}
    cause = e.get("cause")
    if isinstance(cause, int) and not isinstance(cause, bool):
        codes.add(cause)
    return codes <= set(ignore)


#: What says a GPU needs a reset, by name in a pending entry's `marks`.
RESET_SIGNALS: tuple[str, ...] = ("reset_required", "remap_pending", "nvml_reset_required", "recovery_action")


def bus_key(bdf: Any) -> str:
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

    From the `gpus` part (`reset_status.reset_required` up to R580, `gpu_recovery_action` other
    than None from R590; a cell nvidia-smi printed as `[GPU requires reset]`) and the `remap` part
    (`remapped_rows.pending`).
    """
    out: dict[str, dict[str, int | None]] = {}
    gpus = facts.get("gpus")
    if isinstance(gpus, Mapping) and gpus.get("ok"):
        for g in gpus.get("gpus") or []:
            if not isinstance(g, Mapping):
                continue
            errors = g.get("cell_errors") if isinstance(g.get("cell_errors"), Mapping) else {}
            req = g.get("reset_status.reset_required")
            asks = recovery_action(g.get("gpu_recovery_action"))
            out[bus_key(g.get("bdf"))] = {
                "reset_required": req if req in (0, 1) else None,
                "nvml_reset_required": 1 if "GPU requires reset" in (errors or {}).values() else 0,
                "remap_pending": None,
                "recovery_action": None if asks is None else int(asks != "none"),
            }
    remap = facts.get("remap")
    if isinstance(remap, Mapping) and remap.get("ok"):
        for bdf, row in (remap.get("gpus") or {}).items():
            pending = row.get("remapped_rows.pending") if isinstance(row, Mapping) else None
            if pending in (0, 1):
                out.setdefault(bus_key(bdf), dict.fromkeys(RESET_SIGNALS))["remap_pending"] = pending
    return out


def recovery_owed(facts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Return the GPUs whose driver asks for a recovery action now: bdf, action, value.

    From the `gpu_recovery_action` query field (R590+; None where the driver has no such field or
    the GPU asks for nothing). The driver keeps the action until it is done (a GPU reset, a
    reboot), so this needs no kernel line: an Xid 154 that rotated out of the kernel log, or one
    logged before this host was first checked, still fails the node.
    """
    out: list[dict[str, Any]] = []
    gpus = facts.get("gpus")
    if not (isinstance(gpus, Mapping) and gpus.get("ok")):
        return out
    for g in gpus.get("gpus") or []:
        if not isinstance(g, Mapping):
            continue
        action = recovery_action(g.get("gpu_recovery_action"))
        if action not in (None, "none"):
            value = (g.get("raw") or {}).get("gpu_recovery_action", g.get("gpu_recovery_action"))
            out.append({"bdf": g.get("bdf"), "action": action, "value": value})
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
        sig = signals.get(bus_key(entry.get("bdf"))) or {}
        marks = sorted(set(entry.get("marks") or []) | {k for k, v in sig.items() if v == 1})
        if (
            entry.get("action") in _GPU_SETTLED
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
        action, _ = event_action(e)
        if action in OWED and not is_ignored(e, skip):
            sig = signals.get(bus_key(e.get("bdf"))) or {}
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

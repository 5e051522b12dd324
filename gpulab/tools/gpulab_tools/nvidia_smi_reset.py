"""The lab's ``nvidia-smi -r`` / ``--gpu-reset [-i ID]``: a GPU reset, as the real tool does it.

What the real one does, and what this emulates:

- It refuses a GPU any process holds open, nvidia-persistenced and persistence mode included
  (``nvidia-smi(1)``, ``-r``: "There can't be any applications using these devices"); it prints
  what NVIDIA's own reset job met on an A100 host (github.com/NVIDIA/NVSentinel/issues/1690):
  ``The following GPUs could not be reset:`` / ``  GPU 00000000:1A:00.0: In use by another client``
  and a paragraph naming the kinds of clients, exit 255.
- A reset clears the GPU's hardware and software state ("Can be used to clear GPU HW and SW
  state in situations that would otherwise require a machine reboot", ``nvidia-smi(1)``): the
  reset-required scratch bit the driver reads (open-gpu-kernel-modules
  src/nvidia/src/kernel/gpu/gpu.c, ``gpuIsDeviceMarkedForReset``), NVML's "GPU requires reset"
  state, and a pending row remap, which the reset applies (NVIDIA "GPU Memory Error
  Management"). Here: the lab host's runtime faults for that GPU with those meanings are
  removed from ``/var/lib/gpulab/faults.json``.
- It prints ``GPU 00000000:1A:00.0 was successfully reset.`` per GPU, exit 0 (NVSentinel issue
  1690). The driver writes no kernel-log line for the reset (no message on that path in
  open-gpu-kernel-modules 595.45.04; a new GPU object starts with its recovery action unknown and
  refreshes it without an Xid 154, gpu.c ``gpuPostConstruct``), so nothing goes to the kmsg.
- The lab's fault ``reset_sticks`` on a GPU: the reset prints success and exits 0, but the GPU
  keeps every fault, as a GPU that stays in error until the node reboots; a reboot of the lab
  host (``LabHost.reboot``, or ``systemctl reboot`` inside it) clears it with the reset faults.
- The lab's fault ``reset_hangs: SECONDS`` on a GPU: the reset returns only after that long (a
  driver stuck in the reset), so that a test can cut a run while the GPU's units are stopped.
- NVLink peers reset in the same command (nvidia-smi(1), ``-r``: "If Fabric Manager is not
  running, or if any of the GPUs being reset are based on an architecture preceding the NVIDIA
  Ampere architecture, any GPUs with NVLink connections to a GPU being reset must also be reset
  in the same command. [...] If the -i option does not specify a complete set of NVLink GPUs to
  reset, this command will issue an error identifying the additional GPUs"; its tables: pre-Ampere
  always with its peers; Ampere or later alone on direct NVLink, and on NVSwitches while Fabric
  Manager runs; "On Hopper and later NVSwitch systems, the dependency on Fabric Manager to
  facilitate reset is removed", which the lab follows). A GPU's NVLink peers are the GPUs the
  profile's link model joins to it with ``nvlink``; NVSwitches are the profile's NVIDIA functions
  of class 0x0680; Fabric Manager runs when ``nvidia-fabricmanager.service`` is active; the
  architecture is the model name's (``ARCHES``). A
  request that leaves out a required peer prints the GPUs to add and exits 255 (the wording and
  the exit status are the lab's: not verified against a real driver). And "There also can't be
  any compute applications running on any other GPU in the system if individual GPU reset is not
  feasible": such a reset is refused while any other GPU has a compute holder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from gpulab_tools import GpuView, Host, path, record

#: Runtime faults (per GPU in faults.json) that a GPU reset clears.
CLEARED_BY_RESET = ("reset_required", "drain_and_reset", "remapped_rows_pending")
IN_USE = (
    "\n1 device is currently being used by one or more other processes (e.g. Fabric Manager, CUDA "
    "application, graphics application such as an X server, or a monitoring application such as "
    "another instance of nvidia-smi). Please first kill all processes using this device and all "
    "compute applications running in the system.\n"
)


def _write_faults(faults: dict[str, object]) -> None:
    p = path("var/lib/gpulab/faults.json")
    tmp = f"{p}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(faults, f)
    os.rename(tmp, p)


#: Architecture by the model name nvidia-smi prints (lower case, first match), for the profiles'
#: GPUs; a GPU of a name not here is taken as Ampere or later (its reset is its own).
ARCHES = (
    ("v100", "Volta"),
    ("gv100", "Volta"),
    ("p100", "Pascal"),
    ("gp100", "Pascal"),
    ("a100", "Ampere"),
    ("h100", "Hopper"),
    ("h200", "Hopper"),
    ("b200", "Blackwell"),
    ("b300", "Blackwell"),
    ("rtx pro 6000", "Blackwell"),
)
BEFORE_AMPERE = ("Kepler", "Maxwell", "Pascal", "Volta", "Turing")
FABRIC_UNIT = "nvidia-fabricmanager.service"


def arch(g: GpuView) -> str:
    """The GPU's architecture, by its model name."""
    low = g.name.lower()
    return next((a for key, a in ARCHES if key in low), "Ampere or later")


_FM: list[bool] = []


def fabric_manager_running() -> bool:
    """Whether Fabric Manager's unit is active (asked once per run of the tool)."""
    if _FM:
        return _FM[0]
    try:
        r = subprocess.run(
            ["systemctl", "is-active", "--quiet", FABRIC_UNIT], timeout=10, capture_output=True, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        _FM.append(False)
        return False
    _FM.append(r.returncode == 0)
    return _FM[0]


def required_set(host: Host, gpus: list[GpuView]) -> list[GpuView]:
    """The GPUs one reset of `gpus` must include: each GPU that cannot be reset alone brings its
    NVLink peers, and they theirs."""
    nvswitch = any(
        str(f.get("vendor")) == "0x10de" and str(f.get("class", "")).startswith("0x0680")
        for f in host.profile.get("pci", [])
    )

    def alone(g: GpuView) -> bool:
        a = arch(g)
        if a in BEFORE_AMPERE:
            return False
        if not nvswitch or a != "Ampere":  # direct NVLink, or Hopper on: no Fabric Manager needed
            return True
        return fabric_manager_running()

    want = {g.bdf: g for g in gpus}
    todo = list(gpus)
    while todo:
        g = todo.pop()
        peers = [
            p for p in host.gpus if p is not g and (host.link(g.bdf, p.bdf) or {}).get("type") == "nvlink"
        ]
        if not peers or alone(g):
            continue
        for p in peers:
            if p.bdf not in want:
                want[p.bdf] = p
                todo.append(p)
    return sorted(want.values(), key=lambda g: g.index)


def gpu_reset(host: Host, gpus: list[GpuView]) -> int:
    """Reset `gpus` (all of them or none, as the real tool checks first); return the exit status."""
    whole = required_set(host, gpus)
    named = {g.bdf for g in gpus}
    extra = [g for g in whole if g.bdf not in named]
    if extra:
        sys.stdout.write(
            "Unable to reset the requested GPUs: the following GPUs have NVLink connections to a GPU "
            "being reset and must be included in the same reset command:\n"
        )
        for g in extra:
            sys.stdout.write(f"  GPU {g.bus_id}\n")
        return 255
    busy = [g for g in gpus if g.holders or g.persistence]
    if any(len(required_set(host, [g])) > 1 for g in gpus):  # not one GPU alone: no compute app anywhere
        busy += [g for g in host.gpus if g.bdf not in named and any(h.kind == "C" for h in g.holders)]
    if busy:
        sys.stdout.write("The following GPUs could not be reset:\n")
        for g in busy:
            sys.stdout.write(f"  GPU {g.bus_id}: In use by another client\n")
        sys.stdout.write(IN_USE)
        return 255
    faults = dict(host.faults)
    per_gpu = dict(faults.get("gpus") or {})
    hang = max((float((per_gpu.get(g.bdf) or {}).get("reset_hangs") or 0) for g in gpus), default=0.0)
    if hang > 0:
        # a lab fault: a reset that does not return for that many seconds (a driver stuck in the
        # reset), so that a run can be cut while its units are stopped; then it resets as usual
        time.sleep(hang)
    for g in gpus:
        mine = dict(per_gpu.get(g.bdf) or {})
        if mine.get("reset_sticks"):
            # a lab fault, not nvidia-smi's own behaviour: a GPU that stays in error after a reset
            # that returned 0, so that a caller is held to the GPU's own signals rather than the
            # command's exit code; only a reboot clears it (gpulab/host/lab.py CLEARED_BY_REBOOT)
            continue
        for key in CLEARED_BY_RESET:
            mine.pop(key, None)
        if mine.get("nvml_error") == "GPU requires reset":
            del mine["nvml_error"]
        if mine:
            per_gpu[g.bdf] = mine
        else:
            per_gpu.pop(g.bdf, None)
    faults["gpus"] = per_gpu
    _write_faults(faults)
    for g in gpus:
        record({"op": "gpu_reset", "bdf": g.bdf})
        sys.stdout.write(f"GPU {g.bus_id} was successfully reset.\n")
    return 0

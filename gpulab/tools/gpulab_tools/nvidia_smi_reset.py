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
"""

from __future__ import annotations

import json
import os
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


def gpu_reset(host: Host, gpus: list[GpuView]) -> int:
    """Reset `gpus` (all of them or none, as the real tool checks first); return the exit status."""
    busy = [g for g in gpus if g.holders or g.persistence]
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

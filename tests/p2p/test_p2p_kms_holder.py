"""suites/p2p on a host whose nvidia-drm runs with modeset=Y (the suite side), over real SSH.

nvidia-drm's KMS holds each GPU through nvkms_open_gpu() and takes no reference on its own module:
nvidia_drm's refcnt reads 0 while an nvidia unbind waits forever on drivers before 580.105.08
(open-gpu-kernel-modules kernel-open/nvidia/nv-pci.c gained nvidia_modeset_remove() there;
`pytest_gpuhost.modules.gpu.kernel_holders`). The plan must refuse before it stops, signals or
unbinds anything; from 580.105.08 the repair goes through.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.p2p.test_p2p_suite import NVIDIA, host_state, run_suite, sh

BASE = "proxmox-rtx6000"
KMS = {"nvidia_drm": {"modeset": True, "fbdev": False}}  # no fbdev console: nothing raises refcnt


def _touched(run: Any) -> list[dict[str, Any]]:
    return [r for r in run.record if r.get("kind", "sysfs") in ("sysfs", "signal")]


def test_modeset_on_570_is_refused_at_the_plan_with_refcnt_zero(lab: Any, tmp_path: Path) -> None:
    from gpulab.profiles.load import load_profile

    host = lab.host(load_profile(BASE, {"module_params": KMS}), name=f"kms570-{os.getpid()}")
    assert sh(host, "cat /sys/module/nvidia_drm/refcnt") == "0"
    assert sh(host, "cat /sys/module/nvidia/version") == "570.133.07"
    run = run_suite(host, tmp_path, timeout=120)
    assert run.rc != 0 and run.outcomes["test_plan"] == "failed", run.outcomes
    out = run.output
    assert "nvidia_drm holds each GPU it registered through nvkms_open_gpu()" in out, out[-3000:]
    assert "driver 570.133.07 predates 580.105.08" in out and "needs a reboot path" in out
    assert _touched(run) == [], run.record
    st = host_state(host)
    assert all(st["drivers"][b] == "nvidia" for b in NVIDIA) and st["service"] == "active"
    host.down()


def test_modeset_on_580_105_08_is_no_holder(lab: Any, tmp_path: Path) -> None:
    from gpulab.profiles.load import load_profile

    prof = load_profile(BASE, {"module_params": KMS, "driver_version": "580.105.08"})
    host = lab.host(prof, name=f"kms580-{os.getpid()}")
    run = run_suite(host, tmp_path, timeout=240)
    assert run.outcomes["test_plan"] == "fixed", run.outcomes
    assert run.outcomes["test_iommu_groups_identity"] == "fixed", run.outcomes
    assert "nvkms_open_gpu" not in run.output
    host.down()

"""nvidia-drm with modeset=Y holds each GPU through nvkms_open_gpu() (the lab side).

nv_drm_dev_load() allocates an NVKMS device per GPU at load; its nvkms_open_gpu() raises the GPU's
usage count (nvidia_dev_get() -> nv_open_device()) and takes no reference on nvidia_drm, so the
module's refcnt reads 0 while nv_pci_remove() waits. From 580.105.08 the unbind calls
nvidia_modeset_remove() first (open-gpu-kernel-modules kernel-open/nvidia/nv-pci.c).
docs/LAB-SOURCES.md has the row.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpulab.profiles.load import PROFILE_DIR, load_profile
from tests.helpers.gate import wait_blocked
from tests.helpers.sysfs_io import rd

StandaloneMount = pytest.importorskip(
    "gpulab.kernel.sysfs", reason="the lab's sysfs needs mfusepy and libfuse", exc_type=ImportError
).StandaloneMount

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse"), reason="needs root and /dev/fuse"
)

AMD = "proxmox-epyc-snp"  # nvidia-drm modeset=Y fbdev=Y, driver 570.133.07
GPU0 = "0000:17:00.0"


def variant(tmp: Path, **changes: Any) -> str:
    data = yaml.safe_load((PROFILE_DIR / f"{AMD}.yaml").read_text())
    data.update(changes)
    out = tmp / "variant.yaml"
    out.write_text(yaml.safe_dump(data))
    return str(out)


def unbind_in_thread(m: Any, bdf: str) -> tuple[threading.Thread, dict[str, int]]:
    out: dict[str, int] = {}

    def run() -> None:
        try:  # the lab's nvidia unbind blocks in close(), as the write's flush
            fd = os.open(Path(m.mnt) / "pci/drivers/nvidia/unbind", os.O_WRONLY)
            try:
                os.write(fd, bdf.encode())
            finally:
                os.close(fd)
            out["rc"] = 0
        except OSError as e:
            out["rc"] = e.errno or -1

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


@pytest.mark.parametrize("fbdev", [True, False])
def test_modeset_holds_the_gpu_with_refcnt_zero_on_570(tmp_path: Path, fbdev: bool) -> None:
    params = {"nvidia_drm": {"modeset": True, "fbdev": fbdev}}
    with StandaloneMount(variant(tmp_path, module_params=params), tmp_path / "m") as m:
        assert rd(Path(m.mnt) / "module/nvidia_drm/refcnt") == "0"
        assert rd(Path(m.mnt) / "module/nvidia_drm/parameters/modeset") == "Y"
        assert rd(Path(m.mnt) / "module/nvidia/version") == "570.133.07"
        th, out = unbind_in_thread(m, GPU0)
        wait_blocked(m.state, GPU0)
        assert th.is_alive(), f"unbind returned ({out}) while nvkms_open_gpu() held the GPU"
        Path(m.mnt, "ctl/reset").write_text("1")  # a reboot ends the wait
        th.join(3)
        assert not th.is_alive()


def test_from_580_105_08_the_unbind_tears_modeset_down_first(tmp_path: Path) -> None:
    with StandaloneMount(variant(tmp_path, driver_version="580.105.08"), tmp_path / "m") as m:
        assert rd(Path(m.mnt) / "module/nvidia/version") == "580.105.08"
        th, out = unbind_in_thread(m, GPU0)
        th.join(3)
        assert not th.is_alive() and out["rc"] == 0
        assert not Path(m.mnt, f"pci/drivers/nvidia/{GPU0}").exists()


def test_which_profiles_hold() -> None:
    assert load_profile(AMD).nvkms_holds_gpus  # 570.133.07, modeset=Y
    assert not load_profile(AMD, {"driver_version": "580.105.08"}).nvkms_holds_gpus
    assert not load_profile(AMD, {"driver_version": "580.94.06"}).nvkms_holds_gpus
    assert load_profile(AMD, {"driver_version": "580.95.05"}).nvkms_holds_gpus
    assert not load_profile("proxmox-rtx6000").nvkms_holds_gpus  # nvidia_drm without parameters

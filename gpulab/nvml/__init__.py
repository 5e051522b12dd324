"""The lab's stand-in libnvidia-ml.so.1 (libnvidia-ml.c): built once per source, installed in lab hosts.

The library answers the NVML calls the health probe makes (exec/agent/probe_health_nvml.py)
from the lab host's GPU state, which gpulab_tools/nvml_state.py prints at every nvmlInit_v2:
the state the lab's nvidia-smi reads, so both sources say the same.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["LIB_PATH", "SOURCE", "build"]

SOURCE = Path(__file__).resolve().parent / "libnvidia-ml.c"
#: Where a lab host has it: a directory the dynamic loader searches by default, so
#: ctypes.CDLL("libnvidia-ml.so.1") finds it as it finds the driver's copy on a real host.
LIB_PATH = "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
BUILD_DIR = Path("/run/gpulab/.build")


def build(build_dir: Path = BUILD_DIR) -> Path:
    """Return the compiled library, compiling it when no build of this source exists yet."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = build_dir / f"libnvidia-ml-{digest}.so.1"
    if out.is_file():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the lab's libnvidia-ml.so.1: run scripts/setup.sh")
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(tmp), str(SOURCE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    tmp.replace(out)  # atomic: a concurrent build of the same source writes the same bytes
    return out

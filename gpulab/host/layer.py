"""The lab layer of a machine: the files the lab puts under a lab host's root before it boots.

Its /proc stand-ins (the profile's kernel), the in-host tools (gpulab/tools: nvidia-smi,
nvbandwidth, the NVML stand-in library, sglang), pct/lxc-attach on a Proxmox host, and the
profile's data trees. ``LabHost`` mounts the layer under the host's overlay (gpulab/host/lab.py).
"""

from __future__ import annotations

import compileall
import os
import shutil
import stat
from pathlib import Path

from gpulab import nvml
from gpulab.profiles.types import NodeShape, Profile, Service

__all__ = [
    "HOST_PY_SITE",
    "HOST_TOOL_PATHS",
    "TOOL_PATHS",
    "install_tools",
    "populate_files",
    "service_env",
    "shape_node",
    "write_procfiles",
]

PKG = Path(__file__).resolve().parents[1]  # gpulab/

HOST_PY_SITE = "usr/local/lib/python3.11/dist-packages"


def write_procfiles(d: Path, prof: Profile) -> None:
    """Write the /proc files that carry the profile's kernel: cmdline, version, osrelease."""
    d.mkdir(exist_ok=True)
    (d / "cmdline").write_text(prof.cmdline + "\n")
    (d / "sys_kernel_osrelease").write_text(prof.kernel + "\n")
    (d / "version").write_text(
        f"Linux version {prof.kernel} (build@gpulab) (gcc (Debian 12.2.0-14) 12.2.0, GNU ld 2.40)"
        " #1 SMP PREEMPT_DYNAMIC\n"
    )


def service_env(svc: Service) -> str:
    env = [f"GPULAB_SERVICE={svc.name}", f"GPULAB_IGNORE_SIGTERM={svc.ignore_sigterm}"]
    if svc.gpus:
        env.append(f"GPULAB_GPUS={','.join(svc.gpus)}")
    return " ".join(env)


# Where each tool of gpulab/tools/ goes in a lab machine (INTERNALS.md section 4).
TOOL_PATHS = {
    "nvidia-smi": "usr/bin/nvidia-smi",
    "nvbandwidth": "usr/bin/nvbandwidth",
    "nvidia-persistenced": "usr/bin/nvidia-persistenced",
    "dmesg": "usr/bin/dmesg",
    "sglang-standin": "usr/local/bin/sglang-standin",
    "gpulab_tools/all_reduce_perf": "usr/bin/all_reduce_perf",  # nccl-tests' collective (a module with a main)
}


#: Proxmox's tools in a lab host that is not a container (gpulab/hosttools).
HOST_TOOL_PATHS = ("usr/sbin/pct", "usr/bin/lxc-attach")

#: The tools that come with the NVIDIA driver: a host without the driver has none of them.
DRIVER_TOOLS = ("nvidia-smi", "nvbandwidth", "nvidia-persistenced")
#: What a container image without systemd lacks (Docker images install no init system).
SYSTEMD_TOOLS = ("usr/bin/systemctl", "usr/bin/journalctl")


def _whiteout(p: Path) -> None:
    """Hide ``p`` of the lower layer (overlayfs: a character device 0:0 in an upper layer)."""
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        p.unlink()
    os.mknod(p, stat.S_IFCHR | 0o000, os.makedev(0, 0))


#: A container image's supervisord.conf with sshd as its program (supervisord.org, "Configuration").
SUPERVISORD_CONF = """\
[supervisord]
nodaemon=true
user=root

[program:sshd]
command=/usr/sbin/sshd -D -f /etc/ssh/sshd_config
autorestart=true
"""

#: Files by which a container runtime marks its containers: the machine that runs the lab may be
#: a container itself, and a lab host sees its `/` through the overlay.
CONTAINER_MARKERS = (".dockerenv", "run/.containerenv")


def shape_node(root: Path, shape: NodeShape) -> None:
    """Make the layer the node shape says: no systemd tools, /.dockerenv (NodeShape).

    A host that is not a container gets none of the container markers of the machine running
    the lab (whiteouts over them where that machine has them).
    """
    if not shape.systemd:
        for rel in SYSTEMD_TOOLS:
            _whiteout(root / rel)
    for rel in CONTAINER_MARKERS:
        if Path("/", rel).exists():
            _whiteout(root / rel)
    if shape.init in ("tini", "supervisord"):  # the entry point PID 1 runs (gpulab/hosttools)
        dst = root / "usr/bin" / shape.init
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PKG / "hosttools" / shape.init, dst)
        dst.chmod(0o755)
    if shape.init == "supervisord":
        conf = root / "etc/supervisor/supervisord.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(SUPERVISORD_CONF)
    if shape.container == "docker":
        dockerenv = root / ".dockerenv"
        dockerenv.unlink(missing_ok=True)  # the whiteout, where there is one
        dockerenv.write_text("")  # Docker creates it, empty, in every container


def install_tools(root: Path, container: bool, driver: bool = True) -> None:
    """Copy the in-host tools, the sglang package and pct/lxc-attach into a machine's lab layer.

    ``driver=False``: a host without the NVIDIA driver, so no nvidia-smi, nvbandwidth,
    nvidia-persistenced nor libnvidia-ml.so.1.
    """
    tools = PKG / "tools"
    for name, rel in TOOL_PATHS.items():
        if not driver and name in DRIVER_TOOLS:
            continue
        for cand in (tools / name, tools / f"{name}.py"):
            if cand.is_file():
                dst = root / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                if dst.exists() or dst.is_symlink():
                    dst.unlink()
                shutil.copyfile(cand, dst)
                dst.chmod(0o755)
                break
    site = root / HOST_PY_SITE
    site.mkdir(parents=True, exist_ok=True)
    for pkg in ("sglang", "gpulab_tools"):
        src = tools / pkg
        if src.is_dir():
            shutil.copytree(src, site / pkg, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            # Compiled into the layer, as a distribution's package ships its .pyc: otherwise the
            # first nvidia-smi of a run writes its cache into the host's own files, and a run that
            # must write nothing (--check-only, tests/engine/test_check_only_writes_nothing_lab.py) would
            # be blamed for the lab's own write.
            compileall.compile_dir(site / pkg, quiet=1)
    lib = root / "usr/local/lib/gpulab"
    lib.mkdir(parents=True, exist_ok=True)
    if driver:
        (root / nvml.LIB_PATH).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(nvml.build(), root / nvml.LIB_PATH)
    shutil.copyfile(PKG / "hosttools" / "ptyhold.py", lib / "ptyhold.py")
    real_uname = shutil.which("uname") or "/usr/bin/uname"
    shutil.copy2(real_uname, lib / "uname.real")
    shutil.copyfile(PKG / "hosttools" / "uname", root / "usr/bin/uname")
    (root / "usr/bin/uname").chmod(0o755)
    if not container:
        for rel in HOST_TOOL_PATHS:
            dst = root / rel
            name = Path(rel).name
            shutil.copyfile(PKG / "hosttools" / name, dst)
            dst.chmod(0o755)


def populate_files(root: Path, prof: Profile, scale: str) -> None:
    if not prof.files:
        return
    import importlib

    files = importlib.import_module("gpulab.host.datatrees")  # H4's generator; only hosts with trees need it

    for tree in prof.files:
        target = root / tree.root.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        files.populate(target, tree, scale)

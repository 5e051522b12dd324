"""FUSE daemon that serves a lab host's ``/sys/bus/pci``, ``/sys/kernel/iommu_groups`` and ctl files.

Run: ``python -m gpulab.kernel.sysfs --profile FILE --state DIR --mount DIR --devdir DIR`` (foreground).
The mount has three subtrees that the lab binds into the host: ``pci/`` over ``/sys/bus/pci``,
``iommu_groups/`` over ``/sys/kernel/iommu_groups`` and ``ctl/`` over ``/var/lib/gpulab/ctl``.
Symlinks are relative like the kernel's and resolve inside the host (``devices/BDF/driver ->
../../../../bus/pci/drivers/nvidia``). Reads always reach the model (``direct_io``); writes raise
the kernel's errno and are recorded with the host path in ``STATE/record.jsonl``.

``ctl/``: ``persistence/BDF`` (legacy persistence mode, 0/1), ``minor/BDF`` (current nvidia minor),
``kernel_holders/BDF`` (kernel modules holding the GPU: write ``nvidia_uvm`` to add, ``-nvidia_uvm``
to drop, empty to clear), ``gsp/BDF`` (1 when the GPU's firmware runs; write ``open`` to open the
GPU as a first client does, which waits for the firmware to boot), ``state.json`` (the whole
model), ``reset`` (write 1: back to the profile's boot state).

Two more subtrees are for the lab to bind over the host's own: ``module/`` over ``/sys/module``
(the NVIDIA modules with ``refcnt``, ``initstate``, ``holders/`` and ``parameters/``, plus any module
of the profile's ``module_params``, e.g. ``kvm_amd/parameters/sev_snp``) and ``proc/modules`` over
``/proc/modules``. GPUs bound to nvidia show ``drm/cardN`` and ``drm/renderD(128+N)`` when
nvidia_drm has ``modeset=Y``, as drm_dev_register() makes them.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import functools
import itertools
import os
import stat
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

try:
    import mfusepy
except OSError as exc:  # mfusepy raises OSError at import where libfuse is missing: tests skip on ImportError
    raise ImportError(f"mfusepy cannot load libfuse ({exc}): apt-get install fuse3") from exc

from gpulab.kernel.model import HostModel, SysfsError
from gpulab.kernel.standalone import StandaloneMount
from gpulab.kernel.sysfs_tree import HOST_PREFIX, SysfsTree
from gpulab.profiles.load import ProfileError, default_domain_for, load_profile

__all__ = ["StandaloneMount", "SysfsOps", "main"]  # StandaloneMount lives in gpulab.kernel.standalone

# libfuse calls the operations from threads of its own. ctypes makes a Python thread state for
# such a thread at every call and frees it when the call returns (PyGILState_Ensure/Release), and
# Python 3.11 maps and unmaps a fresh frame stack for each: a 1-host health run made 1,385 FUSE
# requests and 1,308 mmap/munmap pairs (strace -c on the daemon). One more PyGILState_Ensure, never
# released, keeps each libfuse thread's state for the thread's life (what C extensions do for
# their own threads); libfuse starts a worker thread rarely (2 in that run).
_pinned = threading.local()
_gil_ensure = ctypes.pythonapi.PyGILState_Ensure
_gil_ensure.restype = ctypes.c_int


def _keep_thread_state(fn: Any) -> Any:
    """Wrap a FUSE operation so that its thread's Python state is kept between calls."""

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        if not getattr(_pinned, "kept", False):
            _gil_ensure()
            _pinned.kept = True
        return fn(*args, **kwargs)

    return op


class SysfsOps(SysfsTree, mfusepy.Operations):
    """mfusepy operations over a HostModel."""

    use_ns = True

    def __init__(self, model: HostModel) -> None:
        self.model = model
        self.t0 = int(time.time() * 1e9)
        self._fuse_ptr: int | None = None
        self._watch: threading.Thread | None = None
        self._tls = threading.local()
        self._fh = itertools.count(1)
        self._pending: dict[int, tuple[str, str, int | None]] = {}
        self._pending_lock = threading.Lock()

    # ------------------------------------------------------------ tree

    def _unbind(self, drv: str, bdf: str) -> None:
        if drv == "nvidia" and bdf in self.model.gpu_bdfs:
            # Validate now (ENODEV comes from write), wait in flush: the kernel holds the FUSE
            # file's inode lock for the whole write, which would also stall every other writer
            # of this attribute; kernfs has no such lock. The writer still blocks, in close().
            self.model.check_unbind(drv, bdf)
            self._tls.defer = bdf
            return
        self.model.unbind(drv, bdf)

    def _finish_unbind(self, fh: int) -> None:
        with self._pending_lock:
            job = self._pending.pop(fh, None)
        if job is None:
            return
        bdf, host_path, pid = job
        blocked: list[bool] = []

        def on_wait() -> None:
            blocked.append(True)
            self.model.record(host_path, bdf, 0, pid, result="blocked")

        try:
            waited = self.model.unbind("nvidia", bdf, on_wait=on_wait)
        except SysfsError as e:
            assert e.errno is not None
            self.model.record(host_path, bdf, e.errno, pid)
            raise mfusepy.FuseOSError(e.errno) from None
        extra = {"blocked_s": round(waited, 3)} if blocked else {}
        self.model.record(host_path, bdf, 0, pid, **extra)

    def _uid(self) -> int:
        try:
            return int(mfusepy.fuse_get_context()[0])
        except Exception:
            return 0

    def _pid(self) -> int | None:
        try:
            return int(mfusepy.fuse_get_context()[2])
        except Exception:
            return None

    def init(self, path: str) -> None:
        # Watch for libfuse's own exit (SIGTERM/SIGINT, fusermount -u) so a blocked nvidia
        # unbind gives up and libfuse can join its workers instead of hanging.
        try:
            lib = mfusepy._libfuse  # type: ignore[attr-defined]
            lib.fuse_get_session.restype = ctypes.c_void_p
            lib.fuse_get_session.argtypes = [ctypes.c_void_p]
            lib.fuse_session_exited.argtypes = [ctypes.c_void_p]
            fuse_ptr = ctypes.c_void_p(lib.fuse_get_context().contents.fuse)
            se = lib.fuse_get_session(fuse_ptr)
        except Exception:
            return

        def watch() -> None:
            while not self.model.stopping.is_set():
                if lib.fuse_session_exited(se):
                    self.model.stopping.set()
                    return
                time.sleep(0.1)

        self._watch = threading.Thread(target=watch, name="fuse-exit-watch", daemon=True)
        self._watch.start()

    def destroy(self, path: str) -> None:
        self.model.stopping.set()

    @_keep_thread_state
    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        node = self.lookup(path)
        base = {"st_uid": 0, "st_gid": 0, "st_atime": self.t0, "st_mtime": self.t0, "st_ctime": self.t0}
        if node.kind == "dir":
            return {**base, "st_mode": stat.S_IFDIR | node.mode, "st_nlink": 2, "st_size": 0}
        if node.kind == "link":
            return {**base, "st_mode": stat.S_IFLNK | 0o777, "st_nlink": 1, "st_size": len(node.target)}
        return {**base, "st_mode": stat.S_IFREG | node.mode, "st_nlink": 1, "st_size": 4096}

    @_keep_thread_state
    def readdir(self, path: str, fh: Any) -> list[str]:
        node = self.lookup(path)
        if node.kind != "dir":
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        return [".", "..", *node.children()]

    @_keep_thread_state
    def readlink(self, path: str) -> str:
        node = self.lookup(path)
        if node.kind != "link":
            raise mfusepy.FuseOSError(errno.EINVAL)
        return node.target

    @_keep_thread_state
    def open(self, path: str, flags: int) -> int:
        node = self.lookup(path)
        if node.kind == "dir":
            raise mfusepy.FuseOSError(errno.EISDIR)
        acc = flags & os.O_ACCMODE
        if acc in (os.O_WRONLY, os.O_RDWR) and node.write is None and node.write_bin is None:
            raise mfusepy.FuseOSError(errno.EACCES)
        if acc in (os.O_WRONLY, os.O_RDWR) and self._uid() != 0:
            # sysfs attributes are root's 0644/0200 files (and type wants CAP_SYS_ADMIN)
            raise mfusepy.FuseOSError(errno.EACCES)
        if acc in (os.O_RDONLY, os.O_RDWR) and node.read is None and node.read_bin is None:
            raise mfusepy.FuseOSError(errno.EACCES)
        return next(self._fh)

    @_keep_thread_state
    def flush(self, path: str, fh: Any) -> int:
        self._finish_unbind(int(fh))
        return 0

    @_keep_thread_state
    def release(self, path: str, fh: Any) -> int:
        try:
            self._finish_unbind(int(fh))
        except mfusepy.FuseOSError:
            pass
        return 0

    @_keep_thread_state
    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        node = self.lookup(path)
        if node.read_bin is not None:
            data = node.read_bin()
            if self._uid() != 0:
                data = data[:64]  # like the kernel: only the standard header without CAP_SYS_ADMIN
            return data[offset : offset + size]
        if node.read is None:
            raise mfusepy.FuseOSError(errno.EACCES)
        data = node.read().encode()
        return data[offset : offset + size]

    @_keep_thread_state
    def truncate(self, path: str, length: int, fh: Any = None) -> int:
        self.lookup(path)
        return 0

    @_keep_thread_state
    def write(self, path: str, data: bytes, offset: int, fh: Any) -> int:
        node = self.lookup(path)
        parts = [p for p in path.split("/") if p]
        host_path = HOST_PREFIX.get(parts[0], "") + "/" + "/".join(parts[1:])
        if node.write_bin is not None:
            node.write_bin(bytes(data), offset)
            self.model.record(host_path, f"@{offset:#x}:{bytes(data).hex()}", 0, self._pid())
            return len(data)
        if node.write is None:
            raise mfusepy.FuseOSError(errno.EACCES)
        raw = data.decode("utf-8", "replace")
        # sysfs_streq / the kernel's stores ignore one trailing newline
        value = raw[:-1] if raw.endswith("\n") else raw
        pid = self._pid()
        self._tls.defer = None
        try:
            node.write(value)
        except SysfsError as e:
            assert e.errno is not None
            self.model.record(host_path, value, e.errno, pid)
            raise mfusepy.FuseOSError(e.errno) from None
        if self._tls.defer is not None:
            with self._pending_lock:
                self._pending[int(fh)] = (self._tls.defer, host_path, pid)
            return len(data)
        self.model.record(host_path, value, 0, pid)
        return len(data)

    @_keep_thread_state
    def chmod(self, path: str, mode: int) -> int:
        raise mfusepy.FuseOSError(errno.EPERM)

    @_keep_thread_state
    def chown(self, path: str, uid: int, gid: int) -> int:
        raise mfusepy.FuseOSError(errno.EPERM)

    @_keep_thread_state
    def utimens(self, path: str, times: Any = None) -> int:
        self.lookup(path)
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Mount the lab sysfs for one host and serve it in the foreground until unmounted."""
    ap = argparse.ArgumentParser(prog="python -m gpulab.kernel.sysfs", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile name, YAML or JSON file")
    ap.add_argument("--state", required=True, help="state dir (record.jsonl goes there)")
    ap.add_argument("--mount", required=True, help="mount point")
    ap.add_argument(
        "--devdir", required=True, help="dir with nvidiaN files (holders are found by st_dev/st_ino)"
    )
    ap.add_argument("--kernel", help="override the profile's kernel release (picks the errno era)")
    ap.add_argument(
        "--cmdline",
        help="kernel command line the host booted with (e.g. read from its /etc/kernel/cmdline at a lab "
        "reboot): iommu=pt, iommu.passthrough= and iommu.strict= pick the groups' boot type",
    )
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    overrides: dict[str, str] = {"kernel": args.kernel} if args.kernel else {}
    try:
        profile = load_profile(args.profile, overrides or None)
        if args.cmdline is not None:
            overrides["cmdline"] = args.cmdline
            overrides["default_domain"] = default_domain_for(args.cmdline, profile.default_domain)
            profile = load_profile(args.profile, overrides)
    except ProfileError as e:
        print(f"gpulab.kernel.sysfs: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.state, exist_ok=True)
    model = HostModel(profile, args.state, args.devdir)
    ops = SysfsOps(model)
    try:
        mfusepy.FUSE(
            ops,
            args.mount,
            foreground=True,
            allow_other=True,
            direct_io=True,
            # no kernel caching of names or attributes: symlinks must vanish the moment a driver
            # lets go, and appear the moment it binds
            entry_timeout=0,
            attr_timeout=0,
            negative_timeout=0,
            fsname="gpulab-sysfs",
            debug=args.debug,
        )
    except RuntimeError as e:
        # libfuse's main returns 8 when its loop ended on SIGTERM/SIGINT: a normal stop.
        if str(e) != "8":
            print(f"gpulab.kernel.sysfs: fuse ended with {e}", file=sys.stderr)
            return 1
    finally:
        model.stopping.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

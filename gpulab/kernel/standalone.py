"""Run the lab's sysfs daemon on a temporary mount point, for tests and tools."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from gpulab.profiles.load import load_profile

__all__ = ["StandaloneMount"]


class StandaloneMount:
    """Run the daemon on a temporary mount point (tests, tools): a context manager.

    ``StandaloneMount(profile, workdir, kernel=None)`` creates ``workdir/{mnt,state,dev}`` (``dev``
    with ``nvidiaN`` for every GPU minor of the profile, ``nvidiactl``, ``nvidia-uvm``), starts
    ``python -m gpulab.kernel.sysfs`` and waits (bounded) until the mount answers. On exit it stops the
    daemon (SIGTERM, then SIGKILL after 5 s) and lazily unmounts whatever is left.
    """

    def __init__(self, profile: str, workdir: str | os.PathLike[str], kernel: str | None = None) -> None:
        self.profile = profile
        self.work = os.fspath(workdir)
        self.kernel = kernel
        self.mnt = os.path.join(self.work, "mnt")
        self.state = os.path.join(self.work, "state")
        self.dev = os.path.join(self.work, "dev")
        self.proc: Any = None

    def __enter__(self) -> StandaloneMount:
        import subprocess

        prof = load_profile(self.profile, {"kernel": self.kernel} if self.kernel else None)
        for d in (self.mnt, self.state, self.dev):
            os.makedirs(d, exist_ok=True)
        for name in [f"nvidia{g.minor}" for g in prof.gpus] + ["nvidiactl", "nvidia-uvm"]:
            open(os.path.join(self.dev, name), "a").close()
        argv = [sys.executable, "-m", "gpulab.kernel.sysfs", "--profile", self.profile, "--state", self.state]
        argv += ["--mount", self.mnt, "--devdir", self.dev]
        if self.kernel:
            argv += ["--kernel", self.kernel]
        log = open(os.path.join(self.work, "sysfs.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"gpulab.kernel.sysfs exited with {self.proc.returncode}; see {self.work}/sysfs.log"
                )
            if os.path.ismount(self.mnt) and os.path.isdir(os.path.join(self.mnt, "pci", "devices")):
                return self
            time.sleep(0.05)
        self.__exit__(None, None, None)
        raise RuntimeError(f"gpulab.kernel.sysfs did not mount {self.mnt} within 15 s")

    def stop(self, timeout: float = 5.0) -> int | None:
        """Send SIGTERM and wait; return the exit code (None if it had to be killed)."""
        import signal as _signal
        import subprocess

        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(_signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                return None
        rc: int = self.proc.returncode
        return rc

    def __exit__(self, *exc: object) -> None:
        import subprocess

        self.stop()
        if os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False, timeout=10)

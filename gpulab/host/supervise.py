"""A lab host's supervisor: the parent of its launcher, which boots the host again on a reboot.

    python -m gpulab.host.supervise NAME -- LAUNCHER...

``LabHost._launch`` starts the host's launcher (``nsenter ... unshare --pid --fork ... python -m
gpulab.host.boot``) under this process. A reboot inside the host (``systemctl reboot``) ends in
systemd-shutdown calling reboot(2). In a PID namespace other than the first that ends the
namespace's init, and "wait(2) in the parent process reports that the child was killed with a
SIGHUP signal" (SIGINT for a halt or power-off; reboot(2), "Behavior inside PID namespaces",
https://man7.org/linux/man-pages/man2/reboot.2.html); ``unshare --fork`` then ends itself with
the same signal. A container manager boots a container whose init ended so again: systemd-nspawn
exits 133 when the container rebooted, and systemd-nspawn@.service restarts it on that status
(``RestartForceExitStatus=133``; https://www.freedesktop.org/software/systemd/man/latest/systemd-
nspawn.html, https://github.com/systemd/systemd/blob/main/units/systemd-nspawn%40.service.in).
Here the host boots again as ``LabHost.reboot`` boots it (the overlay kept), with a kernel log of
its own (``LabHost.reboot_from_inside``); any other end (the lab's SIGKILL, a power-off) leaves
the host down.

Only the standard library is imported until a reboot: this process is started at every boot.
"""

from __future__ import annotations

import signal
import subprocess
import sys

__all__ = ["main", "supervise"]


def supervise(name: str, launcher: list[str]) -> int:
    """Run host ``name``'s launcher; when its PID 1 ends in a reboot, boot the host again."""
    p = subprocess.Popen(launcher, stdin=subprocess.DEVNULL)
    rc = p.wait()
    if rc != -signal.SIGHUP:
        return 0 if rc == 0 else 1
    print(
        f"gpulab.host.supervise: {name}: PID 1 asked for a reboot; booting again", file=sys.stderr, flush=True
    )
    from gpulab.host.lab import LabHost  # only a reboot needs the lab's machinery

    LabHost(name).reboot_from_inside()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``NAME -- LAUNCHER...`` and supervise."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m gpulab.host.supervise NAME -- LAUNCHER...", file=sys.stderr)
        return 2
    return supervise(args[0], args[2:])


if __name__ == "__main__":
    sys.exit(main())

"""Byte channels to targets: local processes, SSH exec channels, and command prefixes.

A `Launcher` starts a program on a target and returns a `RawChannel` (stdin, stdout, a stderr
tail, exit status).  The implementations live in modules of their own, by role:

- `channels.py`: `RawChannel` and `ProcessChannel` (a local child process);
- `launch.py`: `Launcher`, `LocalLauncher` and `PrefixLauncher` (sudo, docker exec, pct exec ...);
- `ssh.py`: `SSHTransport` (paramiko, host keys checked here), `SSHChannel`, `SSHLauncher`;
- `openssh.py`: bulk channels under the OpenSSH client, falling back to paramiko.

This module re-exports their public names, the import path callers have always used.
"""

from __future__ import annotations

from pytest_gpuhost.exec.channels import ProcessChannel, RawChannel
from pytest_gpuhost.exec.launch import Launcher, LocalLauncher, PrefixLauncher
from pytest_gpuhost.exec.ssh.paramiko import HOST_KEY_POLICIES, SSHChannel, SSHLauncher, SSHTransport

__all__ = [
    "HOST_KEY_POLICIES",
    "Launcher",
    "LocalLauncher",
    "PrefixLauncher",
    "ProcessChannel",
    "RawChannel",
    "SSHChannel",
    "SSHLauncher",
    "SSHTransport",
]

"""Launchers: start a program on one target and return its `RawChannel`.

`LocalLauncher` runs it on this machine, `PrefixLauncher` wraps another launcher's argv
(`sudo -n`, `docker exec -i NAME`, `pct exec ID --`, `lxc-attach -n NAME --`); the SSH launcher
are in `ssh/openssh.py` and `ssh/paramiko.py`.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from pytest_gpuhost.exec.channels import ProcessChannel, RawChannel

__all__ = ["Launcher", "LocalLauncher", "PrefixLauncher"]


class Launcher:
    """Starts programs on one target; see the module docstring."""

    description: str = ""
    #: what carries the programs: "local", "openssh" (the system's ssh client), "paramiko"
    client: str = "local"

    def open(self, argv: Sequence[str]) -> RawChannel:
        raise NotImplementedError

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        """Like `open`, for a program that moves bulk bytes (see the module docstring)."""
        return self.open(argv)

    def close(self) -> None:
        """Release what the launcher holds (an SSH transport); channels must be closed first."""


class LocalLauncher(Launcher):
    """Run programs on this machine; `env` is overlaid on the environment (e.g. PATH, for tests)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(env) if env else None
        self.description = "local"

    def open(self, argv: Sequence[str]) -> RawChannel:
        return ProcessChannel(argv, self.env)

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        return ProcessChannel(argv, self.env, bulk=True)


class PrefixLauncher(Launcher):
    """Run programs through another launcher behind a fixed argv prefix (sudo, docker exec, ...)."""

    def __init__(
        self, base: Launcher, prefix: Sequence[str], description: str = "", *, owns_base: bool = False
    ) -> None:
        self.base = base
        self.prefix = list(prefix)
        self.description = description or shlex.join(self.prefix)
        # True when nothing else closes `base` (sudo over SSH); False for a container reached
        # through its host's launcher, which the host's connection closes.
        self.owns_base = owns_base

    @property
    def client(self) -> str:  # type: ignore[override]  # a prefix runs on its base's client
        return self.base.client

    def open(self, argv: Sequence[str]) -> RawChannel:
        return self.base.open(self.prefix + list(argv))

    def open_bulk(self, argv: Sequence[str]) -> RawChannel:
        return self.base.open_bulk(self.prefix + list(argv))

    def close(self) -> None:
        if self.owns_base:
            self.base.close()

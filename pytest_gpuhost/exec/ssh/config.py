"""ssh_config read for the paramiko fallback, so it reaches the host `ssh` would reach.

The OpenSSH client reads its configuration itself; this module is only for machines without it.
It applies what paramiko's `SSHConfig` parses (`Host`/`Match` blocks) for `HostName`, `User`,
`Port`, `IdentityFile`, `UserKnownHostsFile` and `ProxyJump`, first value wins as in ssh: the
file given with `--ssh-config`, else the user's `~/.ssh/config` then `/etc/ssh/ssh_config`.
Not supported there (the OpenSSH client does them): `Include`, `ProxyCommand`, `CertificateFile`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_gpuhost.errors import ConnectError

if TYPE_CHECKING:
    import paramiko

__all__ = ["DEFAULT_CONFIGS", "Hop", "Resolved", "parse_jump", "resolve"]

DEFAULT_CONFIGS = ("~/.ssh/config", "/etc/ssh/ssh_config")


@dataclass(frozen=True)
class Hop:
    """One `ProxyJump` hop as written: `[user@]host[:port]`."""

    host: str
    user: str | None = None
    port: int | None = None


@dataclass
class Resolved:
    """Where a name leads once ssh_config is applied."""

    hostname: str
    port: int
    user: str | None
    identities: list[str] = field(default_factory=list)
    known_hosts: str | None = None  # the first UserKnownHostsFile, if the config names one
    jumps: list[Hop] = field(default_factory=list)


def _configs(path: str | os.PathLike[str] | None) -> list[paramiko.SSHConfig]:
    import paramiko

    paths = [Path(path).expanduser()] if path else [Path(p).expanduser() for p in DEFAULT_CONFIGS]
    found = []
    for p in paths:
        try:
            found.append(paramiko.SSHConfig.from_path(str(p)))
        except FileNotFoundError:
            if path:
                raise ConnectError(f"ssh config file {p} not found") from None
        except (OSError, paramiko.ConfigParseError, ValueError) as exc:
            raise ConnectError(f"cannot read ssh config file {p}: {exc}") from exc
    return found


def _lookup(name: str, path: str | os.PathLike[str] | None) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for config in _configs(path):
        for key, value in config.lookup(name).items():
            merged.setdefault(key, value)
    return merged


def parse_jump(text: str) -> list[Hop]:
    """Parse a ProxyJump value (`none` means no jump); raise ConnectError when it is malformed."""
    if text.strip().lower() == "none":
        return []
    hops = []
    for item in text.split(","):
        item = item.strip().removeprefix("ssh://")
        user, _, rest = item.rpartition("@")
        host, port = rest, None
        if rest.startswith("["):
            host, _, tail = rest[1:].partition("]")
            port = tail[1:] if tail.startswith(":") else None
        elif rest.count(":") == 1:
            host, _, port = rest.partition(":")
        if not host or (port is not None and not port.isdigit()):
            raise ConnectError(f"bad ProxyJump hop {item!r}: write [user@]host[:port]")
        hops.append(Hop(host, user or None, int(port) if port else None))
    return hops


def resolve(
    name: str,
    port: int | None,
    user: str | None,
    config: str | os.PathLike[str] | None,
) -> Resolved:
    """Apply ssh_config to `name`: what was given explicitly (port, user) wins over the config."""
    found = _lookup(name, config)
    try:
        cfg_port = int(found.get("port", 22))
    except ValueError:
        raise ConnectError(
            f"ssh config gives {name} a port that is not a number: {found['port']!r}"
        ) from None
    known = str(found["userknownhostsfile"]).split()[0] if found.get("userknownhostsfile") else None
    return Resolved(
        hostname=str(found.get("hostname") or name),
        port=port or cfg_port,
        user=user or found.get("user"),
        identities=[os.path.expanduser(p) for p in found.get("identityfile", [])],
        known_hosts=os.path.expanduser(known) if known else None,
        jumps=parse_jump(str(found["proxyjump"])) if found.get("proxyjump") else [],
    )

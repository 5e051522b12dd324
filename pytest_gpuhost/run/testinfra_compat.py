"""testinfra's own options, read as aliases of ours where they mean the same, refused otherwise.

pytest-testinfra is a dependency, so its options (`--hosts`, `--connection`, `--ssh-identity-file`,
...) are on every command line's menu; an operator who knows testinfra types them. Each is either
folded into our settings (`--hosts=a,b` is `--host=ssh://a --host=ssh://b`) or refused with one
line naming what to type instead. None is ignored: a run that silently dropped `--hosts` would
check nothing and pass. `--sudo` and `--ssh-config` need nothing here: both plugins declare
them with the same destination (`run/settings.py: SHARED_FLAGS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import pytest

__all__ = ["REFUSED", "apply"]

#: testinfra options with no gpuhost meaning: dest -> (flag, what to do instead).
REFUSED: dict[str, tuple[str, str]] = {
    "ssh_extra_args": (
        "--ssh-extra-args",
        "gpuhost passes no extra ssh arguments; use --ssh-identity, --known-hosts, --connect-timeout",
    ),
    "sudo_user": ("--sudo-user", "gpuhost's --sudo runs commands as root only; drop --sudo-user"),
    "force_ansible": ("--force-ansible", "gpuhost runs commands through its own agent; drop --force-ansible"),
    "nagios": ("--nagios", "gpuhost has no Nagios output; read the fleet summary (--fleet-json) instead"),
}


class _Where(Protocol):
    """The settings this module fills in (`run.settings.Settings`, which imports this module)."""

    hosts: list[str]
    ssh_identity: str | None
    inventory: str | None


def _given(config: pytest.Config, dest: str) -> Any:
    value = config.getoption(dest, default=None)
    return None if value in (None, False, "", []) else value


def _host_urls(hosts: str, connection: str | None) -> list[str]:
    """Turn testinfra's comma-separated `--hosts` into --host URLs (`--connection` names the scheme)."""
    scheme = connection or "ssh"
    urls = []
    for item in hosts.split(","):
        item = item.strip()
        if item:
            urls.append(item if "://" in item else f"{scheme}://{item}")
    return urls


def _must_exist(flag: str, path: Any) -> None:
    if not Path(str(path)).expanduser().is_file():
        raise pytest.UsageError(f"gpuhost: testinfra's {flag}={str(path)!r}: no such file")


def apply(config: pytest.Config, s: _Where) -> None:
    """Fold testinfra's options into `s`, or raise UsageError (one line) for one we cannot honour."""
    for dest, (flag, instead) in REFUSED.items():
        value = _given(config, dest)
        if value is not None:
            shown = "" if value is True else f"={value!r}"
            raise pytest.UsageError(f"gpuhost: testinfra's {flag}{shown} is not supported: {instead}")
    hosts = _given(config, "hosts")
    connection = _given(config, "connection")
    if connection is not None and hosts is None:
        raise pytest.UsageError(
            f"gpuhost: testinfra's --connection={connection!r} needs --hosts; "
            f"or write the scheme into each target: --host={connection}://HOST"
        )
    if hosts is not None:
        urls = _host_urls(str(hosts), None if connection is None else str(connection))
        # An xdist worker sees both: the controller published the URLs as --host.
        if s.hosts and s.hosts != urls:
            raise pytest.UsageError(
                f"gpuhost: both --host and testinfra's --hosts={hosts!r} are given; use --host=URL (repeat it)"
            )
        s.hosts = urls
    identity = _given(config, "ssh_identity_file")
    if identity is not None:
        _must_exist("--ssh-identity-file", identity)
        if s.ssh_identity and str(identity) != s.ssh_identity:
            raise pytest.UsageError(
                f"gpuhost: --ssh-identity={s.ssh_identity!r} and testinfra's "
                f"--ssh-identity-file={identity!r} disagree; give one"
            )
        s.ssh_identity = str(identity)
    inventory = _given(config, "ansible_inventory")
    if inventory is not None:
        _must_exist("--ansible-inventory", inventory)
        if s.inventory and str(inventory) != s.inventory:
            raise pytest.UsageError(
                f"gpuhost: --inventory={s.inventory!r} and testinfra's "
                f"--ansible-inventory={inventory!r} disagree; give one"
            )
        s.inventory = str(inventory)

"""Host keys checked against a known_hosts file, by this code rather than paramiko's policies.

So that a changed key can be reported with the file and line it contradicts: a changed key is
refused under every policy; an unknown key is refused under "strict" and appended to the file
under "accept-new".  Hashed (`|1|...`) and plain host patterns are understood; markers
(`@cert-authority`, `@revoked`) are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_gpuhost.errors import ConnectError

if TYPE_CHECKING:
    import paramiko

__all__ = ["HOST_KEY_POLICIES", "host_key_name", "known_entries", "prefer_known_types", "verify_host_key"]

HOST_KEY_POLICIES = ("strict", "accept-new")

KnownEntries = list[tuple[int, "paramiko.PKey"]]


def host_key_name(host: str, port: int) -> str:
    """Return the name `host` has in known_hosts: bare on port 22, else `[host]:port`."""
    return host if port == 22 else f"[{host}]:{port}"


def _matches(patterns: list[str], name: str) -> bool:
    import paramiko

    for pattern in patterns:
        if pattern.startswith("|1|"):
            if paramiko.HostKeys.hash_host(name, pattern) == pattern:
                return True
        elif pattern == name:
            return True
    return False


def known_entries(path: Path, name: str) -> KnownEntries:
    """Return `(line number, key)` for every key `path` holds for `name` (none if it is missing)."""
    import paramiko

    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConnectError(f"cannot read known hosts file {path}: {exc.strerror}") from exc
    found = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#") or line.startswith("@"):
            continue
        fields = line.split()
        if len(fields) < 3 or not _matches(fields[0].split(","), name):
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields[:3]), lineno)
        except (paramiko.hostkeys.InvalidHostKey, ValueError):
            continue
        if entry is not None and entry.key is not None:
            found.append((lineno, entry.key))
    return found


def prefer_known_types(offered: Sequence[str], entries: KnownEntries) -> list[str]:
    """Put the key types `entries` hold first, as OpenSSH does.

    Otherwise a host with several keys could offer another type and look "unknown".
    """
    known = [k.get_name() for _, k in entries]
    preferred = [t for t in offered if any(t == kt or _rsa_alias(t, kt) for kt in known)]
    return preferred + [t for t in offered if t not in preferred]


def _rsa_alias(offered: str, known: str) -> bool:
    return known == "ssh-rsa" and offered in ("rsa-sha2-512", "rsa-sha2-256")


def verify_host_key(path: Path, policy: str, name: str, key: paramiko.PKey, entries: KnownEntries) -> None:
    """Accept `key` for `name`, or raise ConnectError saying which line of `path` it contradicts."""
    same_type = [(n, k) for n, k in entries if k.get_name() == key.get_name()]
    for _n, known in same_type:
        if known.asbytes() == key.asbytes():
            return
    if same_type:
        lineno = same_type[0][0]
        raise ConnectError(
            f"host key for {name} does not match {path} line {lineno}: refusing "
            f"(offered {key.get_name()} {key.fingerprint})"
        )
    if policy != "accept-new":
        raise ConnectError(
            f"host key for {name} is not in {path} ({key.get_name()} {key.fingerprint}): "
            "refusing under the strict policy; add it with ssh-keyscan or use --host-key-policy=accept-new"
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode("ascii"))
    finally:
        os.close(fd)

"""Host keys checked against a known_hosts file, by this code rather than paramiko's policies.

So that a changed key can be reported with the file and line it contradicts: a changed key is
refused under every policy; an unknown key is refused under "strict" and appended to the file
under "accept-new".  Hashed (`|1|...`) entries and OpenSSH's patterns (`*`, `?`, `!negated`)
are understood.  This is the paramiko fallback's check (the OpenSSH client checks its own):
a key under `@revoked` is refused under every policy, and a host that only a `@cert-authority`
line vouches for is refused, because paramiko cannot verify host certificates.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_gpuhost.errors import ConnectError

if TYPE_CHECKING:
    import paramiko

__all__ = [
    "HOST_KEY_POLICIES",
    "KnownHosts",
    "host_key_name",
    "known_entries",
    "known_hosts",
    "prefer_known_types",
    "verify_host_key",
]

HOST_KEY_POLICIES = ("strict", "accept-new")

KnownEntries = list[tuple[int, "paramiko.PKey"]]


def host_key_name(host: str, port: int) -> str:
    """Return the name `host` has in known_hosts: bare on port 22, else `[host]:port`."""
    return host if port == 22 else f"[{host}]:{port}"


def _matches(patterns: list[str], name: str) -> bool:
    """Match `name` as OpenSSH does: a negated pattern that matches wins over every other."""
    import paramiko

    hit = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        if pattern.startswith("|1|"):
            found = paramiko.HostKeys.hash_host(name, pattern) == pattern
        else:
            found = fnmatch.fnmatchcase(name.lower(), pattern.lower().replace("[", "[[]"))
        if found and negated:
            return False
        hit = hit or found
    return hit


@dataclass
class KnownHosts:
    """What one known_hosts file says about one host name: plain, `@revoked` and CA keys."""

    path: Path
    keys: KnownEntries = field(default_factory=list)
    revoked: KnownEntries = field(default_factory=list)
    authorities: KnownEntries = field(default_factory=list)


def known_hosts(path: Path, name: str) -> KnownHosts:
    """Read what `path` holds for `name`: nothing if the file is missing; ConnectError if unreadable."""
    import paramiko

    found = KnownHosts(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return found
    except OSError as exc:
        raise ConnectError(f"cannot read known hosts file {path}: {exc.strerror}") from exc
    for lineno, raw in enumerate(text.splitlines(), 1):
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else ""
        if len(fields) < 3:
            continue
        patterns = fields[0].split(",")
        # A marker line also matches the bare host of `[host]:port`, as OpenSSH's did here: it
        # only ever makes us refuse (a revoked key, a CA the fallback cannot use), never accept.
        if not (_matches(patterns, name) or (marker and _matches(patterns, _bare(name)))):
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(fields[:3]), lineno)
        except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError):
            continue
        if entry is None or entry.key is None:
            continue
        if marker == "@revoked":
            found.revoked.append((lineno, entry.key))
        elif marker == "@cert-authority":
            found.authorities.append((lineno, entry.key))
        elif not marker:
            found.keys.append((lineno, entry.key))
    return found


def _bare(name: str) -> str:
    return name[1:].rpartition("]")[0] if name.startswith("[") else name


def known_entries(path: Path, name: str) -> KnownEntries:
    """Return `(line number, key)` for every plain key `path` holds for `name`."""
    return known_hosts(path, name).keys


def prefer_known_types(offered: Sequence[str], entries: KnownEntries) -> list[str]:
    """Put the key types `entries` hold first, as OpenSSH does.

    Otherwise a host with several keys could offer another type and look "unknown".
    """
    known = [k.get_name() for _, k in entries]
    preferred = [t for t in offered if any(t == kt or _rsa_alias(t, kt) for kt in known)]
    return preferred + [t for t in offered if t not in preferred]


def _rsa_alias(offered: str, known: str) -> bool:
    return known == "ssh-rsa" and offered in ("rsa-sha2-512", "rsa-sha2-256")


def verify_host_key(
    path: Path, policy: str, name: str, key: paramiko.PKey, entries: KnownEntries | KnownHosts
) -> None:
    """Accept `key` for `name`, or raise ConnectError saying which line of `path` refuses it."""
    known = entries if isinstance(entries, KnownHosts) else KnownHosts(path, list(entries))
    for lineno, revoked in known.revoked:
        if revoked.asbytes() == key.asbytes():
            raise ConnectError(
                f"host key for {name} is marked @revoked in {path} line {lineno}: refusing "
                f"({key.get_name()} {key.fingerprint})"
            )
    same_type = [(n, k) for n, k in known.keys if k.get_name() == key.get_name()]
    for _n, k in same_type:
        if k.asbytes() == key.asbytes():
            return
    if same_type:
        lineno = same_type[0][0]
        raise ConnectError(
            f"host key for {name} does not match {path} line {lineno}: refusing "
            f"(offered {key.get_name()} {key.fingerprint})"
        )
    if known.authorities:
        # Trusting a CA and then accepting a plain key would bypass the CA: refuse under every policy.
        raise ConnectError(
            f"host {name} is vouched for by @cert-authority in {path} line {known.authorities[0][0]}, "
            "which the paramiko fallback cannot verify: install the OpenSSH client (ssh) or list the host's key"
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

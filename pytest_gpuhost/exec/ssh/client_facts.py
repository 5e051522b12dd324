"""What the OpenSSH client makes of its configuration: `ssh -G` and `ssh -V`, and our preferences.

`ssh -G HOST` prints every setting as ssh would use it for HOST (ssh(1)), after ssh_config,
`Match` blocks and our `-o` options; ssh/openssh.py reads it once per target (the host, port and
user it will reach, ProxyJump, and whether we may connect the socket ourselves:
ssh/direct.py).  `client_facts` runs once per process.
"""

from __future__ import annotations

import subprocess
from functools import lru_cache
from typing import NamedTuple

from pytest_gpuhost.exec.ssh.direct import openssh_version

__all__ = ["PREFERENCES", "ClientFacts", "client_facts", "config_end", "config_start", "parse_effective"]

# Preferences put first where ssh_config leaves the setting at ssh's default (an operator's own
# setting is kept).  AES-GCM: with AES-NI it costs both ends about half of chacha20-poly1305's CPU
# (839 MB in 1.9 s vs 3.1 s on this 2-core machine).  curve25519: the key exchange paramiko used;
# ssh's default sntrup761 hybrid cost the client 0.13 s of CPU per login here against 0.02 s
# (median of 5), a master 0.45 s against 0.16 s of wall time.  Set KexAlgorithms in ssh_config to
# keep the post-quantum exchange first.
PREFERENCES = {
    "ciphers": ("Ciphers", "^aes128-gcm@openssh.com,aes256-gcm@openssh.com"),
    "kexalgorithms": ("KexAlgorithms", "^curve25519-sha256,curve25519-sha256@libssh.org"),
}


class ClientFacts(NamedTuple):
    """What one `ssh` binary is: its defaults for PREFERENCES, its version, its `ssh -V` line."""

    defaults: dict[str, str]  # {} when it cannot prepend (`^`, OpenSSH 8.9+)
    version: tuple[int, int] | None  # None when not OpenSSH
    banner: str  # "OpenSSH_9.2p1 Debian-2+deb12u10, OpenSSL 3.0.19 27 Jan 2026", or "unknown (why)"


@lru_cache(maxsize=8)
def client_facts(ssh: str) -> ClientFacts:
    """Run `ssh -V` and two `ssh -G` at once, once per process and binary (the evidence's client
    version comes from here too: run/targets_stash.py)."""
    prepend = [a for key, value in PREFERENCES.values() for a in ("-o", f"{key}={value}")]
    try:
        runs = [
            config_start([ssh, "-G", "-F", "/dev/null", *extra, "gpuhost.invalid"]) for extra in (prepend, [])
        ]
        runs.append(config_start([ssh, "-V"]))
    except OSError as exc:
        return ClientFacts({}, None, f"unknown (ssh -V: {exc})")
    outs = [config_end(r) for r in runs]
    version_out = outs.pop()
    if version_out is None:
        banner = "unknown (ssh -V: no answer within 10 s)"
    else:  # OpenSSH prints it on stderr
        lines = (version_out[2] or version_out[1]).strip().splitlines()
        banner = lines[0] if lines else f"unknown (ssh -V printed nothing, exit {version_out[0]})"
    version = openssh_version(banner)
    if any(out is None or out[0] != 0 for out in outs):
        return ClientFacts({}, version, banner)
    found = parse_effective(outs[1][1])  # type: ignore[index]
    return ClientFacts({k: found[k] for k in PREFERENCES if k in found}, version, banner)


def config_start(argv: list[str]) -> subprocess.Popen[str]:
    """Start an `ssh -G` (its output is small: the pipes cannot fill before it is read)."""
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def config_end(proc: subprocess.Popen[str]) -> tuple[int, str, str] | None:
    """(exit status, stdout, stderr) of an `ssh -G`, or None when it took over 10 s (killed)."""
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    return proc.returncode, out, err


def parse_effective(text: str) -> dict[str, str]:
    """Parse `ssh -G` output (one `keyword value` per line; the first of a repeated keyword)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        found.setdefault(key, value)
    return found

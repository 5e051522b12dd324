"""What a host name may be: the rule `ssh://` URLs, inventories and the local node's name follow.

Names are hostile input (they become test ids, file names, HTML cells and Prometheus labels): a
host name is labels of letters, digits, `_` and `-`, or an IP address; anything else (markup,
spaces, control characters, a leading `-`) fails the rule. `inventory/names.py` refuses such an
inventory name with one line; `nodename.py` turns such a machine name into one that passes.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["valid_host_name"]

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^(?:{_LABEL}\.)*{_LABEL}\.?\Z")
_ADDRESS_CHARS = re.compile(r"[0-9A-Za-z:.%_-]+\Z")


def valid_host_name(name: str) -> bool:
    """Return whether `name` is a host name or an IP address (the rule `ssh://` URLs follow)."""
    if not name or len(name) > 253:
        return False
    if _HOSTNAME.match(
        name
    ):  # one regex first: names are mostly host names, and a failed ip_address costs 10x
        return True
    if not _ADDRESS_CHARS.match(name):  # an IPv6 scope (`fe80::1%eth0`) may otherwise hold anything
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False

"""Words that mean yes and no, for every place an operator writes a switch.

Command-line and ini options (run/options.py `boolean`), `gpuhost-nodecheck`'s flags, environment
and config file (nodecheck.py) read a switch the same way: true/false, yes/no, on/off or 1/0, any
case; empty is no.  No pytest here: gpuhost-nodecheck starts without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["as_bool"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def as_bool(raw: Any) -> bool:
    """Take true/false, yes/no, on/off or 1/0 (a bool as it is); raise ValueError for anything else."""
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"not a yes or no: {raw!r}")

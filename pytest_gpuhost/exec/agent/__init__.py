"""Assemble the agent program that runs on targets: core, probes, then `main()`.

The program is sent once per connection: a bootstrap (`python3 -u -c BOOTSTRAP`) reads a
decimal length line and that many bytes of zlib-compressed source from stdin, then `exec`s it.
The source is built once per process and cached.
"""

from __future__ import annotations

import functools
import re
import zlib
from pathlib import Path

__all__ = ["BOOTSTRAP", "agent_source", "agent_payload", "probe_files"]

_HERE = Path(__file__).resolve().parent
_FUTURE = re.compile(r"^from __future__ import [^\n]*\n", re.MULTILINE)

# Reads with os.read (unbuffered) so no protocol byte is swallowed by a buffer before main()
# takes fd 0 over.  Kept short: it travels on the command line of every agent start.
BOOTSTRAP = (
    "import os,sys,zlib\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c:sys.exit(3)\n"
    "  b+=c\n"
    " return b\n"
    "h=b''\n"
    "while not h.endswith(b'\\n'):h+=r(1)\n"
    "g={'__name__':'__gpuhost_agent__'}\n"
    "exec(compile(zlib.decompress(r(int(h))),'<gpuhost-agent>','exec'),g)\n"
)


def probe_files() -> list[Path]:
    """Return the probe modules that are part of the agent, in the order they are joined."""
    return sorted(_HERE.glob("probe_*.py"))


@functools.lru_cache(maxsize=1)
def agent_source() -> str:
    """Return the agent program: core, every probe (sorted by name), then the `main()` call.

    `from __future__` lines are dropped: they are only legal at the top of a program, and the
    agent keeps to syntax that old target Pythons understand anyway.
    """
    parts = [(_HERE / "agent.py").read_text(encoding="utf-8")]
    for path in probe_files():
        parts.append(f"\n# ---- {path.name}\n" + path.read_text(encoding="utf-8"))
    parts.append("\nmain()\n")
    return _FUTURE.sub("", "\n".join(parts))


@functools.lru_cache(maxsize=1)
def agent_payload() -> bytes:
    """Return the bytes written to the bootstrap's stdin: length line, compressed program."""
    body = zlib.compress(agent_source().encode("utf-8"), 9)
    return b"%d\n" % len(body) + body

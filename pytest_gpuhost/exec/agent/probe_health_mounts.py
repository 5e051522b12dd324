"""Agent probe: the `health_mounts` fact, which mount holds each data path and named mount.

Runs on the target (stdlib only, Python 3.6 syntax; see exec/agent/__init__.py).  Read-only: one
read of /proc/self/mountinfo, no process.  suites/health asks for it in the same request as the
`health` fact (modules/health/facts.py merges it as the `mounts` part; modules/health/mounts.py
judges it).
"""

import re

from pytest_gpuhost.exec.agent.core import fact, read_str

MOUNTINFO = "/proc/self/mountinfo"


def _unescape(text):
    """Undo mountinfo's octal escapes (a space is \\040; Documentation/filesystems/proc.rst)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def read_mountinfo(path):
    """Return the mounts of this mount namespace, in order: (mount point, fstype, source, options).

    Each line: ID, parent ID, major:minor, root, mount point, per-mount options, optional fields,
    "-", fstype, source, super options (proc(5), /proc/pid/mountinfo). A mount is read-only when
    either option list says "ro" (mount -o remount,ro sets the per-mount one; a file system the
    kernel remounted read-only after errors, errors=remount-ro, shows it in the super options).
    """
    out = []
    for line in (read_str(path, "", 1 << 22) or "").splitlines():
        left, sep, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if not sep or len(a) < 6 or len(b) < 3:
            continue
        opts = a[5].split(",") + b[2].split(",")
        out.append((_unescape(a[4]), b[0], _unescape(b[1]), opts))
    return out


def _mount_of(path, mounts):
    """Return the last-mounted entry whose mount point holds `path` (the one a lookup reaches)."""
    best = None
    for m in mounts:
        mp = m[0]
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= len(best[0]):
                best = m
    return best


@fact("health_mounts")
def fact_health_mounts(params):
    """Return, per data path and named mount, the mount that holds it and whether it is read-only."""
    mounts = read_mountinfo(params.get("mountinfo") or MOUNTINFO)
    if not mounts:
        return {"ok": False, "error": MOUNTINFO + ": unreadable or empty"}
    wanted = list(params.get("data_paths") or ["/"])
    for path in params.get("mounts") or []:
        if path not in wanted:
            wanted.append(path)
    out = {}
    for path in wanted:
        m = _mount_of(path, mounts)
        out[path] = {"mount_point": m[0], "fstype": m[1], "source": m[2], "ro": "ro" in m[3]} if m else {}
    return {"ok": True, "paths": out}

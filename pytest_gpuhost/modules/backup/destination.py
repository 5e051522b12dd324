"""Where each target's backup goes: one folder (or S3 prefix) per target, by construction.

`--backup-dir` and `--backup-to` are templates in which `{host}` stands for the target's name.
With several targets a template without `{host}` would send every node's files to one place
(node B's file overwrites node A's after A's verdict, or is never copied because A's copy looks
up to date), so it is refused. `{host}` always expands to ONE path component that is safe on
every filesystem and in every S3 tool, and two different names never give the same component:

- a name that is already plain (lowercase ASCII letters, digits, `.`, `_`, `-`, not starting
  with `.` or `-`, at most 64 characters) is used as it is: `gpu-01`, `node7.dc1`;
- any other name (upper case, `/`, `..`, NUL or control characters, non-ASCII, too long) becomes
  a readable prefix, `~`, and 16 hex digits of the SHA-256 of the exact name: `..` gives
  `host~…`, `GPU-01` gives `gpu-01~…`.

Plain names never contain `~`, escaped ones always do, and every result is lowercase ASCII,
so the mapping stays one-to-one under case folding (macOS, Windows shares) and Unicode
normalisation (NFC, NFKC): `A` and `a`, or `gpu-01` and its full-width look-alike, get
different folders. Pure functions: no filesystem access, callable before anything is stopped.

A template gives one run's targets places of their own; two runs, one after the other, can
still name one place (`--backup-dir=/backup` for node A today, node B tomorrow). So a place
belongs to the node that first wrote it, whatever run did: its owner record (`node.json`, in
the backup directory's `.gpuhost/` and under the `--backup-to` prefix's `.gpuhost/`) names the
node by its machine-id, and a run for another node is refused before anything is stopped.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import unicodedata
from collections.abc import Mapping, Sequence
from urllib.parse import urlparse

from pytest_gpuhost.errors import GpuhostError

__all__ = [
    "OWNER_NAME",
    "PLACEHOLDER",
    "DestinationError",
    "describe_owner",
    "host_component",
    "owner_record",
    "per_target",
    "same_owner",
]

PLACEHOLDER = "{host}"
MAX_PLAIN = 64  # longest name used as it is
PREFIX_LEN = 40  # readable part of an escaped name; with "~" and the hash: 57 characters
HASH_HEX = 16  # 64 bits: a collision among a fleet's names is out of reach
MAX_COMPONENT = 255  # bytes in one path component (ext4, xfs, btrfs, APFS)

_PLAIN = re.compile(r"[a-z0-9_][a-z0-9._-]*")
_UNSAFE = re.compile(r"[^a-z0-9._-]+")


class DestinationError(GpuhostError):
    """A destination template cannot give each target a place of its own."""


def host_component(name: str) -> str:
    """Return the one path component `{host}` expands to for target `name` (injective)."""
    if len(name) <= MAX_PLAIN and _PLAIN.fullmatch(name):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_HEX]
    readable = unicodedata.normalize("NFKC", name).casefold()
    readable = _UNSAFE.sub("_", readable.encode("ascii", "ignore").decode("ascii")).lstrip("._-")
    return f"{readable[:PREFIX_LEN] or 'host'}~{digest}"


def _fold(path: str) -> str:
    """Return the key two destinations collide on: case folded and NFKC-normalised."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", path).casefold())


def _check_template(template: str, option: str) -> None:
    if not template.strip():
        raise DestinationError(f"{option} is empty; give a directory such as backups/{PLACEHOLDER}")
    if any(ord(c) < 32 or c == "\x7f" for c in template):
        raise DestinationError(f"{option}={template!r} holds a control character; remove it")
    if template.startswith("s3://") and PLACEHOLDER in urlparse(template).netloc:
        raise DestinationError(
            f"{option}={template!r} puts {PLACEHOLDER} in the bucket name; put it in the prefix: "
            f"s3://BUCKET/PREFIX/{PLACEHOLDER}"
        )
    # A `..` (or `.`) after the host's component folds every host back into one place
    # ({base}/{host}/.. is {base} for all of them): refuse it rather than normalise it away.
    parts = template.split("/")
    first = next((i for i, part in enumerate(parts) if PLACEHOLDER in part), len(parts))
    if any(part in (".", "..") for part in parts[first + 1 :]):
        raise DestinationError(
            f"{option}={template!r} has a '.' or '..' component after {PLACEHOLDER}, which would put "
            f"several targets in one place; end the path with {PLACEHOLDER} or a plain name"
        )


def per_target(template: str, targets: Sequence[str], *, option: str) -> dict[str, str]:
    """Return {target name: its destination} for `option`'s template; raise DestinationError.

    Refused, each with one line naming the option and the fix: several targets and no `{host}`
    in the template; a target listed twice; two destinations equal up to case or Unicode
    normalisation (possible only through the template's own text); a component over 255 bytes.
    """
    _check_template(template, option)
    names = list(targets)
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise DestinationError(f"target {n!r} is listed twice; {option} needs one place per target")
        seen.add(n)
    if len(names) > 1 and PLACEHOLDER not in template:
        fix = template.rstrip("/") + "/" + PLACEHOLDER
        raise DestinationError(
            f"{option}={template} has no {PLACEHOLDER} but the run has {len(names)} targets, so their "
            f"files would share one place; add {PLACEHOLDER}: {option}={fix}"
        )
    out: dict[str, str] = {}
    owner: dict[str, str] = {}
    for n in names:
        dest = template.replace(PLACEHOLDER, host_component(n))
        for part in dest.split("/"):
            if len(part.encode("utf-8", "surrogatepass")) > MAX_COMPONENT:
                raise DestinationError(
                    f"{option}={template}: {part[:40]!r}... is longer than {MAX_COMPONENT} bytes "
                    f"for target {n!r}; shorten the text around {PLACEHOLDER}"
                )
        key = _fold(dest if dest.startswith("s3://") else posixpath.normpath(dest))
        if key in owner:
            raise DestinationError(
                f"{option}={template} gives targets {owner[key]!r} and {n!r} the same place {dest!r}; "
                f"keep {PLACEHOLDER} as its own path component"
            )
        owner[key] = n
        out[n] = dest
    return out


#: The file (and object, under an S3 prefix) that says which node a destination belongs to.
OWNER_NAME = "node.json"


def owner_record(target: str, hostname: str, machine_id: str, stamp: str) -> dict[str, str]:
    """The owner record a run writes to a destination it starts: the node, not the run."""
    return {"target": target, "hostname": hostname, "machine_id": machine_id, "claimed": stamp}


def same_owner(theirs: Mapping[str, object], me: Mapping[str, str]) -> bool:
    """Whether the node that owns a destination is this one.

    machine-id(5) names the machine (rented nodes often share a hostname such as `ubuntu`); where
    either side has none, the target name and the hostname must both match.
    """
    mine, other = me.get("machine_id") or "", str(theirs.get("machine_id") or "")
    if mine and other:
        return mine == other
    return str(theirs.get("target")) == me.get("target") and str(theirs.get("hostname")) == me.get("hostname")


def describe_owner(rec: Mapping[str, object]) -> str:
    """One line naming the node of an owner record: `gpu-01 (hostname b200-7, machine-id 3d12...)`."""
    mid = str(rec.get("machine_id") or "")
    return (
        f"{rec.get('target')!s} (hostname {rec.get('hostname')!s}"
        + (f", machine-id {mid[:12]}" if mid else "")
        + (f", since {rec.get('claimed')!s}" if rec.get("claimed") else "")
        + ")"
    )

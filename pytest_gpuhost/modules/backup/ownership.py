"""Whose a destination is, and which destinations overlap: proofs, not absences. Pure functions.

A run writes, overwrites or aborts something at a destination only when it has proved the thing
is its own: absent, written by this node (its owner record, its own state), or byte-identical to
what it would write. Anything else is refused before the first stop, naming whose it is where
that is known. Two rules make the proof:

- **Identity is more than one field.** A node is named by its machine-id(5), the target name,
  the SHA-256 of its SSH host keys and the operator's `--node-name`. Two records are one node
  only when every field both carry agrees; a record with the same machine-id but another name
  or host key is a *clash* (two machines cloned from one image share /etc/machine-id), refused,
  never resolved by one field.
- **A lost or unreadable record is not "no owner".** A backup directory without `node.json`
  still has its state and timeline: a timeline naming only this target is this node's backup
  (the record is written again), one naming another target is that node's, and state without a
  timeline, or a record that cannot be read, is "unknown": refused, with what to do.

Destinations are compared as paths, by components, never as strings: `s3://b/p` and `s3://b/p/x`
overlap, `s3://b/p` and `s3://b/px` do not; local paths are compared after `realpath` (a
symlinked backup directory is the directory it names). Every place a run reads or writes (each
target's backup directory and `--backup-to`, each `in_s3` location) is checked against every
other before the run starts; an overlap where either side is written is refused.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CLASH",
    "FREE",
    "MINE",
    "OTHER",
    "UNKNOWN",
    "CORRUPT",
    "Ownership",
    "OWNER_META",
    "claim_problems",
    "object_owner_tag",
    "s3_evidence",
    "Place",
    "judge",
    "local_ownership",
    "node_identity",
    "overlap_problems",
    "place_of",
    "run_overlaps",
    "run_places",
]

FREE, MINE, OTHER, CLASH, UNKNOWN = "free", "mine", "other", "clash", "unknown"
CORRUPT = object()  # an owner record that exists but is not JSON
#: Fields that name a node, in the order they are compared and shown.
IDENTITY = ("machine_id", "target", "node_name", "host_key")
OWNER_NAME = "node.json"
# what a run itself keeps in .gpuhost/ that says nothing about whose the backup is
_NOT_EVIDENCE = frozenset({OWNER_NAME, f".{OWNER_NAME}.tmp", "lock", "tmp"})


def node_identity(
    target: str,
    hostname: str,
    machine_id: str,
    stamp: str,
    *,
    host_key: str = "",
    node_name: str = "",
) -> dict[str, str]:
    """The owner record a run writes to a destination it starts: the node, not the run."""
    rec = {"target": target, "hostname": hostname, "machine_id": machine_id, "claimed": stamp}
    if host_key:
        rec["host_key"] = host_key
    if node_name:
        rec["node_name"] = node_name
    return rec


@dataclass(frozen=True)
class Ownership:
    """The judgement on one destination: FREE, MINE, OTHER, CLASH or UNKNOWN, and why."""

    status: str
    why: str = ""
    record: Mapping[str, Any] | None = None

    @property
    def usable(self) -> bool:
        return self.status in (FREE, MINE)


def describe(rec: Mapping[str, Any]) -> str:
    """One line naming the node of an owner record: `gpu-01 (hostname b200-7, machine-id 3d12...)`."""
    extra = [f"hostname {rec.get('hostname')!s}"]
    if rec.get("node_name"):
        extra.append(f"node name {rec.get('node_name')!s}")
    if rec.get("machine_id"):
        extra.append(f"machine-id {str(rec.get('machine_id'))[:12]}")
    if rec.get("host_key"):
        extra.append(f"host key {str(rec.get('host_key'))[:12]}")
    if rec.get("claimed"):
        extra.append(f"since {rec.get('claimed')!s}")
    return f"{rec.get('target')!s} ({', '.join(extra)})"


def judge(theirs: Any, me: Mapping[str, str]) -> Ownership:
    """Whether an owner record (already parsed; None when absent) names this node.

    Every identity field both records carry must agree. A differing machine-id is another node;
    the same machine-id with another target, node name or host key is a clash of identities
    (a cloned image). Records with no identity field in common prove nothing: UNKNOWN. Where
    either has no machine-id, the target and hostname must both agree (old records).
    """
    if theirs is None:
        return Ownership(FREE)
    if not isinstance(theirs, Mapping):
        return Ownership(UNKNOWN, "its owner record is not a JSON object")
    shared = [f for f in IDENTITY if str(theirs.get(f) or "") and me.get(f)]
    differ = [f for f in shared if str(theirs.get(f)) != me.get(f)]
    mid_same = "machine_id" in shared and "machine_id" not in differ
    if "machine_id" in differ:
        return Ownership(OTHER, f"holds the backup of {describe(theirs)}", theirs)
    if differ and mid_same:
        fields = ", ".join(f.replace("_", "-") for f in differ)
        return Ownership(
            CLASH,
            f"holds the backup of {describe(theirs)}: the same machine-id as this node but another "
            f"{fields} (a machine cloned from one image?); give each node its own --node-name and place",
            theirs,
        )
    if differ:
        return Ownership(OTHER, f"holds the backup of {describe(theirs)}", theirs)
    if not mid_same:
        # no machine-id on one side: the target and the hostname must both agree
        if str(theirs.get("target")) == me.get("target") and str(theirs.get("hostname")) == me.get(
            "hostname"
        ):
            return Ownership(MINE, record=theirs)
        if not shared:
            return Ownership(
                UNKNOWN, f"its owner record names no node this one can be told from: {describe(theirs)}"
            )
        return Ownership(OTHER, f"holds the backup of {describe(theirs)}", theirs)
    return Ownership(MINE, record=theirs)


def _timeline_targets(path: Path) -> set[str] | None:
    """The target names of a timeline (None when it cannot be read whole)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return set()
    except (OSError, UnicodeDecodeError):
        return None
    out: set[str] = set()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                continue  # a torn last line of a killed run
            return None
        if not isinstance(rec, dict) or not isinstance(rec.get("target"), str):
            return None
        out.add(rec["target"])
    return out


def read_record(path: Path) -> tuple[Any, str]:
    """(the parsed owner record or None when absent, why it cannot be read or "")."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"owner record {path} cannot be read ({exc.strerror or exc})"
    try:
        return json.loads(raw), ""
    except ValueError:
        return None, f"owner record {path} is not JSON (corrupt)"


def local_ownership(dest: Path, me: Mapping[str, str], meta: str = ".gpuhost") -> Ownership:
    """Whose the backup directory dest is: its owner record, else its own state and timeline.

    FREE only when dest is absent or empty. A directory that holds files but no `.gpuhost/`
    is not one of ours (UNKNOWN: nothing of it is overwritten). Without an owner record, a
    timeline naming only this target is this node's backup (MINE); naming another target,
    that node's (OTHER); state without a readable timeline is UNKNOWN.
    """
    for up in list(Path(os.path.abspath(dest)).parents):
        # a place inside another node's backup directory is that node's (and its writes would
        # land among that backup's files); a record of this node above is its own tree
        rec, why = read_record(up / meta / OWNER_NAME)
        if why:
            return Ownership(UNKNOWN, f"lies inside {up}, whose {why}")
        if rec is not None:
            above = judge(rec, me)
            if not above.usable:
                return Ownership(above.status, f"lies inside {up}, which {above.why}", above.record)
    try:
        entries = [e.name for e in os.scandir(dest)]
    except FileNotFoundError:
        return Ownership(FREE)
    except NotADirectoryError:
        return Ownership(UNKNOWN, "is not a directory")
    except OSError as exc:
        return Ownership(UNKNOWN, f"cannot be listed ({exc.strerror or exc})")
    if not entries:
        return Ownership(FREE)
    folder = dest / meta
    if meta not in entries:
        return Ownership(
            UNKNOWN,
            f"holds {len(entries)} entries that no backup run made (no {meta}/): not this node's to write",
        )
    rec, why = read_record(folder / OWNER_NAME)
    if why:
        return Ownership(
            UNKNOWN,
            f"{why}: whose backup this is cannot be told; if it is this node's, move the record "
            "away and rerun (the backup's timeline then decides)",
        )
    if rec is not None:
        return judge(rec, me)
    try:
        evidence = sorted(n for n in os.listdir(folder) if n not in _NOT_EVIDENCE)
    except OSError as exc:
        return Ownership(UNKNOWN, f"{meta}/ cannot be listed ({exc.strerror or exc})")
    if not evidence and set(entries) == {meta}:
        return Ownership(FREE)
    targets = _timeline_targets(folder / "timeline.jsonl")
    if targets is None:
        return Ownership(
            UNKNOWN, "has no owner record and its timeline cannot be read: whose it is cannot be told"
        )
    if not targets:
        return Ownership(
            UNKNOWN,
            f"has no owner record and no timeline, but holds a backup ({', '.join(evidence[:3])}): "
            "whose it is cannot be told",
        )
    if targets == {me.get("target")}:
        return Ownership(MINE, "owner record lost; the timeline names only this target")
    others = sorted(t for t in targets if t != me.get("target"))
    return Ownership(OTHER, f"has no owner record; its timeline names {', '.join(others[:3])}")


# ---------------------------------------------------------------- places, by components


@dataclass(frozen=True)
class Place:
    """One location a run reads or writes: ("file", components) or ("s3", bucket, components)."""

    label: str  # how the operator named it, for the message
    scheme: str  # "file" or "s3"
    root: str  # "" for a local path, the bucket for S3
    parts: tuple[str, ...]
    writes: bool
    target: str = ""  # the target whose run uses it ("" for all of them)

    def overlaps(self, other: Place) -> bool:
        """Whether one is the other or lies below it, component by component."""
        if (self.scheme, self.root) != (other.scheme, other.root):
            return False
        n = min(len(self.parts), len(other.parts))
        return self.parts[:n] == other.parts[:n]


def place_of(url_or_path: str, label: str, *, writes: bool, target: str = "", base: str = "") -> Place:
    """The Place of an s3:// URL or a local path (made absolute against base, symlinks resolved)."""
    if url_or_path.startswith("s3://"):
        bucket, _, key = url_or_path[5:].partition("/")
        parts = tuple(p for p in key.split("/") if p)
        return Place(label, "s3", bucket, parts, writes, target)
    path = url_or_path if posixpath.isabs(url_or_path) else posixpath.join(base or os.getcwd(), url_or_path)
    real = os.path.realpath(path)
    return Place(label, "file", "", tuple(p for p in real.split("/") if p), writes, target)


def overlap_problems(places: Iterable[Place]) -> list[str]:
    """One line per pair of places that overlap where at least one of them is written.

    The same place named twice for one target is one place (a category's two roots both under
    one in_s3 location are read there twice, never written twice by two nodes).
    """
    items = list(places)
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    for i, a in enumerate(items):
        for b in items[i + 1 :]:
            if not (a.writes or b.writes) or not a.overlaps(b):
                continue
            if a.label == b.label and a.target == b.target:
                continue
            key = (a.label + "\0" + a.target, b.label + "\0" + b.target)
            if key in seen:
                continue
            seen.add(key)
            named = a.target != b.target  # the targets are told only when they are two
            who_a = f" (target {a.target})" if a.target and named else ""
            who_b = f" (target {b.target})" if b.target and named else ""
            rel = (
                "is" if a.parts == b.parts else ("contains" if len(a.parts) < len(b.parts) else "lies inside")
            )
            out.append(
                f"{a.label}{who_a} {rel} {b.label}{who_b}: a run would write where the other reads or "
                "writes; give each its own place"
            )
    return out


def run_places(
    targets: Sequence[str],
    backup_dirs: Mapping[str, str],
    backup_tos: Mapping[str, str],
    in_s3: Sequence[tuple[str, str]],
    *,
    in_s3_writes: bool,
    base: str = "",
) -> list[Place]:
    """Every place the run's targets read or write: backup directories and --backup-to of each
    target, and each in_s3 location (read by every target; written with --in-s3-send-to=location)."""
    out: list[Place] = []
    for t in targets:
        if t in backup_dirs:
            out.append(
                place_of(backup_dirs[t], f"--backup-dir {backup_dirs[t]}", writes=True, target=t, base=base)
            )
        if t in backup_tos:
            out.append(place_of(backup_tos[t], f"--backup-to {backup_tos[t]}", writes=True, target=t))
        for url, cat in in_s3:
            out.append(place_of(url, f"in_s3 {url} of category {cat}", writes=in_s3_writes, target=t))
    return out


def run_overlaps(
    manifest: Any,
    targets: Sequence[str],
    backup_dirs: Mapping[str, str],
    backup_tos: Mapping[str, str],
    send_to: str,
    base: str,
) -> list[str]:
    """The overlap problems of one run of the decommission suite (the call site before any step).

    --backup-to counts only where the run writes there (a category marked s3, or in_s3 misses
    sent there); in_s3 locations are written with --in-s3-send-to=location.
    """
    cats = list(manifest.categories)
    in_s3 = [(u, c.name) for c in cats for u in dict.fromkeys(u for _, u in c.in_s3)]
    writes_to = any(c.s3 or (send_to == "backup-to" and c.in_s3) for c in cats)
    problems = overlap_problems(
        run_places(
            targets,
            backup_dirs,
            backup_tos if writes_to else {},
            in_s3,
            in_s3_writes=bool(in_s3) and send_to == "location",
            base=base,
        )
    )
    if problems and in_s3 and send_to == "location" and len(targets) > 1:
        problems.append(
            "in_s3 locations are read by every target of the run; with --in-s3-send-to=backup-to "
            "no run writes there"
        )
    return problems


def claim_problems(
    me: Mapping[str, str],
    places: Iterable[Place],
    dest: Path,
    *,
    s3_url: str | None = None,
    s3_record: Any = None,
    s3_key: str = "",
    s3_foreign: bool = False,
    s3_above: Sequence[tuple[str, Any]] = (),
    meta: str = ".gpuhost",
) -> tuple[list[str], Ownership | None]:
    """Every reason a run may not write its destinations, and the judgement on --backup-to.

    The one decision of a run's claim (suites/decommission/node.py reads the S3 side and calls
    this): the places must not overlap; the backup directory must be FREE or MINE; the
    --backup-to prefix (s3_url, when the run writes there) by its owner object `s3_record`
    (None when absent, CORRUPT when not JSON) and, where it has none, by `s3_foreign`: whether
    it holds objects this backup directory's own journal does not name. `s3_above` is (URL,
    owner record) of each prefix above it that has one: a prefix inside another node's is
    that node's.
    """
    problems = overlap_problems(places)
    local = local_ownership(dest, me, meta)
    if not local.usable:
        problems.append(f"--backup-dir {dest} {local.why}")
    verdict: Ownership | None = None
    if s3_url is not None:
        if s3_record is CORRUPT:
            problems.append(
                f"--backup-to {s3_url}: owner record {s3_key} is not JSON (corrupt): whose backup this is "
                "cannot be told"
            )
        else:
            verdict = judge(s3_record, me)
            if verdict.status == FREE and s3_foreign:
                problems.append(
                    f"--backup-to {s3_url} holds objects but no owner record, and this backup directory "
                    "never wrote there: whose they are cannot be told"
                )
            elif not verdict.usable:
                problems.append(f"--backup-to {s3_url} {verdict.why}")
        for url, rec in s3_above:
            above = judge(rec, me) if rec is not CORRUPT else Ownership(UNKNOWN, "has a corrupt owner record")
            if not above.usable:
                problems.append(f"--backup-to {s3_url} lies inside {url}, which {above.why}")
    return problems, verdict


def s3_evidence(
    client: Any, bucket: str, prefix: str, dest: Path, journal_name: str, meta: str = ".gpuhost"
) -> tuple[Any, bool, list[tuple[str, Any]]]:
    """Read what says whose an S3 prefix is: (its owner record: None, CORRUPT or the parsed
    JSON; whether it holds objects this backup directory's journal `journal_name` does not
    name, asked only where it has no record; (URL, record) of each prefix above with one).

    Raises the client's error for anything but an absent record (the caller names it).
    """
    from pytest_gpuhost.modules.backup.state import StateFile

    def get(key: str) -> Any:
        try:
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code")
            if code in ("NoSuchKey", "404"):
                return None
            raise
        try:
            return json.loads(body)
        except ValueError:
            return CORRUPT

    parts = [p for p in prefix.split("/") if p]
    here = "/".join(parts)
    record = get((here + "/" if here else "") + f"{meta}/{OWNER_NAME}")
    foreign = False
    if record is None:
        res = client.list_objects_v2(Bucket=bucket, Prefix=here + "/" if here else "", MaxKeys=1000)
        keys = [o["Key"] for o in res.get("Contents", []) or []]
        if keys:
            mine = StateFile.peek(dest / meta, journal_name)
            foreign = any(k not in mine for k in keys)
    above: list[tuple[str, Any]] = []
    for n in range(len(parts)):
        up = "/".join(parts[:n])
        rec = get((up + "/" if up else "") + f"{meta}/{OWNER_NAME}")
        if rec is not None:
            above.append((f"s3://{bucket}/{up}", rec))
    return record, foreign, above


#: The user metadata every object a run writes carries: the tag of the node that wrote it.
OWNER_META = "gpuhost-owner"


def object_owner_tag(me: Mapping[str, str]) -> str:
    """The tag of a node in an object's metadata (ASCII hex of its identity fields)."""
    import hashlib

    ident = "\0".join(str(me.get(f) or "") for f in ("machine_id", "target", "host_key"))
    return hashlib.sha256(ident.encode("utf-8", "surrogatepass")).hexdigest()[:32]

"""Verify a node's files against objects already in S3, where other tools put them: no re-upload.

A manifest root with `in_s3: s3://BUCKET/PREFIX` says where the node's own pipeline put its
files, laid out as `aws s3 sync ROOT s3://BUCKET/PREFIX` writes them (`PREFIX/<path below the
root>`; a root that is a file: `PREFIX/<its name>`).  Each file is proved against its object
by the strongest thing the object carries, computed on the node in one read of the file:

1. a full-object checksum: SHA-256, then SHA-1 (`HeadObject` with `ChecksumMode=ENABLED`);
2. the ETag of a single-part upload, which is the MD5 of the body unless the object is
   encrypted with SSE-KMS or SSE-C (S3 API reference, "Common Response Headers": ETag);
3. a multipart ETag `MD5(part MD5s)-N`, recomputed with the object's own part sizes, asked
   from S3, never guessed: `GetObjectAttributes` ObjectParts where it lists every part's size
   (real S3 does for uploads with checksums), else `HeadObject` with `PartNumber=i` for each
   part (its ContentLength is that part's size). Tools do upload parts of unequal sizes; a
   guess from the first part called such an object "different bytes" and sent it again;
4. a full-object CRC64NVME, CRC32C or CRC32 checksum (the AWS SDKs' default since 2025 is a
   CRC), only where nothing above is there: a CRC finds corruption, not a forgery.

Each proof is named by its strength (`STRENGTH`: sha256 > sha1 > md5 > crc64 > crc32), shown
per object in NOTES.md, and a proof weaker than the run's minimum (`min_proof`, the suite's
`--in-s3-min-proof`, default crc64: a 32-bit CRC matches one unrelated object in 2^32, which a
fleet's millions of files make a real chance) is "cannot be verified", never a pass.

An object with none of these (an SSE-KMS or SSE-C object without a checksum, or a composite
checksum of a multipart upload with a non-MD5 ETag) is "cannot be verified", with what would
verify it, and never counts as a pass.  A missing object, one of another size or other bytes
is to be sent again.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.exec.s3io import S3Location, parse_s3_url
from pytest_gpuhost.modules.backup.listing import Listing, RemoteFile, reason
from pytest_gpuhost.modules.backup.manifest import Manifest

__all__ = [
    "MIN_PROOFS",
    "STRENGTH",
    "InPlace",
    "InPlaceResult",
    "ObjectFacts",
    "Proof",
    "choose",
    "multipart_etag",
    "object_key",
]

_MD5 = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART = re.compile(r"^([0-9a-f]{32})-(\d+)$")
# full-object checksums in the order they are preferred, with the node-side digest of each
_CHECKSUMS = (
    ("ChecksumSHA256", "sha256", "SHA-256 checksum"),
    ("ChecksumSHA1", "sha1", "SHA-1 checksum"),
)
_CRCS = (
    ("ChecksumCRC64NVME", "crc64nvme", "CRC64NVME checksum"),
    ("ChecksumCRC32C", "crc32c", "CRC32C checksum"),
    ("ChecksumCRC32", "crc32", "CRC32 checksum"),
)
#: The strength of each kind of proof (the name NOTES.md shows), strongest first; the value
#: orders them. sha256 and sha1 are cryptographic; md5 (an ETag, single or multipart) is a
#: 128-bit digest no accident matches; crc64 and crc32 find corruption, not a replacement.
STRENGTH = {"sha256": 5, "sha1": 4, "md5": 3, "crc64": 2, "crc32": 1}
#: The values of --in-s3-min-proof, strongest first.
MIN_PROOFS = tuple(STRENGTH)
_LEVEL = {
    "sha256": "sha256",
    "sha1": "sha1",
    "md5": "md5",
    "crc64nvme": "crc64",
    "crc32c": "crc32",
    "crc32": "crc32",
}


def object_key(f: RemoteFile, location: S3Location) -> str | None:
    """Return the key `aws s3 sync ROOT s3://BUCKET/PREFIX` gives f, or None if it has no key.

    S3 keys are UTF-8: a name that is not cannot have been written there by those tools.
    """
    rel = f.path[f.anchor_len :].lstrip(b"/")
    try:
        text = rel.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return location.key(text)


@dataclass(frozen=True)
class ObjectFacts:
    """What S3 says about one object: from the listing, and HEAD where the listing is not enough."""

    key: str
    size: int
    etag: str
    checksums: dict[str, str] = field(default_factory=dict)  # ChecksumSHA256 etc., base64
    checksum_type: str | None = None  # FULL_OBJECT / COMPOSITE; None where the server says nothing
    sse: str | None = None  # aws:kms, aws:kms:dsse, SSE-C (customer key), or None
    part_sizes: tuple[int, ...] = ()  # of a multipart object, when known


@dataclass(frozen=True)
class Need:
    """How an object is to be proved: the digests the node computes, and what a match proves."""

    want: tuple[str, ...]
    how: str
    parts: tuple[int, ...] = ()
    expect: str = ""  # hex digest (or multipart ETag) the node's bytes must give
    strength: str = ""  # a key of STRENGTH


def multipart_etag(part_md5s: Iterable[str]) -> str:
    """Return the ETag S3 gives a multipart upload with these part MD5s (hex): MD5(concat)-N."""
    parts = [bytes.fromhex(h) for h in part_md5s]
    return hashlib.md5(b"".join(parts)).hexdigest() + f"-{len(parts)}"  # noqa: S324 - S3's ETag


def _full(obj: ObjectFacts, value: str) -> bool:
    """Whether a checksum covers the whole object (not a checksum of part checksums)."""
    if obj.checksum_type:
        return obj.checksum_type == "FULL_OBJECT"
    return "-" not in value and not _MULTIPART.match(obj.etag)


def _candidates(obj: ObjectFacts) -> list[Need]:
    """Every way the object can be proved, strongest first."""
    out: list[Need] = []
    for header, name, how in _CHECKSUMS:
        value = obj.checksums.get(header)
        if value and _full(obj, value):
            out.append(Need((name,), how, expect=base64.b64decode(value).hex(), strength=_LEVEL[name]))
    if obj.sse is None and _MD5.match(obj.etag):
        out.append(Need(("md5",), "MD5 ETag (single-part upload)", expect=obj.etag, strength="md5"))
    m = _MULTIPART.match(obj.etag)
    if obj.sse is None and m and obj.part_sizes and len(obj.part_sizes) == int(m.group(2)):
        sizes = sorted(set(obj.part_sizes[:-1] or obj.part_sizes))
        shape = f"of {sizes[0]} bytes" if len(sizes) <= 1 else f"of {sizes[0]}..{sizes[-1]} bytes"
        out.append(
            Need(
                (),
                f"multipart ETag ({len(obj.part_sizes)} parts {shape}, sizes from S3)",
                parts=obj.part_sizes,
                expect=obj.etag,
                strength="md5",
            )
        )
    for header, name, how in _CRCS:
        value = obj.checksums.get(header)
        if value and _full(obj, value):
            out.append(Need((name,), how, expect=base64.b64decode(value).hex(), strength=_LEVEL[name]))
    return out


def choose(obj: ObjectFacts, min_proof: str = "crc32") -> Need | str:
    """Return how to prove the object, or why it cannot be verified and what would verify it.

    The strongest proof the object carries is used; one weaker than min_proof (a key of
    STRENGTH) proves nothing.
    """
    found = _candidates(obj)
    if found and STRENGTH[found[0].strength] >= STRENGTH[min_proof]:
        return found[0]
    if found:
        return (
            f"cannot be verified: its strongest proof is a {found[0].how} ({found[0].strength}), weaker than"
            f" --in-s3-min-proof={min_proof}; a copy in place with --checksum-algorithm SHA256 would"
            " verify it, or let the backup send it elsewhere"
        )
    m = _MULTIPART.match(obj.etag)
    if obj.sse:
        return (
            f"cannot be verified: encrypted with {obj.sse}, so its ETag is not an MD5, and it has no"
            " full-object checksum; a copy in place with one would verify it (aws s3api copy-object"
            " --checksum-algorithm SHA256 onto the same key), or let the backup send it again"
        )
    if m:
        return "cannot be verified: a multipart ETag whose part sizes S3 did not give (HeadObject PartNumber)"
    return (
        f"cannot be verified: ETag {obj.etag!r} is not an MD5 and the object has no full-object checksum;"
        " a copy in place with --checksum-algorithm SHA256 would verify it"
    )


@dataclass(frozen=True)
class Proof:
    """The outcome for one file under an in_s3 root."""

    file: RemoteFile
    url: str  # s3://BUCKET/KEY (or the location, when the file has no key)
    ok: bool
    how: str  # what proved it, or why not
    send: bool = False  # missing or different: to be sent again
    quick: tuple[int, int, int, int] | None = None  # size, mtime, ctime, inode when hashed
    etag: str = ""  # the object's ETag when it was judged
    location: str = ""  # the in_s3 URL of the file's root
    strength: str = ""  # the proof's strength (a key of STRENGTH) when one was used


@dataclass
class InPlaceResult:
    proofs: list[Proof] = field(default_factory=list)
    hashed_bytes: int = 0
    heads: int = 0
    duration: float = 0.0
    hash_seconds: float = 0.0  # the node's digest call alone

    @property
    def proved(self) -> set[str]:
        """Backup keys (RemoteFile.key) of the files proved in place."""
        return {p.file.key for p in self.proofs if p.ok}

    @property
    def to_send(self) -> list[RemoteFile]:
        return [p.file for p in self.proofs if p.send]

    @property
    def unverifiable(self) -> list[Proof]:
        return [p for p in self.proofs if not p.ok and not p.send]


class InPlace:
    """Prove the files under a manifest's in_s3 roots against the objects already there."""

    def __init__(
        self,
        conn: Any,
        manifest: Manifest,
        client_for: Callable[[S3Location], Any],
        *,
        workers: int | None = None,
        s3_workers: int = 16,
        op_timeout: float = 3600.0,
        min_proof: str = "crc64",
    ) -> None:
        self.conn = conn
        self.manifest = manifest
        self.client_for = client_for
        self.workers = workers
        self.s3_workers = s3_workers
        self.op_timeout = op_timeout
        if min_proof not in STRENGTH:
            raise ValueError(f"min_proof {min_proof!r}: expected one of {', '.join(MIN_PROOFS)}")
        self.min_proof = min_proof

    def files(self, listing: Listing) -> list[tuple[RemoteFile, S3Location]]:
        """Return each regular file under an in_s3 root, with the location of its root."""
        cats = {c.name: c for c in self.manifest.categories if c.in_s3}
        # a root followed where its link points (follow_root_links) is named by the operator's path
        named = {(r["category"], r["real"]): r["root"] for r in listing.roots if "real" in r}
        out = []
        for f in listing.files:
            cat = cats.get(f.category)
            if cat is None or f.kind != "f":
                continue
            root = f.path[: f.anchor_len].decode("utf-8", "surrogateescape")
            root = named.get((f.category, root), root)
            url = cat.in_s3_url(root) or cat.in_s3_url(f.path.decode("utf-8", "surrogateescape"))
            if url is not None:
                out.append((f, parse_s3_url(url)))
        return out

    def check(self, listing: Listing, previous: InPlaceResult | None = None) -> InPlaceResult:
        """Prove every file under an in_s3 root: one listing per prefix, HEADs in parallel, one
        digest call on the node for all the files that need bytes read.

        A proof of `previous` (this run's earlier check) is kept without reading the file again
        when the file's size and mtime and the object's ETag and size are what they were.
        """
        started = time.monotonic()
        result = InPlaceResult()
        before = {p.file.key: p for p in previous.proofs if p.ok and p.quick} if previous else {}
        pairs = self.files(listing)
        listings: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        for _, loc in pairs:
            if (loc.bucket, loc.prefix) not in listings:
                listings[(loc.bucket, loc.prefix)] = self._list(loc)
        todo: list[tuple[RemoteFile, S3Location, str, dict[str, Any]]] = []
        for f, loc in pairs:
            key = object_key(f, loc)
            if key is None:
                result.proofs.append(
                    Proof(f, loc.url, False, "cannot be an S3 key: the name is not UTF-8", send=False)
                )
                continue
            url = f"s3://{loc.bucket}/{key}"
            obj = listings[(loc.bucket, loc.prefix)].get(key)
            if obj is None:
                result.proofs.append(Proof(f, url, False, f"not in {loc.url}", send=True))
            elif obj["size"] != f.size:
                result.proofs.append(
                    Proof(
                        f,
                        url,
                        False,
                        f"different: {obj['size']} bytes in S3, {f.size} on the node",
                        send=True,
                    )
                )
            elif (
                (old := before.get(f.key)) is not None
                and old.quick is not None
                and (old.quick[:2] == (f.size, f.mtime_ns) and old.etag == obj["etag"] and old.url == url)
            ):
                result.proofs.append(old)
            else:
                todo.append((f, loc, key, obj))
        with ThreadPoolExecutor(max_workers=self.s3_workers, thread_name_prefix="s3head") as pool:
            facts = list(pool.map(lambda t: self._facts(t[1], t[2], t[3], f_size=t[0].size), todo))
        result.heads = sum(n for _, n in facts)
        needs: list[tuple[RemoteFile, str, Need, str]] = []
        for (f, loc, key, _), (head, _) in zip(todo, facts, strict=True):
            url = f"s3://{loc.bucket}/{key}"
            how = choose(head, self.min_proof) if isinstance(head, ObjectFacts) else head
            if isinstance(how, str):
                result.proofs.append(Proof(f, url, False, how))
            else:
                needs.append((f, url, how, head.etag if isinstance(head, ObjectFacts) else ""))
        if needs:
            wire = [dict(f.wire(), want=list(n.want), parts=list(n.parts)) for f, _, n, _ in needs]
            params: dict[str, Any] = {"files": wire}
            if self.workers:
                params["workers"] = self.workers
            t0 = time.monotonic()
            got = self.conn.call("backup_digests", timeout=self.op_timeout, **params)
            result.hash_seconds = time.monotonic() - t0
            for (f, url, n, etag), d in zip(needs, got, strict=True):
                result.proofs.append(self._judge(f, url, n, d, etag))
                result.hashed_bytes += int(d.get("s") or 0)
        where = {f.key: loc.url for f, loc in pairs}
        result.proofs = sorted(
            (
                p if p.location else dataclasses.replace(p, location=where.get(p.file.key, ""))
                for p in result.proofs
            ),
            key=lambda p: p.file.path,
        )
        result.duration = time.monotonic() - started
        return result

    # -- S3 side

    def _list(self, loc: S3Location) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        pager = self.client_for(loc).get_paginator("list_objects_v2")
        prefix = loc.prefix + "/" if loc.prefix else ""
        for page in pager.paginate(Bucket=loc.bucket, Prefix=prefix):
            for obj in page.get("Contents", []) or []:
                out[obj["Key"]] = {"etag": str(obj["ETag"]).strip('"'), "size": int(obj["Size"])}
        return out

    def _facts(
        self, loc: S3Location, key: str, listed: dict[str, Any], *, f_size: int
    ) -> tuple[ObjectFacts | str, int]:
        """HEAD the object (and its first part, for a multipart ETag); return (facts or why, HEADs)."""
        client = self.client_for(loc)
        try:
            head = client.head_object(Bucket=loc.bucket, Key=key, ChecksumMode="ENABLED")
        except Exception as exc:  # noqa: BLE001 - one line per object, never a traceback
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)
            if str(code) in ("400", "BadRequest"):
                return "cannot be verified: HEAD refused (400): an SSE-C object needs its customer key", 1
            return f"cannot be verified: HEAD failed: {code}", 1
        etag = str(head.get("ETag", listed["etag"])).strip('"')
        sse = head.get("ServerSideEncryption")
        if head.get("SSECustomerAlgorithm"):
            sse = "SSE-C (customer key)"
        elif sse not in ("aws:kms", "aws:kms:dsse"):
            sse = None  # AES256 (SSE-S3) keeps the MD5 ETag
        checks = {
            k: str(v) for k, v in head.items() if k.startswith("Checksum") and k != "ChecksumType" and v
        }
        obj = ObjectFacts(
            key, int(head.get("ContentLength", listed["size"])), etag, checks, head.get("ChecksumType"), sse
        )
        m = _MULTIPART.match(etag)
        heads = 1
        if m and sse is None and not any(_full(obj, checks[h]) for h, _, _ in _CHECKSUMS if h in checks):
            sizes, asked = self._part_sizes(client, loc, key, int(m.group(2)))
            heads += asked
            obj = ObjectFacts(key, obj.size, etag, checks, obj.checksum_type, sse, sizes)
        return obj, heads

    @staticmethod
    def _part_sizes(client: Any, loc: S3Location, key: str, n: int) -> tuple[tuple[int, ...], int]:
        """Each part's size as S3 gives it, and how many requests that took; () where it did not.

        GetObjectAttributes ObjectParts first (one request per 1000 parts; real S3 lists the
        parts of an upload made with checksums), else HeadObject PartNumber=i for every part.
        """
        asked = 0
        sizes: list[int] = []
        try:
            marker: int | None = None
            while True:
                kw: dict[str, Any] = {"Bucket": loc.bucket, "Key": key, "ObjectAttributes": ["ObjectParts"]}
                kw["MaxParts"] = 1000
                if marker is not None:
                    kw["PartNumberMarker"] = marker
                res = client.get_object_attributes(**kw)
                asked += 1
                parts = (res.get("ObjectParts") or {}).get("Parts") or []
                if not parts or any("Size" not in p for p in parts):
                    sizes = []
                    break
                sizes += [int(p["Size"]) for p in parts]
                op = res.get("ObjectParts") or {}
                if not op.get("IsTruncated"):
                    break
                marker = int(op["NextPartNumberMarker"])
        except Exception:  # noqa: BLE001 - not every store has it: ask each part instead
            sizes = []
        if len(sizes) == n:
            return tuple(sizes), asked

        def part(i: int) -> int:
            return int(client.head_object(Bucket=loc.bucket, Key=key, PartNumber=i)["ContentLength"])

        try:
            if n <= 2:
                sizes = [part(i) for i in range(1, n + 1)]
            else:  # the parts' HEADs side by side: a 10,000-part object is not 10,000 round trips in a row
                with ThreadPoolExecutor(max_workers=min(8, n), thread_name_prefix="s3part") as pool:
                    sizes = list(pool.map(part, range(1, n + 1)))
        except Exception:  # noqa: BLE001 - no sizes: "cannot be verified", never a guess
            return (), asked + n
        return tuple(sizes), asked + n

    # -- the node's bytes against the object

    @staticmethod
    def _judge(f: RemoteFile, url: str, need: Need, d: dict[str, Any], etag: str) -> Proof:
        if "errno" in d:
            return Proof(f, url, False, f"not read on the node: {reason(int(d.get('errno') or 0))}")
        quick = (int(d["s"]), int(d["m"]), int(d["c"]), int(d["i"]))
        if need.parts:
            got = multipart_etag(d["pm"]) if d.get("pm") else "(part sizes do not fit the file)"
        else:
            got = d["d"][need.want[0]]
        if got != need.expect:
            return Proof(
                f,
                url,
                False,
                f"different bytes: {need.how} is {need.expect}, the node's file gives {got}",
                send=True,
                quick=quick,
            )
        return Proof(
            f,
            url,
            True,
            f"{need.how} matches the node's file",
            quick=quick,
            etag=etag,
            strength=need.strength,
        )

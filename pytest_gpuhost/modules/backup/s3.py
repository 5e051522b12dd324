"""Upload a verified local backup to S3 (or an S3-compatible store) and prove every object.

Objects come from the local copy, which was verified against the node's SHA-256 on arrival.  Each
object carries the SHA-256 three ways: the S3 checksum (`ChecksumSHA256`, validated by the
server on real S3), user metadata `sha256` (full-object hex, also for multipart), and an ETag the
server computes itself (MD5 of the body, or of the part MD5s with `-N` for multipart) which is
compared with the MD5 computed locally while the bytes were read.  A rerun lists the prefix once
and skips objects whose ETag and size match what this backup directory recorded as verified.
Interrupted multipart uploads under the prefix are aborted before and checked after a run.

Key layout: `PREFIX/<category>/<node path without the leading slash>`; bytes that S3 (or a
server in front of it) cannot carry in a key (`%`, control characters such as newline, and
non-UTF-8 bytes) are written as `%XX`, so the mapping is reversible.  Symlinks become small
objects whose body is the link target and whose metadata says `symlink: "1"`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpuhost.exec.s3io import S3Error, S3Location, SignedPut, make_client, parse_s3_url
from pytest_gpuhost.modules.backup.local import (
    Backup,
    Listing,
    Progress,
    RemoteFile,
    StateFile,
)

__all__ = [
    "S3Error",
    "S3Item",
    "S3Location",
    "S3Plan",
    "S3Result",
    "S3Upload",
    "UploadSession",
    "item_for",
    "items_from_backup",
    "key_for",
    "parse_s3_url",
    "state_tag",
]

MULTIPART_THRESHOLD = 64 * 1024 * 1024
PART_SIZE = 32 * 1024 * 1024
_META = ".gpuhost"
_MPU = "\x00mpu\x00"  # state key of a multipart upload this backup started (no object key has NUL)


def state_tag(endpoint_url: str, url: str) -> str:
    """The name part of a backup directory's journal of one S3 destination (endpoint and URL)."""
    return hashlib.sha256(f"{endpoint_url}|{url}".encode()).hexdigest()[:12]


def key_for(rel: str) -> str:
    """Map a backup-relative path (str, surrogateescape) to an S3 key, escaping with %XX."""
    out = []
    for ch in rel:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:  # a non-UTF-8 byte carried by surrogateescape
            out.append(f"%{o - 0xDC00:02X}")
        elif o < 0x20 or o == 0x7F or ch == "%":
            out.append(f"%{o:02X}")
        else:
            out.append(ch)
    return "".join(out)


@dataclass(frozen=True)
class S3Item:
    """One verified local file or link to have in S3."""

    rel: str  # path inside the backup directory
    sha256: str  # hex, from the node, verified on arrival
    size: int
    link: bytes | None = None  # symlink target: the object body
    key: str | None = None  # the object's whole key, where it is not PREFIX/<rel> (an in_s3 root)


@dataclass
class S3Plan:
    upload: list[S3Item] = field(default_factory=list)
    current: list[S3Item] = field(default_factory=list)

    @property
    def upload_bytes(self) -> int:
        return sum(i.size for i in self.upload)


@dataclass
class S3Result:
    uploaded: int = 0
    uploaded_bytes: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    aborted_uploads: list[str] = field(default_factory=list)
    open_uploads_after: list[str] = field(default_factory=list)
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.open_uploads_after


class S3Upload:
    """The S3 side of one backup directory."""

    def __init__(
        self,
        dest: str | os.PathLike[str],
        location: S3Location,
        *,
        client: Any = None,
        endpoint: str | None = None,
        workers: int = 8,
        progress: Callable[[Progress], None] | None = None,
        progress_interval: float = 1.0,
        part_size: int | None = None,
        owner_tag: str = "",
    ) -> None:
        self.dest = Path(dest)
        self.owner_tag = owner_tag  # written as each object's gpuhost-owner metadata
        self.part_size = part_size or PART_SIZE
        self.multipart_threshold = part_size if part_size else MULTIPART_THRESHOLD
        self.loc = location
        # every body goes with its ChecksumSHA256 header, which the signature covers: no second
        # SHA-256 of each body only to sign it (make_client)
        self.client = client or make_client(endpoint, max_pool=workers * 2, sign_payload=False)
        self.workers = workers
        self.progress = progress
        self.progress_interval = progress_interval
        meta = self.dest / _META  # made by the state's first record (StateFile), never here
        # one state per destination: the same directory may go to two buckets
        self.state = StateFile(meta, f"s3-{state_tag(str(self.client.meta.endpoint_url), location.url)}")
        self._lock = threading.Lock()
        self._fast: SignedPut | None = None  # single-request uploads without botocore's pipeline

    @property
    def fast_puts(self) -> int:
        """How many objects went through the SignedPut path (the rest through boto3)."""
        return self._fast.sent if self._fast is not None else 0

    # -- listing and planning

    def key_of(self, item: S3Item) -> str:
        """Return the object key of an item."""
        return item.key if item.key is not None else self.loc.key(key_for(item.rel))

    def list_prefix(self) -> dict[str, dict[str, Any]]:
        """Map key -> {etag, size} for every object under the prefix (1000 keys per request)."""
        out: dict[str, dict[str, Any]] = {}
        pager = self.client.get_paginator("list_objects_v2")
        prefix = self.loc.prefix + "/" if self.loc.prefix else ""
        for page in pager.paginate(Bucket=self.loc.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = {"etag": obj["ETag"].strip('"'), "size": obj["Size"]}
        return out

    def plan(self, items: Iterable[S3Item], listing: dict[str, dict[str, Any]] | None = None) -> S3Plan:
        """Split items into those verified in the bucket already and those to upload."""
        listing = self.list_prefix() if listing is None else listing
        plan = S3Plan()
        for item in items:
            key = self.key_of(item)
            obj = listing.get(key)
            rec = self.state.items.get(key)
            if (
                obj is not None
                and rec is not None
                and rec.get("sha256") == item.sha256
                and rec.get("etag") == obj["etag"]
                and obj["size"] == item.size
            ):
                plan.current.append(item)
            else:
                plan.upload.append(item)
        return plan

    # -- multipart hygiene

    def all_open_uploads(self) -> list[tuple[str, str]]:
        """List (key, upload id) of every multipart upload open under the prefix (a folder: the
        prefix `p` lists `p/...`, never `px/...`), whoever started it."""
        out = []
        prefix = self.loc.prefix + "/" if self.loc.prefix else ""
        kwargs: dict[str, Any] = {"Bucket": self.loc.bucket, "Prefix": prefix}
        while True:
            res = self.client.list_multipart_uploads(**kwargs)
            out += [(u["Key"], u["UploadId"]) for u in res.get("Uploads", []) or []]
            if not res.get("IsTruncated"):
                return out
            kwargs.update(KeyMarker=res["NextKeyMarker"], UploadIdMarker=res["NextUploadIdMarker"])

    def open_uploads(self) -> list[tuple[str, str]]:
        """List (key, upload id) of the multipart uploads open under the prefix that THIS backup
        started (its journal records each upload id before the first part): only those are its
        own to abort. Another tool's upload in progress (the pipeline's, at an in_s3 location)
        or another node's is never touched."""
        mine = {
            str(v.get("upload_id")): str(v.get("key"))
            for k, v in self.state.items.items()
            if k.startswith(_MPU) and isinstance(v, dict)
        }
        return [(key, uid) for key, uid in self.all_open_uploads() if mine.get(uid) == key]

    def abort_open_uploads(self) -> list[str]:
        """Abort the multipart uploads this backup left open (an interrupted run of its own)."""
        aborted = []
        for key, upload_id in self.open_uploads():
            self.client.abort_multipart_upload(Bucket=self.loc.bucket, Key=key, UploadId=upload_id)
            self._forget_upload(upload_id)
            aborted.append(key)
        # an upload of ours that is no longer open (completed or aborted meanwhile) is forgotten
        still = {uid for _, uid in self.all_open_uploads()}
        for k in [k for k in self.state.items if k.startswith(_MPU) and k[len(_MPU) :] not in still]:
            self.state.forget(k)
        return aborted

    def _record_upload(self, key: str, upload_id: str) -> None:
        with self._lock:
            self.state.record(_MPU + upload_id, {"key": key, "upload_id": upload_id})
            self.state.flush()  # before the first part: a cut run's next run must know it is ours

    def _forget_upload(self, upload_id: str) -> None:
        with self._lock:
            self.state.forget(_MPU + upload_id)

    # -- upload

    def run(self, plan: S3Plan) -> S3Result:
        """Upload the plan's items in parallel, verify each, journal each verified object."""
        session = self.start(expected=len(plan.upload), expected_bytes=plan.upload_bytes)
        # big files first, so that their multipart uploads overlap with the many small ones
        for item in sorted(plan.upload, key=lambda i: -i.size):
            session.offer(item)
        return session.finish()

    def start(
        self, *, expected: int = 0, expected_bytes: int = 0, skip_current: bool = False
    ) -> UploadSession:
        """Begin an upload session: abort leftovers, then take items with offer() until finish().

        With skip_current, offered items already verified in the bucket are skipped (one listing
        of the prefix is taken now); the backup uses this to upload files as they arrive.
        """
        return UploadSession(self, expected, expected_bytes, skip_current)

    def _upload_one(self, item: S3Item, tick: Callable[[int], None]) -> dict[str, Any]:
        key = self.key_of(item)
        meta = {"sha256": item.sha256}
        if self.owner_tag:
            meta["gpuhost-owner"] = self.owner_tag
        if item.link is not None:
            meta["symlink"] = "1"
            body = item.link
            digest = hashlib.sha256(body).digest()
            if digest.hex() != item.sha256:
                raise S3Error("link target differs from the verified one")
            etag = self._put(key, body, digest, meta)
        elif item.size >= self.multipart_threshold:
            etag = self._multipart(key, self.dest / item.rel, item, meta, tick)
        else:
            with open(self.dest / item.rel, "rb") as f:
                body = f.read()
            digest = hashlib.sha256(body).digest()
            if len(body) != item.size or digest.hex() != item.sha256:
                raise S3Error("local copy no longer matches its verified SHA-256; back up again")
            etag = self._put(key, body, digest, meta)
            tick(len(body))
        return {"key": key, "sha256": item.sha256, "etag": etag, "size": item.size}

    def _put(self, key: str, body: bytes, digest: bytes, meta: dict[str, str]) -> str:
        sha_b64 = base64.b64encode(digest).decode()
        headers = {f"x-amz-meta-{k}": v for k, v in meta.items()}
        headers.update({"x-amz-checksum-sha256": sha_b64, "x-amz-sdk-checksum-algorithm": "SHA256"})

        def call() -> Any:
            return self.client.put_object(
                Bucket=self.loc.bucket,
                Key=key,
                Body=body,
                Metadata=meta,
                ChecksumAlgorithm="SHA256",
                ChecksumSHA256=sha_b64,
            )

        res: Any = None
        if self._fast is None:
            with self._lock:  # the first put goes through boto3, watched (SignedPut.learn)
                if self._fast is None:
                    self._fast, res = SignedPut.learn(self.client, self.loc.bucket, key, call)
        got = self._fast.put(key, body, headers) if res is None else None
        if got is not None:
            etag, checksum = got.get("etag", ""), got.get("x-amz-checksum-sha256")
        else:
            res = call() if res is None else res
            etag, checksum = str(res["ETag"]), res.get("ChecksumSHA256")
        etag = etag.strip('"')
        if checksum not in (None, sha_b64):
            raise S3Error(f"{key}: S3 reports SHA-256 {checksum}, expected {sha_b64}")
        if etag != hashlib.md5(body).hexdigest() and "-" not in etag:  # noqa: S324 - the ETag is MD5
            raise S3Error(f"{key}: ETag {etag} is not the MD5 of the bytes sent")
        return etag

    def _multipart(
        self, key: str, path: Path, item: S3Item, meta: dict[str, str], tick: Callable[[int], None]
    ) -> str:
        mpu = self.client.create_multipart_upload(
            Bucket=self.loc.bucket, Key=key, Metadata=meta, ChecksumAlgorithm="SHA256"
        )
        upload_id = mpu["UploadId"]
        self._record_upload(key, upload_id)
        whole = hashlib.sha256()
        part_md5s = []
        parts = []
        try:
            with open(path, "rb") as f:
                number = 0
                while True:
                    chunk = f.read(self.part_size)
                    if not chunk:
                        break
                    number += 1
                    whole.update(chunk)
                    md5 = hashlib.md5(chunk)  # noqa: S324 - S3 part ETags are MD5
                    part_md5s.append(md5.digest())
                    sha_b64 = base64.b64encode(hashlib.sha256(chunk).digest()).decode()
                    res = self.client.upload_part(
                        Bucket=self.loc.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=chunk,
                        ChecksumAlgorithm="SHA256",
                        ChecksumSHA256=sha_b64,
                    )
                    if str(res["ETag"]).strip('"') != md5.hexdigest():
                        raise S3Error(f"{key}: part {number} ETag is not the MD5 of the bytes sent")
                    parts.append({"PartNumber": number, "ETag": res["ETag"], "ChecksumSHA256": sha_b64})
                    tick(len(chunk))
            if whole.hexdigest() != item.sha256:
                raise S3Error("local copy no longer matches its verified SHA-256; back up again")
            res = self.client.complete_multipart_upload(
                Bucket=self.loc.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.loc.bucket, Key=key, UploadId=upload_id)
                self._forget_upload(upload_id)
            except Exception:  # noqa: BLE001 - the next run aborts what is left open
                pass
            raise
        self._forget_upload(upload_id)
        etag = str(res["ETag"]).strip('"')
        expect = hashlib.md5(b"".join(part_md5s)).hexdigest() + f"-{len(parts)}"  # noqa: S324
        if etag != expect:
            raise S3Error(f"{key}: multipart ETag {etag}, expected {expect}")
        return etag

    # -- verification

    def verify(self, items: Iterable[S3Item], *, deep: bool = False) -> list[tuple[str, str]]:
        """List (path, why) for items not verified in the bucket; deep: HEAD each and check sha256."""
        listing = self.list_prefix()
        missing = []
        for item in items:
            key = self.key_of(item)
            obj = listing.get(key)
            rec = self.state.items.get(key)
            if obj is None:
                missing.append((item.rel, f"not in {self.loc.url}"))
            elif rec is None or rec.get("sha256") != item.sha256:
                missing.append((item.rel, "in the bucket but not verified against the node's SHA-256"))
            elif rec.get("etag") != obj["etag"] or obj["size"] != item.size:
                missing.append((item.rel, "object changed in the bucket since it was verified"))
            elif deep:
                head = self.client.head_object(Bucket=self.loc.bucket, Key=key, ChecksumMode="ENABLED")
                if head.get("Metadata", {}).get("sha256") != item.sha256:
                    missing.append((item.rel, "object metadata sha256 differs"))
        return missing

    def finish(self) -> None:
        self.state.compact()


class UploadSession:
    """Parallel uploads fed one item at a time (thread-safe offer), collected by finish()."""

    def __init__(self, up: S3Upload, expected: int, expected_bytes: int, skip_current: bool) -> None:
        self.up = up
        self.result = S3Result()
        self.started = time.monotonic()
        self.result.aborted_uploads = up.abort_open_uploads()
        self.listing = up.list_prefix() if skip_current else None
        self.expected = expected
        self.expected_bytes = expected_bytes
        self.done = [0, 0]
        self.last = self.started
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=up.workers, thread_name_prefix="s3up")
        self.futures: list[Future[None]] = []

    def _tick(self, n: int) -> None:
        with self.lock:
            self.done[1] += n
            now = time.monotonic()
            if self.up.progress is not None and now - self.last >= self.up.progress_interval:
                self.last = now
                total = max(self.expected_bytes, self.done[1])
                self.up.progress(
                    Progress(
                        self.done[0],
                        max(self.expected, self.done[0]),
                        self.done[1],
                        total,
                        now - self.started,
                        "S3 upload",
                    )
                )

    def offer(self, item: S3Item) -> None:
        """Queue one item for upload (skipped when the bucket already has it, verified)."""
        if self.listing is not None and self.up.plan([item], self.listing).current:
            return
        with self.lock:
            if self.listing is not None:
                self.expected += 1
                self.expected_bytes += item.size
        self.futures.append(self.pool.submit(self._one, item))

    def _one(self, item: S3Item) -> None:
        try:
            rec = self.up._upload_one(item, self._tick)
        except Exception as exc:  # noqa: BLE001 - one line per failed object
            with self.lock:
                self.result.failed.append((item.rel, f"{type(exc).__name__}: {exc}"))
            return
        with self.lock:
            self.up.state.record(rec.pop("key"), rec)
            self.done[0] += 1
            self.result.uploaded += 1
            self.result.uploaded_bytes += item.size

    def finish(self) -> S3Result:
        """Wait for every offered upload; check that no multipart upload is left open."""
        try:
            self.pool.shutdown(wait=True)
        finally:
            self.up.state.flush()
            self.result.open_uploads_after = [k for k, _ in self.up.open_uploads()]
            self.result.duration = time.monotonic() - self.started
        if self.up.progress is not None:
            self.up.progress(
                Progress(
                    self.done[0],
                    max(self.expected, self.done[0]),
                    self.done[1],
                    max(self.expected_bytes, self.done[1]),
                    self.result.duration,
                    "S3 upload",
                )
            )
        return self.result


def item_for(f: RemoteFile, rec: dict[str, Any]) -> S3Item:
    """Return the S3 item of a file (or link) verified in the local backup with state record rec."""
    if f.kind == "l":
        return S3Item(f.key, rec["sha256"], len(f.link or b""), link=f.link or b"")
    return S3Item(f.key, rec["sha256"], int(rec["s"]))


def items_from_backup(backup: Backup, listing: Listing) -> tuple[list[S3Item], list[tuple[str, str]]]:
    """Return the S3 items of the categories marked s3, and (path, why) for those not verified locally."""
    wanted = {c.name for c in backup.manifest.categories if c.s3}
    items: list[S3Item] = []
    unverified: list[tuple[str, str]] = []
    for f in listing.files:
        if f.category not in wanted:
            continue
        rec = backup.state.items.get(f.key)
        if rec is None or rec.get("s") is None or "sha256" not in rec:
            unverified.append((f.display, "not in the local backup yet"))
            continue
        items.append(item_for(f, rec))
    return items, unverified

"""Proofs in place that are proofs: part sizes asked from S3, strength named, a minimum enforced.

moto serves `HeadObject` with `PartNumber` (each part's ContentLength) and `GetObjectAttributes`
without ObjectParts for uploads made without checksums; both paths are taken here. An upload
whose parts are of unequal sizes was called "different bytes" (the sizes were guessed from the
first part) and sent again over the pipeline's object; a CRC32 alone said "matches".
"""

from __future__ import annotations

import base64
import os
import zlib
from pathlib import Path

import pytest

from pytest_gpuhost.exec.s3io import make_client
from pytest_gpuhost.modules.backup.inplace import STRENGTH, InPlace, ObjectFacts, choose
from pytest_gpuhost.modules.backup.local import Backup
from tests.backup.test_backup_inplace import _manifest, conn  # noqa: F401 - the fixture

MiB = 1024 * 1024


def _multipart(client, bucket: str, key: str, chunks: list[bytes]) -> None:
    mpu = client.create_multipart_upload(Bucket=bucket, Key=key)
    parts = []
    for i, body in enumerate(chunks, 1):
        r = client.upload_part(Bucket=bucket, Key=key, UploadId=mpu["UploadId"], PartNumber=i, Body=body)
        parts.append({"PartNumber": i, "ETag": r["ETag"]})
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=mpu["UploadId"], MultipartUpload={"Parts": parts}
    )


def test_parts_of_unequal_sizes_are_asked_not_guessed(conn, tmp_path: Path, s3_endpoint, monkeypatch):  # noqa: F811
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "data"
    root.mkdir()
    # parts of 6, 5 and 7 MiB and a tail: a guess from the first part (6 MiB) would cut it wrongly
    # and still "fit" (the last part is smaller than the first), calling it different bytes
    chunks = [os.urandom(6 * MiB), os.urandom(5 * MiB + 3), os.urandom(7 * MiB), os.urandom(1000)]
    (root / "shard.bin").write_bytes(b"".join(chunks))
    # a first part smaller than the others
    chunks2 = [os.urandom(5 * MiB), os.urandom(8 * MiB), os.urandom(9 * MiB)]
    (root / "tail.bin").write_bytes(b"".join(chunks2))
    bucket = s3_endpoint.make_bucket("parts")
    client = make_client(s3_endpoint.url)
    _multipart(client, bucket, "p/shard.bin", chunks)
    _multipart(client, bucket, "p/tail.bin", chunks2)
    m = _manifest(root, f"s3://{bucket}/p")
    res = InPlace(conn, m, lambda loc: client, workers=2).check(Backup(conn, m, tmp_path / "d").walk())
    by = {p.url.rsplit("/", 1)[1]: p for p in res.proofs}
    assert by["shard.bin"].ok, by["shard.bin"].how
    assert "4 parts of 5242883..7340032 bytes, sizes from S3" in by["shard.bin"].how
    assert by["tail.bin"].ok and by["tail.bin"].strength == "md5", by["tail.bin"].how
    assert not res.to_send


def test_a_proof_weaker_than_the_minimum_is_not_a_pass() -> None:
    crc32 = base64.b64encode(zlib.crc32(b"x").to_bytes(4, "big")).decode()
    kms_crc = ObjectFacts("k", 1, "0" * 32, {"ChecksumCRC32": crc32}, "FULL_OBJECT", "aws:kms")
    need = choose(kms_crc, "crc32")
    assert not isinstance(need, str) and need.strength == "crc32"
    why = choose(kms_crc, "crc64")
    assert isinstance(why, str) and "weaker than --in-s3-min-proof=crc64" in why
    md5 = ObjectFacts("k", 1, "0" * 32, {"ChecksumCRC32": crc32})
    need = choose(md5, "md5")
    assert not isinstance(need, str) and need.strength == "md5"  # the strongest is used
    assert isinstance(choose(md5, "sha256"), str)
    sha = base64.b64encode(b"\1" * 32).decode()
    need = choose(ObjectFacts("k", 1, "0" * 32, {"ChecksumSHA256": sha}), "sha256")
    assert not isinstance(need, str) and need.strength == "sha256"
    assert list(STRENGTH) == ["sha256", "sha1", "md5", "crc64", "crc32"]


def test_the_default_minimum_refuses_a_crc32_alone(conn, tmp_path: Path, s3_endpoint, monkeypatch):  # noqa: F811
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "data"
    root.mkdir()
    (root / "kms.bin").write_bytes(b"k" * 4000)
    bucket = s3_endpoint.make_bucket("crc")
    sdk = s3_endpoint.client()
    sdk.put_object(
        Bucket=bucket,
        Key="p/kms.bin",
        Body=b"k" * 4000,
        ServerSideEncryption="aws:kms",
        ChecksumAlgorithm="CRC32",
    )
    m = _manifest(root, f"s3://{bucket}/p")
    listing = Backup(conn, m, tmp_path / "d").walk()
    client = make_client(s3_endpoint.url)
    (p,) = InPlace(conn, m, lambda loc: client, workers=2).check(listing).proofs
    assert not p.ok and not p.send and "weaker than --in-s3-min-proof=crc64" in p.how
    (p,) = InPlace(conn, m, lambda loc: client, workers=2, min_proof="crc32").check(listing).proofs
    assert p.ok and p.strength == "crc32" and p.how.startswith("CRC32 checksum")


def test_an_object_replaced_after_the_proof_is_proved_again(conn, tmp_path: Path, s3_endpoint, monkeypatch):  # noqa: F811
    """The verdict reuses this run's earlier proofs only while the object is the one proved: an
    object replaced in S3 between the in-place proof and the verdict is judged again."""
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "data"
    root.mkdir()
    body = os.urandom(5000)
    (root / "a.bin").write_bytes(body)
    bucket = s3_endpoint.make_bucket("swap")
    client = make_client(s3_endpoint.url)
    client.put_object(Bucket=bucket, Key="p/a.bin", Body=body)
    m = _manifest(root, f"s3://{bucket}/p")
    listing = Backup(conn, m, tmp_path / "d").walk()
    checker = InPlace(conn, m, lambda loc: client, workers=2)
    first = checker.check(listing)
    assert [p.ok for p in first.proofs] == [True]
    client.put_object(Bucket=bucket, Key="p/a.bin", Body=os.urandom(5000))  # same size, other bytes
    (p,) = checker.check(listing, first).proofs
    assert not p.ok and p.send and "different bytes" in p.how


@pytest.mark.parametrize("min_proof", ["sha512", "", "CRC"])
def test_an_unknown_minimum_is_refused(min_proof: str) -> None:
    with pytest.raises(ValueError, match="expected one of sha256, sha1, md5, crc64, crc32"):
        InPlace(None, None, lambda loc: None, min_proof=min_proof)  # type: ignore[arg-type]

"""Files already in S3, written there by the aws cli and boto3, proved in place against moto.

Each object kind a node's own pipeline leaves (single-part with and without a checksum,
multipart with the cli's and another part size, SHA-256 and SHA-1 checksums, SSE-KMS) is proved
by what it carries, from the node's bytes, with nothing uploaded; a changed or missing object is
to be sent again; an object nothing can prove is named, never passed.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import zlib
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig

from pytest_gpuhost.exec.agent.probe_backup_digests import _Crc
from pytest_gpuhost.exec.s3io import make_client
from pytest_gpuhost.exec.targets import open_connection, parse_host_url
from pytest_gpuhost.modules.backup.inplace import InPlace, ObjectFacts, choose, multipart_etag
from pytest_gpuhost.modules.backup.local import Backup, Category, Manifest
from pytest_gpuhost.modules.process import Selection

MiB = 1024 * 1024


@pytest.fixture
def conn():
    c = open_connection(parse_host_url("local://"))
    yield c
    c.close()


def _tree(root: Path) -> dict[str, bytes]:
    files = {
        "completions/part-0000.jsonl": os.urandom(3 * MiB + 17),
        "shards/data-00000-of-00002.arrow": os.urandom(20 * MiB + 5),  # multipart by the cli (8 MiB)
        "shards/data-00001-of-00002.arrow": os.urandom(11 * MiB + 1),
        "state.json": b'{"step": 1200}\n',
        "dir with space/notes.txt": b"hello\n",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _manifest(root: Path, url: str) -> Manifest:
    return Manifest("t", (Category("data", (str(root),), in_s3=((str(root), url),)),), Selection())


def _aws(env, *args: str) -> None:
    aws = Path(os.sys.executable).with_name("aws")
    subprocess.run(
        [str(aws), "--endpoint-url", env.url, *args],
        check=True,
        env={**os.environ, **env.env},
        capture_output=True,
        timeout=120,
    )


def _inplace(conn, m: Manifest, ep) -> InPlace:
    client = make_client(ep.url)
    return InPlace(conn, m, lambda loc: client, workers=2)


def test_aws_cli_sync_is_proved_in_place_with_nothing_sent(conn, tmp_path, s3_endpoint, monkeypatch):
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "data"
    files = _tree(root)
    bucket = s3_endpoint.make_bucket("dflash")
    _aws(s3_endpoint, "s3", "sync", str(root), f"s3://{bucket}/dflash/")
    m = _manifest(root, f"s3://{bucket}/dflash/")
    listing = Backup(conn, m, tmp_path / "dest").walk()
    res = _inplace(conn, m, s3_endpoint).check(listing)
    assert len(res.proofs) == len(files)
    assert all(p.ok for p in res.proofs), [(p.url, p.how) for p in res.proofs if not p.ok]
    assert not res.to_send and not res.unverifiable
    big = next(p for p in res.proofs if p.url.endswith("data-00000-of-00002.arrow"))
    assert "multipart ETag (3 parts of 8388608 bytes, sizes from S3)" in big.how  # the cli's 8 MiB parts
    assert res.hashed_bytes == sum(len(v) for v in files.values())


def test_boto3_objects_of_every_kind(conn, tmp_path, s3_endpoint, monkeypatch):
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "data"
    files = _tree(root)
    extra = {
        "plain.bin": os.urandom(100_000),
        "sha1.bin": os.urandom(5000),
        "kms.bin": os.urandom(4000),
        "kms-sha.bin": os.urandom(4000),
        "changed.bin": os.urandom(9000),
        "gone.bin": os.urandom(10),
    }
    for rel, data in extra.items():
        (root / rel).write_bytes(data)
    bucket = s3_endpoint.make_bucket("kinds")
    raw = make_client(s3_endpoint.url)  # no checksum unless asked (request_checksum_calculation)
    sdk = s3_endpoint.client()  # the SDK's default: a CRC32 on every upload
    key = lambda rel: f"run/{rel}"  # noqa: E731
    sdk.upload_file(
        str(root / "shards/data-00000-of-00002.arrow"),
        bucket,
        key("shards/data-00000-of-00002.arrow"),
        Config=TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB),
    )
    sdk.upload_file(
        str(root / "shards/data-00001-of-00002.arrow"),
        bucket,
        key("shards/data-00001-of-00002.arrow"),
        Config=TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=6 * MiB),
        ExtraArgs={"ChecksumAlgorithm": "SHA256"},
    )
    sdk.put_object(
        Bucket=bucket,
        Key=key("completions/part-0000.jsonl"),
        Body=files["completions/part-0000.jsonl"],
        ChecksumAlgorithm="SHA256",
    )
    raw.put_object(Bucket=bucket, Key=key("state.json"), Body=files["state.json"])
    raw.put_object(Bucket=bucket, Key=key("dir with space/notes.txt"), Body=files["dir with space/notes.txt"])
    raw.put_object(Bucket=bucket, Key=key("plain.bin"), Body=extra["plain.bin"])
    sdk.put_object(Bucket=bucket, Key=key("sha1.bin"), Body=extra["sha1.bin"], ChecksumAlgorithm="SHA1")
    raw.put_object(Bucket=bucket, Key=key("kms.bin"), Body=extra["kms.bin"], ServerSideEncryption="aws:kms")
    sdk.put_object(
        Bucket=bucket,
        Key=key("kms-sha.bin"),
        Body=extra["kms-sha.bin"],
        ServerSideEncryption="aws:kms",
        ChecksumAlgorithm="SHA256",
    )
    raw.put_object(Bucket=bucket, Key=key("changed.bin"), Body=os.urandom(9000))  # same size, other bytes
    m = _manifest(root, f"s3://{bucket}/run")
    listing = Backup(conn, m, tmp_path / "dest").walk()
    res = _inplace(conn, m, s3_endpoint).check(listing)
    by = {p.url.rsplit("/run/", 1)[1]: p for p in res.proofs}
    assert by["shards/data-00000-of-00002.arrow"].ok
    assert (
        "multipart ETag (5 parts of 5242880 bytes, sizes from S3)"
        in by["shards/data-00000-of-00002.arrow"].how
    )
    assert by["shards/data-00001-of-00002.arrow"].ok  # composite SHA-256: the ETag proves it
    assert (
        "multipart ETag (2 parts of 6291456 bytes, sizes from S3)"
        in by["shards/data-00001-of-00002.arrow"].how
    )
    assert by["completions/part-0000.jsonl"].how.startswith("SHA-256 checksum")
    assert by["sha1.bin"].how.startswith("SHA-1 checksum") and by["sha1.bin"].ok
    assert by["plain.bin"].how.startswith("MD5 ETag") and by["plain.bin"].ok
    assert by["state.json"].ok and by["dir with space/notes.txt"].ok
    assert by["kms-sha.bin"].ok and by["kms-sha.bin"].how.startswith("SHA-256 checksum")
    kms = by["kms.bin"]
    assert not kms.ok and not kms.send and "aws:kms" in kms.how and "copy-object" in kms.how
    assert not by["changed.bin"].ok and by["changed.bin"].send and "different bytes" in by["changed.bin"].how
    assert not by["gone.bin"].ok and by["gone.bin"].send and "not in s3://" in by["gone.bin"].how
    assert {f.display.rsplit("/", 1)[1] for f in res.to_send} == {"changed.bin", "gone.bin"}
    assert [p.url.rsplit("/", 1)[1] for p in res.unverifiable] == ["kms.bin"]


def test_a_file_changed_on_the_node_after_the_upload_is_different(conn, tmp_path, s3_endpoint, monkeypatch):
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "data"
    _tree(root)
    bucket = s3_endpoint.make_bucket("later")
    _aws(s3_endpoint, "s3", "sync", str(root), f"s3://{bucket}/p/")
    big = root / "shards/data-00000-of-00002.arrow"
    st = big.stat()
    with open(big, "r+b") as f:  # one byte in the last part, size and mtime put back
        f.seek(st.st_size - 2)
        f.write(b"\0" if f.read(1) != b"\0" else b"\1")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    m = _manifest(root, f"s3://{bucket}/p")
    res = _inplace(conn, m, s3_endpoint).check(Backup(conn, m, tmp_path / "dest").walk())
    bad = [p for p in res.proofs if not p.ok]
    assert [p.url.rsplit("/", 1)[1] for p in bad] == ["data-00000-of-00002.arrow"] and bad[0].send


# ---------------------------------------------------------------- the arithmetic


def test_multipart_etag_matches_the_published_rule():
    # two parts: MD5 of the concatenated binary part MD5s, "-2" (AWS S3 user guide, "Checking
    # object integrity": the ETag of a multipart upload)
    a, b = b"a" * (5 * MiB), b"b" * 10
    parts = [hashlib.md5(a).hexdigest(), hashlib.md5(b).hexdigest()]  # noqa: S324
    want = hashlib.md5(hashlib.md5(a).digest() + hashlib.md5(b).digest()).hexdigest() + "-2"  # noqa: S324
    assert multipart_etag(parts) == want


@pytest.mark.parametrize(
    ("name", "data", "hexdigest"),
    [
        # the check values of the CRC catalogue ("123456789"), RFC 3720 B.4 and NVMe NVM 5.2.1.3.4
        ("crc32c", b"123456789", "e3069283"),
        ("crc64nvme", b"123456789", "ae8b14860a799888"),
        # AWS's own example values: CRC32C of "hello" as S3 reports it (base64 mnG7TA==)
        ("crc32c", b"hello", base64.b64decode("mnG7TA==").hex()),
    ],
)
def test_node_crcs_match_published_check_values(name, data, hexdigest):
    c = _Crc(name)
    c.update(data)
    assert c.digest().hex() == hexdigest


def test_crc_only_objects_are_proved_by_their_crc_and_kms_without_checksum_is_not():
    crc32 = base64.b64encode(zlib.crc32(b"x").to_bytes(4, "big")).decode()
    kms_crc = ObjectFacts("k", 1, "0" * 32, {"ChecksumCRC32": crc32}, "FULL_OBJECT", "aws:kms")
    need = choose(kms_crc)
    assert not isinstance(need, str) and need.want == ("crc32",) and need.how == "CRC32 checksum"
    composite = ObjectFacts("k", 1, "f" * 32 + "-3", {"ChecksumCRC32": crc32 + "-3"}, "COMPOSITE", "aws:kms")
    why = choose(composite)
    assert isinstance(why, str) and why.startswith("cannot be verified")
    c_only = ObjectFacts("k", 1, "zz", {"ChecksumCRC64NVME": "AAAAAAAAAAA="}, None, "SSE-C (customer key)")
    need = choose(c_only)
    assert not isinstance(need, str) and need.want == ("crc64nvme",)

"""S3 I/O for every part of the plugin: s3:// URLs, one client factory, put/get/list, typed errors.

The fleet summary writer, the merge command and the backup upload all talk to S3 (or an
S3-compatible store such as MinIO or Ceph RGW) through this module. Credentials come from boto3's
usual chain (environment, `~/.aws`, instance role); the endpoint from the caller, or boto3's own
configuration (`AWS_ENDPOINT_URL`) when the caller gives none. boto3 is imported on first use, so
a run that never touches S3 does not need it installed.

Errors are `S3Error` (a `GpuhostError`): `S3UrlError` for a malformed URL (also a `ValueError`,
as URL parsing raised before), `S3NotFound` for a missing bucket or key, `S3Error` itself for
everything else the client or the store reports. Callers decide by type, never by message.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from pytest_gpuhost.errors import GpuhostError

__all__ = [
    "S3Error",
    "S3Location",
    "S3NotFound",
    "S3Object",
    "S3Store",
    "S3UrlError",
    "make_client",
    "parse_s3_url",
    "split_s3_url",
]

# Error codes S3 (and the compatible stores) answer for something that does not exist.
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})


class S3Error(GpuhostError):
    """An S3 operation failed (the store refused it, or it could not be reached)."""


class S3UrlError(S3Error, ValueError):
    """A string is not an s3://BUCKET[/KEY] URL."""


class S3NotFound(S3Error):
    """The bucket or the object an operation named does not exist."""


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix: s3://BUCKET/PREFIX."""

    bucket: str
    prefix: str  # without leading or trailing slash; may be ""

    @property
    def url(self) -> str:
        """Return the location as an s3:// URL."""
        return f"s3://{self.bucket}/{self.prefix}"

    def key(self, rel: str) -> str:
        """Return the key of `rel` under the prefix."""
        return f"{self.prefix}/{rel}" if self.prefix else rel


@dataclass(frozen=True)
class S3Object:
    """One object of a listing."""

    key: str
    size: int
    etag: str  # without the quotes S3 puts around it


def parse_s3_url(url: str) -> S3Location:
    """Parse s3://BUCKET[/PREFIX] into a location whose prefix has no surrounding slashes."""
    u = urlparse(url)
    if u.scheme != "s3" or not u.netloc:
        raise S3UrlError(f"{url!r} is not an s3://BUCKET/PREFIX URL")
    return S3Location(u.netloc, u.path.strip("/"))


def split_s3_url(url: str) -> tuple[str, str]:
    """Return (bucket, key) of s3://BUCKET/KEY exactly as written (a key may end with `/`)."""
    if not url.startswith("s3://"):
        raise S3UrlError(f"{url!r} is not an s3://BUCKET/KEY URL")
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not bucket:
        raise S3UrlError(f"{url!r}: no bucket in the s3:// URL")
    return bucket, key


def make_client(endpoint: str | None = None, *, max_pool: int = 16) -> Any:
    """Return a boto3 S3 client: credentials from boto3's chain, optional S3-compatible endpoint.

    Checksums are computed only where an operation requires them: S3-compatible stores that do
    not know the newer default checksum headers otherwise refuse every upload.
    """
    import boto3
    from botocore.config import Config

    cfg = Config(
        max_pool_connections=max_pool,
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client("s3", endpoint_url=endpoint or None, config=cfg)


def _wrap(exc: Exception, what: str) -> S3Error:
    """Return the S3Error for a botocore exception (NotFound by the store's error code)."""
    response = getattr(exc, "response", None)
    code = str(((response or {}).get("Error") or {}).get("Code", "")) if isinstance(response, dict) else ""
    cls = S3NotFound if code in _NOT_FOUND_CODES else S3Error
    return cls(f"{what}: {type(exc).__name__}: {exc}")


def _botocore_errors() -> tuple[type[Exception], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


class S3Store:
    """put/get/list of whole objects named by s3:// URLs, on one client.

    `S3Store()` uses boto3's configuration; `S3Store(endpoint="http://minio:9000")` an
    S3-compatible store; `S3Store(client=...)` an existing boto3 client. The client is made
    on first use.
    """

    def __init__(self, endpoint: str | None = None, *, client: Any = None, max_pool: int = 16) -> None:
        self.endpoint = endpoint
        self.max_pool = max_pool
        self._client = client

    @property
    def client(self) -> Any:
        """The boto3 client (made on first use)."""
        if self._client is None:
            try:
                self._client = make_client(self.endpoint, max_pool=self.max_pool)
            except ImportError as exc:
                raise S3Error(f"S3 needs boto3: pip install boto3 ({exc})") from None
        return self._client

    def put(self, url: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
        """Upload `data` as the object s3://BUCKET/KEY."""
        bucket, key = split_s3_url(url)
        if not key or key.endswith("/"):
            raise S3UrlError(f"{url!r} names a prefix, not an object")
        try:
            self.client.put_object(Bucket=bucket, Key=key, Body=data, ContentType=content_type)
        except _botocore_errors() as exc:
            raise _wrap(exc, f"upload to {url}") from None

    def get(self, url: str) -> bytes:
        """Download the object s3://BUCKET/KEY."""
        bucket, key = split_s3_url(url)
        try:
            body: bytes = self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except _botocore_errors() as exc:
            raise _wrap(exc, f"download of {url}") from None
        return body

    def objects(self, bucket: str, prefix: str = "") -> Iterator[S3Object]:
        """Yield every object under `prefix` in `bucket` (1000 keys per request)."""
        try:
            pager = self.client.get_paginator("list_objects_v2")
            for page in pager.paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents") or []:
                    yield S3Object(obj["Key"], int(obj["Size"]), str(obj["ETag"]).strip('"'))
        except _botocore_errors() as exc:
            raise _wrap(exc, f"listing of s3://{bucket}/{prefix}") from None

    def list(self, url: str, *, suffix: str = "") -> list[str]:
        """Return the s3:// URLs of the objects under a prefix whose key ends with `suffix`, sorted."""
        bucket, prefix = split_s3_url(url)
        return sorted(
            f"s3://{bucket}/{o.key}" for o in self.objects(bucket, prefix) if o.key.endswith(suffix)
        )

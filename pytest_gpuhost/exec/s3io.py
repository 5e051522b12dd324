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

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlparse

from pytest_gpuhost.errors import GpuhostError

__all__ = [
    "S3Error",
    "S3Location",
    "S3NotFound",
    "S3Object",
    "S3Store",
    "S3UrlError",
    "SignedPut",
    "location_problem",
    "make_client",
    "parse_s3_url",
    "probe_client",
    "s3_problem",
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


def make_client(endpoint: str | None = None, *, max_pool: int = 16, sign_payload: bool = True) -> Any:
    """Return a boto3 S3 client: credentials from boto3's chain, optional S3-compatible endpoint.

    Checksums are computed only where an operation requires them: S3-compatible stores that do
    not know the newer default checksum headers otherwise refuse every upload.

    `sign_payload=False` is for callers that send every body with its own checksum header
    (`ChecksumSHA256`): the signature then covers that header instead of a SHA-256 of the body,
    which is what botocore itself does over HTTPS when a checksum header is present
    (`S3SigV4Auth._should_sha256_sign_payload`), also over plain HTTP, where botocore would
    otherwise hash every body once more only to sign it (docs/backup-speed.md).
    """
    import boto3
    from botocore.config import Config

    extra: dict[str, Any] = {} if sign_payload else {"s3": {"payload_signing_enabled": False}}
    cfg = Config(
        max_pool_connections=max_pool,
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        **extra,
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


# A bucket name that needs no special endpoint (no access point ARN, no directory bucket `--x-s3`).
_PLAIN_BUCKET = re.compile(r"[a-z0-9](?:[a-z0-9.]|-(?!-)){1,61}[a-z0-9]")


class SignedPut:
    """PutObject of one body without botocore's per-call pipeline: about half its CPU per object.

    A backup uploads thousands of small files, and botocore spends about 1.2 ms of CPU on each
    `put_object` (parameter validation, endpoint rules, event hooks, response parsing), more
    than the upload itself (docs/backup-speed.md).  `learn()` makes the first PutObject through
    boto3 and watches the request it sends; later ones are the same request: the URL of that
    request with the key percent-encoded as botocore's serializer does (UTF-8, `/` and `~`
    kept), signed by botocore's `S3SigV4Auth` with the client's credentials and the signing
    region and service of the watched request, sent on the client's own HTTP session (its
    pool, TLS verification, proxies and timeouts).  Anything unusual (a bucket that is not
    plain, a signature other than SigV4, a URL that is not prefix + key) leaves it off; any
    failure (an exception, a status other than 200) turns it off for good, and the caller makes
    the call through boto3, which retries and reports as usual.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.sent = 0  # objects stored through this path
        self._lock = threading.Lock()

    @classmethod
    def learn(cls, client: Any, bucket: str, key: str, call: Callable[[], Any]) -> tuple[SignedPut, Any]:
        """Run call() (a boto3 put_object of key), watching its request; return the path and its result."""
        seen: list[tuple[str, Any]] = []

        def watch(request: Any, **_: Any) -> None:
            seen.append((str(request.url), request.headers.get("Authorization")))

        events = client.meta.events
        events.register("before-send.s3.PutObject", watch)
        try:
            result = call()
        finally:
            events.unregister("before-send.s3.PutObject", watch)
        fast = cls()
        try:
            fast._setup(client, bucket, key, seen)
        except Exception:  # noqa: BLE001 - no fast path; boto3 does the work
            fast.enabled = False
        return fast, result

    def _setup(self, client: Any, bucket: str, key: str, seen: list[tuple[str, Any]]) -> None:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        if not seen or not _PLAIN_BUCKET.fullmatch(bucket):
            return
        url, auth = seen[-1]
        auth = auth.decode() if isinstance(auth, bytes) else str(auth or "")
        suffix = quote(key.encode("utf-8"), safe="/~")
        m = re.match(r"AWS4-HMAC-SHA256 Credential=[^/]+/\d{8}/([^/]+)/([^/]+)/aws4_request,", auth)
        creds = client._get_credentials()
        if m is None or "?" in url or not url.endswith(suffix) or creds is None:
            return
        self._prefix = url[: -len(suffix)]
        self._region, self._service = m.group(1), m.group(2)
        self._creds = creds
        self._config = client.meta.config
        self._session = client._endpoint.http_session
        self._auth = S3SigV4Auth
        self._request = AWSRequest
        self.enabled = True

    def put(self, key: str, body: bytes, headers: Mapping[str, str]) -> dict[str, str] | None:
        """Store body under key; return the response headers (lower-case names), or None: use boto3."""
        if not self.enabled:
            return None
        try:
            req = self._request(
                "PUT", self._prefix + quote(key.encode("utf-8"), safe="/~"), data=body, headers=dict(headers)
            )
            req.context["client_config"] = self._config  # its payload_signing_enabled setting
            self._auth(self._creds.get_frozen_credentials(), self._service, self._region).add_auth(req)
            res = self._session.send(req.prepare())
        except Exception:  # noqa: BLE001 - boto3 makes the call again and reports
            self.enabled = False
            return None
        if res.status_code != 200:
            self.enabled = False
            return None
        with self._lock:
            self.sent += 1
        return {str(k).lower(): str(v) for k, v in res.headers.items()}


# ------------------------------------------------------------------ can a run read this location?

# What an operator does about each refusal (the store's error code -> one line).
_ADVICE: dict[str, str] = {
    "NoSuchBucket": "no such bucket",
    "InvalidAccessKeyId": "access denied ({code}): check AWS_ACCESS_KEY_ID / the profile",
    "SignatureDoesNotMatch": "access denied ({code}): check AWS_SECRET_ACCESS_KEY / the profile",
    "InvalidToken": "access denied ({code}): check AWS_SESSION_TOKEN / the profile",
    "ExpiredToken": "access denied ({code}): the session token expired; renew the credentials",
    "TokenRefreshRequired": "access denied ({code}): the session token expired; renew the credentials",
    "AccessDenied": "access denied ({code}): the credentials may not list this prefix (s3:ListBucket)",
    "AllAccessDisabled": "access denied ({code}): every access to this bucket is disabled",
    "AccountProblem": "access denied ({code}): the account the credentials belong to cannot be used",
    "PermanentRedirect": "the bucket is in another region ({code}): set AWS_REGION / the profile's region",
    "AuthorizationHeaderMalformed": "the bucket is in another region ({code}): set AWS_REGION",
}
_ADVICE["404"] = _ADVICE["NotFound"] = _ADVICE["NoSuchBucket"]
_ADVICE["403"] = _ADVICE["Forbidden"] = _ADVICE["AccessDenied"]
_ADVICE["301"] = _ADVICE["PermanentRedirect"]
# Codes a HEAD answers without a body: a listing of the same bucket says more.
_BARE_CODES = frozenset({"400", "403", "404", "301", "NotFound", "Forbidden", "BadRequest"})


def _one_line(text: str, limit: int = 200) -> str:
    """Return the first line of `text`, shortened to `limit` characters."""
    lines = str(text).strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


def s3_problem(exc: BaseException, endpoint: str | None = None) -> str:
    """Say in one line why an S3 call failed, with what to check: never a traceback.

    A store's refusal is named by its error code ("no such bucket (NoSuchBucket)", "access
    denied (InvalidAccessKeyId): check AWS_ACCESS_KEY_ID / the profile"); a client that has no
    credentials, or cannot reach the endpoint, by botocore's exception name.
    """
    name = type(exc).__name__
    if isinstance(exc, ImportError):
        return f"S3 needs boto3: pip install boto3 ({_one_line(str(exc))})"
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        code = str(error.get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode") or name)
        advice = _ADVICE.get(code)
        if advice is not None:
            return advice.format(code=code) if "{code}" in advice else f"{advice} ({code})"
        message = _one_line(str(error.get("Message") or exc))
        return f"refused ({code}): {message}" if message else f"refused ({code})"
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (
            f"no usable credentials ({name}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
        )
    if name == "ProfileNotFound":
        return f"no such profile ({name}): check AWS_PROFILE / ~/.aws/config"
    if name in (
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ConnectionClosedError",
        "ProxyConnectionError",
    ):
        where = endpoint or "the AWS endpoint"
        return f"cannot reach {where} ({name}): check --s3-endpoint, the network and proxies"
    if name in ("ReadTimeoutError", "SSLError"):
        return f"no answer from {endpoint or 'the AWS endpoint'} ({name}): {_one_line(str(exc))}"
    return f"{name}: {_one_line(str(exc))}" if str(exc) else name


def probe_client(endpoint: str | None = None) -> Any:
    """Return a boto3 S3 client for a quick check before a run: `make_client`'s credentials and
    endpoint, but 2 attempts and a 5 s connect timeout, so a wrong endpoint answers in seconds."""
    import boto3
    from botocore.config import Config

    cfg = Config(
        retries={"max_attempts": 2, "mode": "standard"},
        connect_timeout=5,
        read_timeout=30,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client("s3", endpoint_url=endpoint or None, config=cfg)


def location_problem(url: str, *, endpoint: str | None = None, client: Any = None) -> str | None:
    """Return why s3://BUCKET/PREFIX cannot be read, in one line (`s3_problem`); None when it can.

    Asks what a run asks first, and changes nothing: HeadBucket, then ListObjectsV2 of at most
    one key under the prefix. A listing that works is the answer even where HeadBucket is
    refused (a policy that grants s3:ListBucket only with an `s3:prefix` condition); where both
    fail, the listing's error code (a HEAD has no body to name it) says why. Whether a write
    would be allowed cannot be known without writing, and nothing is written.
    """
    try:
        loc = parse_s3_url(url)
        client = client if client is not None else probe_client(endpoint)
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        return s3_problem(exc, endpoint)
    head: BaseException | None = None
    try:
        client.head_bucket(Bucket=loc.bucket)
    except Exception as exc:  # noqa: BLE001 - the listing decides; one line either way
        if getattr(exc, "response", None) is None:
            return s3_problem(exc, endpoint)  # no answer at all (no credentials, no endpoint)
        head = exc
    try:
        client.list_objects_v2(Bucket=loc.bucket, Prefix=loc.prefix + "/" if loc.prefix else "", MaxKeys=1)
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        code = str(((getattr(exc, "response", None) or {}).get("Error") or {}).get("Code", ""))
        if head is not None and code in _BARE_CODES:
            return s3_problem(head, endpoint)
        return s3_problem(exc, endpoint)
    return None

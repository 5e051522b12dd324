"""exec/s3io: s3:// URL parsing, put/get/list against moto's S3 server, errors by type."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.exec.s3io import (
    S3Error,
    S3Location,
    S3NotFound,
    S3Store,
    S3UrlError,
    parse_s3_url,
    split_s3_url,
)


def test_urls_parse_into_bucket_and_prefix() -> None:
    assert parse_s3_url("s3://b/a/b/") == S3Location("b", "a/b")
    assert parse_s3_url("s3://b").url == "s3://b/"
    assert S3Location("b", "").key("x") == "x" and S3Location("b", "p").key("x") == "p/x"
    assert split_s3_url("s3://b/nightly/") == ("b", "nightly/")


@pytest.mark.parametrize("url", ["http://b/k", "s3:///k", "b/k", ""])
def test_bad_urls_raise_a_url_error_that_is_a_gpuhost_and_a_value_error(url: str) -> None:
    for parse in (parse_s3_url, split_s3_url):
        with pytest.raises(S3UrlError) as info:
            parse(url)
        assert isinstance(info.value, GpuhostError) and isinstance(info.value, ValueError)


@pytest.fixture
def store(s3_endpoint: Any, monkeypatch: pytest.MonkeyPatch) -> S3Store:
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    return S3Store(endpoint=s3_endpoint.url)


def test_put_get_and_list_round_trip(store: S3Store, s3_endpoint: Any) -> None:
    bucket = s3_endpoint.make_bucket("io")
    store.put(f"s3://{bucket}/run/b.json", b"{}", content_type="application/json")
    store.put(f"s3://{bucket}/run/a.json", b"[1]")
    store.put(f"s3://{bucket}/run/notes.txt", b"x")
    store.put(f"s3://{bucket}/other/c.json", b"2")
    assert store.get(f"s3://{bucket}/run/a.json") == b"[1]"
    assert store.list(f"s3://{bucket}/run/", suffix=".json") == [
        f"s3://{bucket}/run/a.json",
        f"s3://{bucket}/run/b.json",
    ]
    sizes = {o.key: o.size for o in store.objects(bucket, "run/")}
    assert sizes == {"run/a.json": 3, "run/b.json": 2, "run/notes.txt": 1}


def test_missing_objects_and_buckets_raise_not_found(store: S3Store, s3_endpoint: Any) -> None:
    bucket = s3_endpoint.make_bucket("io")
    with pytest.raises(S3NotFound):
        store.get(f"s3://{bucket}/absent.json")
    with pytest.raises(S3NotFound):
        store.list("s3://no-such-bucket-gpuhost/x/")


def test_a_prefix_is_not_an_object_to_put(store: S3Store) -> None:
    with pytest.raises(S3UrlError):
        store.put("s3://b/prefix/", b"x")


def test_an_unreachable_endpoint_is_an_s3_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    from pytest_gpuhost.exec import s3io

    client = s3io.make_client("http://127.0.0.1:9")
    client.meta.config.retries = {"max_attempts": 0}
    store = S3Store(client=client)
    with pytest.raises(S3Error) as info:
        store.get("s3://b/k")
    assert not isinstance(info.value, S3NotFound)

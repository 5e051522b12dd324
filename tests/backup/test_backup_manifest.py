"""Manifest validation: names the backup writes itself are never category names."""

from __future__ import annotations

import pytest

from pytest_gpuhost.modules.backup.manifest import validate_manifest


@pytest.mark.parametrize("name", ["NOTES.md", "SHA256SUMS", ".gpuhost", "notes.md", "sha256sums"])
def test_a_category_named_like_the_backups_own_files_is_refused(name: str) -> None:
    problems = validate_manifest({"categories": {name: {"roots": ["/data"]}}})
    assert (
        len(problems) == 1
        and f"categories.{name}" in problems[0]
        and "the backup writes those" in problems[0]
    )


def test_ordinary_category_names_pass() -> None:
    assert (
        validate_manifest({"categories": {"data": {"roots": ["/data"]}, "notes": {"roots": ["/root"]}}}) == []
    )


def _in_s3(spec: dict) -> list[str]:
    return validate_manifest({"categories": {"data": spec}})


def test_in_s3_forms_that_are_valid() -> None:
    assert _in_s3({"roots": ["/data/data"], "in_s3": "s3://bucket/dflash/"}) == []
    assert _in_s3({"roots": ["/a", "/b/"], "in_s3": {"/a": "s3://bucket/a", "/b": "s3://bucket/b"}}) == []


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"roots": ["/a", "/b"], "in_s3": "s3://bucket/p"}, "a mapping {root: s3://BUCKET/PREFIX}"),
        ({"roots": ["/a"], "in_s3": {"/elsewhere": "s3://bucket/p"}}, "one of the category's roots"),
        ({"roots": ["/a"], "in_s3": "https://bucket/p"}, "an s3://BUCKET/PREFIX URL"),
        ({"roots": ["/a"], "in_s3": {"/a": 3}}, "an s3://BUCKET/PREFIX URL"),
        ({"roots": ["/a"], "in_s3": []}, "s3://BUCKET/PREFIX, or a mapping"),
        ({"roots": ["/a"], "in_s3": "s3://bucket/p", "s3": True}, "false or absent with in_s3"),
    ],
)
def test_in_s3_mistakes_are_one_line_each(spec: dict, says: str) -> None:
    problems = _in_s3(spec)
    assert len(problems) == 1 and says in problems[0], problems

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

"""suites/decommission options: bad values are usage errors that say what to type instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--manifest=/no/such.yaml"], "no such file"),
        (["--manifest=fixtures/manifests/README.md"], "manifest"),
        (["--backup-to=http://bucket/x"], "expected s3://BUCKET/PREFIX"),
        (["--backup-to=s3://b/p", "--s3-endpoint=localhost:9000"], "expected http(s)://HOST[:PORT]"),
        (["--s3-endpoint=http://127.0.0.1:9000"], "without --backup-to"),
        (["-o", "decommission_s3_part_mib=1"], "at least 5 MiB"),
        (["--in-s3-send-to=bucket"], "expected one of location, backup-to"),
        (["--in-s3-send-to=backup-to"], "backup-to needs --backup-to"),
    ],
)
def test_bad_option_is_a_usage_error(args, message):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "suites/decommission",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 4, r.stdout + r.stderr
    assert message in r.stderr, r.stderr


def test_suite_without_a_manifest_says_how_to_pass_one(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "suites/decommission",
            "--host=local://",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--backup-dir={tmp_path}",
            f"--report-dir={tmp_path}",
            "-k",
            "inventory",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "--manifest=PATH" in r.stdout, r.stdout[-3000:]

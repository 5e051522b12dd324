"""Command-line options and ini values of suites/decommission (registered by suites/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest

#: (option, ini name, help); every option has an ini twin of the same name with underscores
OPTIONS = (
    (
        "--manifest",
        "manifest",
        "backup manifest YAML: what to stop and which files to keep (fixtures/manifests/)",
    ),
    (
        "--backup-dir",
        "backup_dir",
        "local backup directory; {host} is replaced by the target name (default backups/{host})",
    ),
    (
        "--backup-to",
        "backup_to",
        "s3://BUCKET/PREFIX for the categories marked s3; {host} is replaced by the target name",
    ),
    (
        "--s3-endpoint",
        "s3_endpoint",
        "URL of an S3-compatible endpoint (default: AWS, from boto3's configuration)",
    ),
)


#: ini-only tuning values: (name, help, default)
TUNING = (
    (
        "decommission_stall_timeout",
        "seconds without a byte before a transfer counts as cut (default 60)",
        "60",
    ),
    (
        "decommission_s3_part_mib",
        "S3 multipart part size in MiB; larger files go multipart (default 32)",
        "32",
    ),
)


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group."""
    group = parser.getgroup("gpuhost")
    for flag, ini, text in OPTIONS:
        group.addoption(flag, dest=f"decommission_{ini}", default=None, help=text)
        parser.addini(f"decommission_{ini}", text, default=None)
    for name, text, default in TUNING:
        parser.addini(name, text, default=default)


def tuning(config: pytest.Config, name: str) -> float:
    """Return an ini-only tuning value as a number (validated in validate())."""
    return float(config.getini(name))


def get(config: pytest.Config, ini: str) -> tuple[str | None, str]:
    """Return (value, where it came from) of an option: the command line wins over the ini file."""
    value = config.getoption(f"decommission_{ini}", default=None)
    if value:
        return str(value), f"--{ini.replace('_', '-')}"
    value = config.getini(f"decommission_{ini}")
    if value:
        return str(value), f"ini decommission_{ini}"
    return None, ""


def validate(config: pytest.Config) -> None:
    """Check this suite's option values; raise pytest.UsageError naming the bad value."""
    manifest, where = get(config, "manifest")
    if manifest:
        path = Path(manifest)
        if not path.is_file():
            raise pytest.UsageError(
                f"{where}={manifest}: no such file; pass a manifest such as "
                "fixtures/manifests/b200-node-backup.yaml"
            )
        from pytest_gpuhost.modules.backup import BackupError, load_manifest

        try:
            load_manifest(path)
        except BackupError as exc:
            raise pytest.UsageError(f"{where}={manifest}: {exc}") from exc
    backup_to, where = get(config, "backup_to")
    if backup_to:
        u = urlparse(backup_to)
        if u.scheme != "s3" or not u.netloc:
            raise pytest.UsageError(f"{where}={backup_to}: expected s3://BUCKET/PREFIX")
    endpoint, where = get(config, "s3_endpoint")
    if endpoint:
        u = urlparse(endpoint)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise pytest.UsageError(f"{where}={endpoint}: expected http(s)://HOST[:PORT]")
        if not backup_to:
            raise pytest.UsageError(f"{where} without --backup-to: say where to upload (s3://BUCKET/PREFIX)")
    for name, _text, _default in TUNING:
        raw = config.getini(name)
        try:
            ok = float(raw) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise pytest.UsageError(f"ini {name}={raw!r}: expected a positive number")
    if tuning(config, "decommission_s3_part_mib") < 5:
        raise pytest.UsageError("ini decommission_s3_part_mib: S3 parts are at least 5 MiB")
    backup_dir, where = get(config, "backup_dir")
    if backup_dir and Path(backup_dir.replace("{host}", "x")).is_file():
        raise pytest.UsageError(f"{where}={backup_dir}: is a file; pass a directory")

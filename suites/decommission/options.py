"""Command-line options and ini values of suites/decommission (registered by suites/conftest.py).

Each flag has an ini twin named `decommission_<name>`; the two tuning values are ini-only.
`--fix` is one flag for every suite (declared with suites/health's fixes): its decommission fix is
`scrub` (remove the credentials found, suites/decommission/credentials.py), and its ini twin
here is `decommission_fix`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from pytest_gpuhost.run.options import BadValue, Option, lines, number, read, register, seconds

__all__ = [
    "CREDENTIALS_LEFT",
    "FIXES",
    "INI_ONLY",
    "OPTIONS",
    "SEND_TO",
    "TUNING",
    "addoption",
    "fixes",
    "get",
    "tuning",
    "validate",
]


def _manifest(raw: Any) -> str:
    path = Path(str(raw).strip())
    if not path.is_file():
        raise BadValue("no such file; pass a manifest such as fixtures/manifests/b200-node-backup.yaml")
    from pytest_gpuhost.modules.backup.local import BackupError, load_manifest

    try:
        load_manifest(path)
    except BackupError as exc:
        raise BadValue(str(exc)) from None
    return str(path)


def _backup_dir(raw: Any) -> str:
    value = str(raw).strip()
    if Path(value.replace("{host}", "x")).is_file():
        raise BadValue("is a file; pass a directory")
    return value


def _s3_url(raw: Any) -> str:
    value = str(raw).strip()
    u = urlparse(value)
    if u.scheme != "s3" or not u.netloc:
        raise BadValue("expected s3://BUCKET/PREFIX")
    return value


def _endpoint(raw: Any) -> str:
    value = str(raw).strip()
    u = urlparse(value)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise BadValue("expected http(s)://HOST[:PORT]")
    return value


def _part_mib(raw: Any) -> float:
    value = number(0, 5120)(raw)
    if value < 5:
        raise BadValue("S3 parts are at least 5 MiB; give 5 to 5120")
    return value


def _send_to(raw: Any) -> str:
    value = str(raw).strip()
    if value not in SEND_TO:
        raise BadValue(f"expected one of {', '.join(SEND_TO)}")
    return value


#: Where a file under an in_s3 root goes when it is not proved there (`--in-s3-send-to`).
SEND_TO = ("location", "backup-to")
#: The fixes `--fix` takes for this suite (off by default).
FIXES = ("scrub",)
#: What credentials left on the node mean for the verdict (`--credentials-left`).
CREDENTIALS_LEFT = ("report", "unsafe")


def _fixes(raw: Any) -> list[str]:
    names = lines(raw)
    for name in names:
        if name not in FIXES:
            raise BadValue(f"unknown decommission fix; choose from {', '.join(FIXES)}", name)
    return names


def _credentials_left(raw: Any) -> str:
    value = str(raw).strip()
    if value not in CREDENTIALS_LEFT:
        raise BadValue(f"expected one of {', '.join(CREDENTIALS_LEFT)}")
    return value


#: The proofs in place, strongest first (`--in-s3-min-proof`; modules/backup/inplace.py STRENGTH).
MIN_PROOFS = ("sha256", "sha1", "md5", "crc64", "crc32")


def _min_proof(raw: Any) -> str:
    value = str(raw).strip().lower()
    if value not in MIN_PROOFS:
        raise BadValue(f"expected one of {', '.join(MIN_PROOFS)}")
    return value


def _opt(name: str, flag: str | None, help: str, **kw: Any) -> Option:
    return Option(f"decommission_{name}", flag, help, **kw)


MANIFEST = _opt(
    "manifest",
    "--manifest",
    "backup manifest YAML: what to stop and which files to keep (fixtures/manifests/)",
    parse=_manifest,
)
BACKUP_DIR = _opt(
    "backup_dir",
    "--backup-dir",
    "local backup directory; {host} is replaced by the target name (default {default})",
    parse=_backup_dir,
    default="backups/{host}",
)
BACKUP_TO = _opt(
    "backup_to",
    "--backup-to",
    "s3://BUCKET/PREFIX for the categories marked s3; {host} is replaced by the target name",
    parse=_s3_url,
)
S3_ENDPOINT = _opt(
    "s3_endpoint",
    "--s3-endpoint",
    "URL of an S3-compatible endpoint (default: AWS, from boto3's configuration)",
    parse=_endpoint,
)
IN_S3_SEND_TO = _opt(
    "in_s3_send_to",
    "--in-s3-send-to",
    "where a file under an in_s3 root goes when it is missing there, differs or cannot be verified "
    "there: location (its own key there; never over an object that cannot be verified) or "
    "backup-to (under --backup-to, like a category marked s3) (default {default})",
    parse=_send_to,
    default="location",
)

CREDENTIALS = _opt(
    "credentials_left",
    "--credentials-left",
    "what credentials left on the node mean for the verdict: report (listed, with rotate this; "
    "the node can still be safe) or unsafe (the node is NOT safe while one remains) (default {default})",
    parse=_credentials_left,
    default="report",
)
FIX = _opt(
    "fix",
    None,
    "decommission fixes, off by default (the ini twin of --fix=scrub): scrub removes the credentials "
    "found, once the node is otherwise safe to terminate, never authorized_keys",
    parse=_fixes,
    default=(),
    kind="list",
)

IN_S3_MIN_PROOF = _opt(
    "in_s3_min_proof",
    "--in-s3-min-proof",
    "the weakest proof that counts for a file already in S3: sha256, sha1, md5 (an ETag), crc64 or "
    "crc32; a weaker one is 'cannot be verified' (default {default}: a 32-bit CRC alone is not enough)",
    parse=_min_proof,
    default="crc64",
)
#: Every option with a flag (and its ini twin).
OPTIONS: tuple[Option, ...] = (
    MANIFEST,
    BACKUP_DIR,
    BACKUP_TO,
    S3_ENDPOINT,
    IN_S3_SEND_TO,
    IN_S3_MIN_PROOF,
    CREDENTIALS,
)

STALL_TIMEOUT = _opt(
    "stall_timeout",
    None,
    "seconds without a byte before a transfer counts as cut (default {default})",
    parse=seconds,
    default=60.0,
)
S3_PART_MIB = _opt(
    "s3_part_mib",
    None,
    "S3 multipart part size in MiB, at least 5 (S3's minimum); larger files go multipart (default {default})",
    parse=_part_mib,
    default=32.0,
)

#: Ini-only tuning values.
TUNING: tuple[Option, ...] = (STALL_TIMEOUT, S3_PART_MIB)
#: Ini-only: the twin of `--fix` (whose flag is declared with suites/health's fixes).
INI_ONLY: tuple[Option, ...] = (FIX,)

_BY_NAME = {opt.name: opt for opt in OPTIONS + TUNING + INI_ONLY}


def addoption(parser: pytest.Parser) -> None:
    """Register this suite's options in the gpuhost group."""
    register(parser, OPTIONS + TUNING + INI_ONLY)


def tuning(config: pytest.Config, name: str) -> float:
    """Return an ini-only tuning value (`decommission_stall_timeout`, `decommission_s3_part_mib`)."""
    return float(read(config, _BY_NAME[name])[0])


def fixes(config: pytest.Config) -> tuple[str, ...]:
    """The decommission fixes allowed: those of `--fix` on the command line, else ini `decommission_fix`."""
    cli = config.getoption("health_fix", default=None)
    if cli:
        return tuple(n for n in lines(cli) if n in FIXES)
    return tuple(read(config, FIX)[0])


def get(config: pytest.Config, name: str) -> tuple[str | None, str]:
    """Return (value, where it came from) of an option named without its prefix (`"manifest"`).

    The command line wins over the ini file; an option given nowhere has its default and "".
    """
    value, source = read(config, _BY_NAME[f"decommission_{name}"])
    return value, "" if source.origin == "default" else str(source)


def validate(config: pytest.Config) -> None:
    """Check this suite's option values; raise pytest.UsageError naming the bad value."""
    for opt in OPTIONS + TUNING + INI_ONLY:
        read(config, opt)
    endpoint, source = read(config, S3_ENDPOINT)
    if endpoint and not read(config, BACKUP_TO)[0]:
        raise source.error("without --backup-to: say where to upload (s3://BUCKET/PREFIX)")
    send_to, source = read(config, IN_S3_SEND_TO)
    if send_to == "backup-to" and not read(config, BACKUP_TO)[0]:
        raise source.error("backup-to needs --backup-to=s3://BUCKET/PREFIX")

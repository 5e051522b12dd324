"""The options of suites/decommission, declared once: `DecommissionOptions` (run/suite.py).

Each flag has an ini twin named `decommission_<name>`; the two tuning values are ini-only. Each
default is written in its field only. What the options imply for the run (the manifest loaded,
each target's backup directory and S3 URL, the fixes allowed) is settled once at configure, in
`settle`, and read from the settled options by the fixture and the steps.
`--fix` is one flag for every suite (declared with suites/health's fixes): its decommission fix is
`scrub` (remove the credentials found, suites/decommission/credentials.py), and its ini twin
here is `decommission_fix`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from pytest_gpuhost.modules.backup.destination import DestinationError, per_target
from pytest_gpuhost.modules.backup.local import BackupError, Manifest, load_manifest
from pytest_gpuhost.run.options import BadValue, Option, lines, number, seconds
from pytest_gpuhost.run.suite import Configured, option, table_of

__all__ = [
    "CREDENTIALS_LEFT",
    "FIXES",
    "INI_ONLY",
    "OPTIONS",
    "SEND_TO",
    "TUNING",
    "DecommissionOptions",
    "settle",
]


def _manifest(raw: Any) -> str:
    path = Path(str(raw).strip())
    if not path.is_file():
        raise BadValue("no such file; pass a manifest such as fixtures/manifests/b200-node-backup.yaml")
    return str(path)  # loaded once, by `settle`


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


@dataclass
class DecommissionOptions:
    """The suite's settings: the `option()` fields as given, the others settled at configure."""

    manifest: str | None = option(
        flag="--manifest",
        help="backup manifest YAML: what to stop and which files to keep (fixtures/manifests/)",
        parse=_manifest,
    )
    backup_dir: str = option(
        "backups/{host}",
        flag="--backup-dir",
        help="local backup directory; {host} is replaced by the target name (default {default})",
        parse=_backup_dir,
    )
    backup_to: str | None = option(
        flag="--backup-to",
        help="s3://BUCKET/PREFIX for the categories marked s3; {host} is replaced by the target name",
        parse=_s3_url,
    )
    s3_endpoint: str | None = option(
        flag="--s3-endpoint",
        help="URL of an S3-compatible endpoint (default: AWS, from boto3's configuration)",
        parse=_endpoint,
    )
    in_s3_send_to: str = option(
        "location",
        flag="--in-s3-send-to",
        help="where a file under an in_s3 root goes when it is missing there, differs or cannot be verified "
        "there: location (its own key there; never over an object that cannot be verified) or "
        "backup-to (under --backup-to, like a category marked s3) (default {default})",
        parse=_send_to,
    )
    in_s3_min_proof: str = option(
        "crc64",
        flag="--in-s3-min-proof",
        help="the weakest proof that counts for a file already in S3: sha256, sha1, md5 (an ETag), crc64 or "
        "crc32; a weaker one is 'cannot be verified' (default {default}: a 32-bit CRC alone is not enough)",
        parse=_min_proof,
    )
    credentials_left: str = option(
        "report",
        flag="--credentials-left",
        help="what credentials left on the node mean for the verdict: report (listed, with rotate this; "
        "the node can still be safe) or unsafe (the node is NOT safe while one remains) (default {default})",
        parse=_credentials_left,
    )
    stall_timeout: float = option(
        60.0,
        flag=None,
        help="seconds without a byte before a transfer counts as cut (default {default})",
        parse=seconds,
    )
    s3_part_mib: float = option(
        32.0,
        flag=None,
        help="S3 multipart part size in MiB, at least 5 (S3's minimum); larger files go multipart "
        "(default {default})",
        parse=_part_mib,
    )
    fix: tuple[str, ...] = option(
        (),
        flag=None,
        kind="list",
        help="decommission fixes, off by default (the ini twin of --fix=scrub): scrub removes the "
        "credentials found, once the node is otherwise safe to terminate, never authorized_keys",
        parse=_fixes,
    )
    # settled once at configure (`settle`)
    fixes: tuple[str, ...] = ()  # those of --fix on the command line, else ini decommission_fix
    loaded: Manifest | None = None  # the manifest, loaded
    dirs: dict[str, str] = field(default_factory=dict)  # target -> its backup directory
    urls: dict[str, str] = field(default_factory=dict)  # target -> its --backup-to URL

    def destinations(self, target: str) -> tuple[str, str | None]:
        """This target's backup directory and S3 URL (one place per target, checked at configure)."""
        if target not in self.dirs:  # a target the configure did not list: computed alone
            dirs, urls = _places(self, [target])
            return dirs[target], urls.get(target)
        return self.dirs[target], self.urls.get(target)


_TABLE = table_of(DecommissionOptions, "decommission")
_BY_NAME = {opt.name: opt for opt in _TABLE}
STALL_TIMEOUT = _BY_NAME["decommission_stall_timeout"]
S3_PART_MIB = _BY_NAME["decommission_s3_part_mib"]
#: Every option with a flag (and its ini twin).
OPTIONS: tuple[Option, ...] = tuple(o for o in _TABLE if o.flag is not None)
#: Ini-only tuning values.
TUNING: tuple[Option, ...] = (STALL_TIMEOUT, S3_PART_MIB)
#: Ini-only: the twin of `--fix` (whose flag is declared with suites/health's fixes).
INI_ONLY: tuple[Option, ...] = (_BY_NAME["decommission_fix"],)


def _places(opts: DecommissionOptions, names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    dirs = per_target(opts.backup_dir, names, option="--backup-dir")
    urls = per_target(opts.backup_to, names, option="--backup-to") if opts.backup_to else {}
    return dirs, urls


def settle(ctx: Configured[DecommissionOptions]) -> DecommissionOptions:
    """Check the options together; load the manifest, place each target's backups, read the fixes.

    Destinations that several targets would share are refused here (modules/backup/destination.py).
    """
    opts, src = ctx.options, ctx.sources
    if opts.s3_endpoint and not opts.backup_to:
        raise src["s3_endpoint"].error("without --backup-to: say where to upload (s3://BUCKET/PREFIX)")
    if opts.in_s3_send_to == "backup-to" and not opts.backup_to:
        raise src["in_s3_send_to"].error("backup-to needs --backup-to=s3://BUCKET/PREFIX")
    loaded = None
    if opts.manifest:
        try:
            loaded = load_manifest(opts.manifest)
        except BackupError as exc:
            raise src["manifest"].error(str(exc)) from None
    cli = ctx.config.getoption("health_fix", default=None)
    fixes = tuple(n for n in lines(cli) if n in FIXES) if cli else tuple(opts.fix)
    try:
        dirs, urls = _places(opts, ctx.targets) if ctx.targets else ({}, {})
    except DestinationError as exc:
        raise pytest.UsageError(f"gpuhost: {exc}") from None
    return replace(opts, loaded=loaded, fixes=fixes, dirs=dirs, urls=urls)

"""Files the node's own pipeline already put in S3 (manifest `in_s3`): what step 5 sends back.

A file under an in_s3 root that is missing there or differs was copied to the local backup by
step 4 (verified on arrival like every other file). With `--in-s3-send-to=location` (the
default) step 5 sends it to its own key under the root's location, with its SHA-256 as the S3
checksum, and proves it there again; a file that cannot be verified in place is never
overwritten: it stays an item of the verdict, named with what would verify it. With
`--in-s3-send-to=backup-to` every file not proved in place (missing, different, or not
verifiable there) goes under --backup-to instead, as a file of a category marked s3 would, and
is proved there by the checksum this run sent; the object in place is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytest_gpuhost.modules.backup.inplace import InPlaceResult, Proof
from pytest_gpuhost.modules.backup.local import Backup
from pytest_gpuhost.modules.backup.ownership import OWNER_META
from pytest_gpuhost.modules.backup.s3 import S3Item, item_for

__all__ = ["not_proved", "not_ours", "sends", "to_backup_to"]


def sends(
    result: InPlaceResult | None, backup: Backup
) -> tuple[dict[str, list[S3Item]], list[tuple[str, str]]]:
    """Return ({in_s3 URL: items to send there}, (path, why) of those not in the local backup yet)."""
    out: dict[str, list[S3Item]] = {}
    unverified: list[tuple[str, str]] = []
    for p in result.proofs if result is not None else ():
        if not p.send:
            continue
        rec = backup.state.items.get(p.file.key)
        if rec is None or rec.get("s") is None or "sha256" not in rec:
            unverified.append((p.file.display, f"{p.how}; not in the local backup yet"))
            continue
        key = p.url.removeprefix("s3://").partition("/")[2]
        out.setdefault(p.location, []).append(S3Item(p.file.key, rec["sha256"], int(rec["s"]), key=key))
    return out, unverified


def not_proved(result: InPlaceResult | None) -> Sequence[Proof]:
    """The files under in_s3 roots that are not proved where they are."""
    return [p for p in result.proofs if not p.ok] if result is not None else []


def to_backup_to(result: InPlaceResult | None, backup: Backup) -> tuple[list[S3Item], list[tuple[str, str]]]:
    """Return (the --backup-to items of the files not proved in place, (path, why) of those not in
    the local backup yet). The items have --backup-to's own layout (PREFIX/<rel>)."""
    items: list[S3Item] = []
    unverified: list[tuple[str, str]] = []
    for p in not_proved(result):
        rec = backup.state.items.get(p.file.key)
        if rec is None or rec.get("s") is None or "sha256" not in rec:
            unverified.append((p.file.display, f"{p.how}; not in the local backup yet"))
            continue
        items.append(item_for(p.file, rec))
    return items, unverified


def not_ours(client: Any, bucket: str, items: Sequence[S3Item], tag: str) -> tuple[list[S3Item], list[str]]:
    """Split the items to send to an in_s3 location into (those this node may write, the keys it
    may not). An object that is absent may be written, and one this node's runs wrote (its
    gpuhost-owner metadata is this node's tag); any other object there (the pipeline's, another
    node's) is never overwritten, whatever it holds: its file stays an item of the verdict, and
    --in-s3-send-to=backup-to sends it under --backup-to instead."""
    mine: list[S3Item] = []
    refused: list[str] = []
    for item in items:
        key = item.key or ""
        try:
            head = client.head_object(Bucket=bucket, Key=key)
        except Exception as exc:  # noqa: BLE001 - absent (404) may be written; else not proved ours
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchKey", "NotFound"):
                mine.append(item)
            else:
                refused.append(key)
            continue
        if (head.get("Metadata") or {}).get(OWNER_META) == tag:
            mine.append(item)
        else:
            refused.append(key)
    return mine, refused

"""Every root accounted for: what each root the operator named gave, and what is wrong with it.

The walk reports each root (probe_backup_walk.py): what it is and how many entries it gave. A
root that is a symbolic link backs up the link, not the data it points to; a root that is gone
or yields no file backs up nothing. Each of these was a silent pass ("safe", zero files of that
root backed up). Here each is a problem of the verdict, one line with what answers it: the
category's `follow_root_links: true` (walk where the link points) or `expected_empty: true` (the
operator says nothing is there). Pure functions of the manifest and the listing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pytest_gpuhost.modules.backup.listing import Listing
from pytest_gpuhost.modules.backup.manifest import Manifest

__all__ = ["root_problems", "root_rows"]


def root_problems(manifest: Manifest, listing: Listing) -> list[str]:
    """One line per root the operator must answer: a link not followed, missing, or empty."""
    cats = {c.name: c for c in manifest.categories}
    out: list[str] = []
    for r in listing.roots:
        cat = cats.get(r["category"])
        if cat is None:
            continue
        where = f"root {r['root']} of category {r['category']}"
        if r["kind"] == "link":
            out.append(
                f"{where} is a symbolic link (to {r.get('to', '?')}): only the link is backed up, not "
                "what it points to; set follow_root_links: true for the category, or name the target"
            )
        elif r["kind"] in ("missing", "error") and not cat.expected_empty:
            what = "does not exist" if r["kind"] == "missing" else "cannot be listed"
            out.append(
                f"{where} {what}: nothing of it is backed up; fix the path, or set expected_empty: true"
            )
        elif r["n"] == 0 and r["e"] == 0 and r["kind"] in ("dir", "file") and not cat.expected_empty:
            left = int(r["k"]) + int(r.get("x", 0)) + int(r.get("xd", 0))
            rules = f" ({left} left out by the category's rules)" if left else ""
            out.append(
                f"{where} yields no file{rules}: check its include/exclude, or set expected_empty: true "
                "where nothing is expected there"
            )
    return out


def root_rows(
    manifest: Manifest,
    listing: Listing,
    verified: Mapping[str, Iterable[str]],
    skipped_by_rule: Iterable[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Per root: files found, verified where ({destination: count}), left out by which rule.

    verified maps a destination's name to the keys (RemoteFile.key) verified there.
    """
    roots = list(listing.roots)
    sets = {name: set(keys) for name, keys in verified.items()}
    rows = []
    for r in roots:
        anchor = (r.get("real") or r["root"]).rstrip("/")
        mine = [
            f
            for f in listing.files
            if f.category == r["category"]
            and (f.display == anchor or f.display.startswith(anchor + "/") or anchor == "")
        ]
        rules: dict[str, int] = {}
        for s in skipped_by_rule:
            if s.get("category") == r["category"] and (
                str(s.get("path")) == anchor or str(s.get("path", "")).startswith(anchor + "/")
            ):
                why = str(s.get("why") or "left out")
                rules[why] = rules.get(why, 0) + 1
        cat = next((c for c in manifest.categories if c.name == r["category"]), None)
        globs = ""
        if cat is not None:
            globs = (
                "include "
                + " ".join(cat.include)
                + (" exclude " + " ".join(cat.exclude) if cat.exclude else "")
            )
        if r.get("x"):
            rules[f"the globs ({globs})"] = int(r["x"])
        if r.get("xd"):
            rules[f"directories not entered, by the globs ({globs})"] = int(r["xd"])
        rows.append(
            {
                "category": r["category"],
                "root": r["root"],
                "kind": r["kind"]
                + (f" to {r['to']}" if r.get("to") else "")
                + (" (followed)" if r.get("real") else ""),
                "found": len(mine),
                "verified": {name: sum(1 for f in mine if f.key in keys) for name, keys in sets.items()},
                "left_out": rules,
                "not_listed": int(r.get("e", 0)),
            }
        )
    return rows

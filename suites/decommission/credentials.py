"""The credentials step of suites/decommission: what keys are left on the node, and (asked) their removal.

Runs after the data steps and before NOTES.md and the verdict. It reads the node in one round trip
(pytest_gpuhost/modules/credentials.py says where and how), and lists each credential as its
kind, place and fingerprint, never its value, with "rotate this" where it outlives the node. The
environments of the processes the run stopped were read by the inventory, before the stop.

`--fix=scrub` (off by default) removes the files and lines found, and only once every step before
this one passed or was fixed: a node whose data is not safe yet keeps everything, its credentials
included (a failed backup may need them to be run again). Each removal is journaled in the
backup directory's `.gpuhost/scrubbed.jsonl` before it is made. `authorized_keys` is never
touched: the run logs in with one of its keys.

`--credentials-left` decides what the verdict makes of credentials left: `report` (the default:
listed, counted in the verdict, the node can still be safe) or `unsafe` (the node is not safe
while one remains). The default and why: docs/decommission-credentials.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.modules import credentials
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from .node import Decommission

__all__ = ["BEFORE", "scrub_actions", "scrub_refusal", "scrubbed", "step_credentials_left"]

#: The steps that must have passed (or been fixed) before anything is scrubbed.
BEFORE = ("inventory", "servers stopped", "gpus idle", "artifacts backed up", "data in s3")


def scrub_refusal(outcomes: Mapping[str, str]) -> str | None:
    """Why the node is not otherwise safe to scrub (a step before this one did not hold), or None. Pure."""
    bad = []
    for step in BEFORE:
        outcome = outcomes.get(step)
        if step == "data in s3" and outcome == "skipped":
            continue
        if outcome not in ("passed", "fixed"):
            bad.append(f"{step!r} {outcome or 'not run'}")
    if bad:
        return "the node is not otherwise safe to terminate (step " + ", ".join(bad) + "); nothing removed"
    return None


def _roots(run: Decommission) -> list[str]:
    return sorted({r for c in run.manifest.categories for r in c.roots})


def _headline(scan: credentials.Scan) -> str:
    left = scan.remaining
    rotate = sum(f.rotate for f in left)
    places = len({f.path for f in left})
    return f"{len(left)} credentials left on the node in {places} places ({rotate} to rotate)"


def _tell(run: Decommission, scan: credentials.Scan) -> None:
    """List the findings on the terminal: kind, place, fingerprint, never a value."""
    if run.say is None:
        return
    found = [*scan.remaining, *run.environ_findings]
    if not found:
        return
    run.say(f"credentials: {_headline(scan)}; {len(run.environ_findings)} in stopped processes' environments")
    for f in found[:50]:
        run.say(f"  - {f.describe()}")
    if len(found) > 50:
        run.say(f"  ... and {len(found) - 50} more (NOTES.md lists them all)")


def scrub_actions(run: Decommission) -> list[Action]:
    """What --fix=scrub would do to each file the credentials step found."""
    if run.credentials is None:
        return []
    actions = []
    for item in credentials.scrub_items(run.credentials):
        kinds = sorted({f.what for f in run.credentials.findings if f.path == item["path"]})
        if item["action"] == "remove":
            desc = f"remove {item['path']} ({', '.join(kinds)})"
            how = "unlinkat, no link followed, only if its SHA-256 is still the one read"
        else:
            desc = f"drop {len(item['lines'])} lines from {item['path']} ({', '.join(kinds)})"
            how = "rewrite without those lines (temp name, fsync, rename; mode and owner kept), only if unchanged"
        actions.append(Action(desc, how))
    return actions


def _env_line(run: Decommission) -> str:
    if not run.environ_findings:
        return ""
    return (
        f"; {len(run.environ_findings)} in the environments of the processes stopped "
        "(gone with them; rotate them)"
    )


def step_credentials_left(run: Decommission) -> Step:
    """Step 6: no credential is left on the node (or they are listed, and removed with --fix=scrub)."""
    scrub = "scrub" in run.fixes

    def look() -> tuple[credentials.Scan, dict[str, object]]:
        scan = credentials.read(run.conn, _roots(run))
        run.credentials = scan
        state: dict[str, object] = dict(scan.summary())
        state["environment_of_stopped_processes"] = [f.record() for f in run.environ_findings]
        if run.environ_error:
            state["environment_error"] = run.environ_error
        run._measure("credentials scan", round(scan.seconds, 3), "s")
        return scan, state

    def check() -> Check:
        scan, state = look()
        _tell(run, scan)
        left = scan.remaining
        if not left:
            return Check(
                True,
                f"no credential left in {scan.files_read} files read under {len(scan.homes)} homes and the "
                f"manifest's roots{_env_line(run)}",
                state,
            )
        head = "; ".join(f.describe() for f in left[:12]) + (
            f"; ... and {len(left) - 12} more" if len(left) > 12 else ""
        )
        summary = f"{_headline(scan)}: {head}{_env_line(run)}"
        if scrub and credentials.scrub_items(scan):
            return Check(False, summary, state)
        if run.credentials_left == "unsafe":
            return Check(False, summary + " (--credentials-left=unsafe; --fix=scrub removes them)", state)
        return Check(True, summary + " (left in place: --fix=scrub removes them)", state)

    def plan(before: Check) -> list[Action]:
        return scrub_actions(run) if scrub else []

    def fix(actions: list[Action], before: Check) -> None:
        if not scrub:
            raise ProcedureError(
                f"{_headline(run.credentials or credentials.Scan())} and --credentials-left=unsafe: rotate "
                "them, then remove them (--fix=scrub) or accept them (--credentials-left=report)"
            )
        refusal = scrub_refusal(run.outcomes)
        if refusal is not None:
            raise ProcedureError(f"not scrubbed: {refusal}")
        assert run.credentials is not None  # read by the check
        items = credentials.scrub_items(run.credentials)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with open(run.meta / "scrubbed.jsonl", "a") as f:  # journaled before the node is touched
            for item in items:
                found = [x.record() for x in run.credentials.findings if x.path == item["path"]]
                f.write(
                    json.dumps({"t": stamp, "path": item["path"], "action": item["action"], "found": found})
                    + "\n"
                )
        run.event(f"scrubbing {len(items)} files of credentials")
        results = credentials.scrub(run.conn, items, _roots(run))
        done = [r for r in results if r.get("status") in ("removed", "rewritten", "gone")]
        run._state("scrub", results)
        run.event(f"scrubbed: {len(done)} of {len(items)} files")
        roots = _roots(run)
        if any(
            r.get("status") == "removed" and credentials.under(str(r.get("path")), roots) for r in results
        ):
            # files under the manifest's roots are gone from the node (their copies stay in the
            # backup): NOTES.md and the verdict count what the node holds now
            _, run._listing = run.walk_local()
            run.backup.write_checksums(run._listing)  # as a rerun's step 4 would write it
        bad = [r for r in results if r not in done]
        if bad:
            raise ProcedureError(
                "not scrubbed: "
                + "; ".join(f"{r.get('path')}: {r.get('status')} ({r.get('why', '')})" for r in bad[:10])
            )

    def verify() -> Check:
        scan, state = look()
        left = [f for f in scan.remaining if f.action != "keep"]
        kept = [f for f in scan.remaining if f.action == "keep"]
        if left:
            return Check(
                False,
                f"{_headline(scan)} after the scrub: " + "; ".join(f.describe() for f in left[:12]),
                state,
            )
        tail = f"; {len(kept)} kept: " + "; ".join(f.describe() for f in kept[:12]) if kept else ""
        return Check(
            True, f"credentials removed from the node (rotate them all the same){tail}{_env_line(run)}", state
        )

    return run.step("credentials left", check, plan, fix, verify)


def scrubbed(run: Decommission) -> list[dict[str, Any]]:
    """Every removal a run journaled (path, action, what was found there: no value)."""
    path = run.meta / "scrubbed.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

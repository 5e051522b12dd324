"""Steps 7-8 of suites/decommission: notes saved, and the verdict (safe to terminate)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence

from pytest_gpuhost.exec.s3io import s3_problem
from pytest_gpuhost.modules import credentials
from pytest_gpuhost.modules.backup.inplace import STRENGTH
from pytest_gpuhost.modules.backup.local import Listing
from pytest_gpuhost.modules.backup.roots import root_problems, root_rows
from pytest_gpuhost.modules.process import ProcessTable
from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from .credentials import scrubbed
from .node import Decommission, mb

__all__ = [
    "STEPS",
    "VERDICT",
    "answer_line",
    "category_table",
    "grouped",
    "cell",
    "credentials_notes",
    "in_place_notes",
    "md",
    "notes_after_failure",
    "notes_body",
    "notes_current",
    "put_verdict",
    "step_notes_saved",
    "step_safe_to_terminate",
    "verdict",
    "write_notes",
]

STEPS = (
    "inventory",
    "servers stopped",
    "gpus idle",
    "artifacts backed up",
    "data in s3",
    "credentials left",
    "notes saved",
)


def md(text: object) -> str:
    """Return a string for one line of NOTES.md (or of the verdict): secrets hidden, nothing obeyed.

    File names, host facts and command lines come from the node. Each goes through `redact` (an
    AWS key id in a file name, a presigned URL's `X-Amz-Signature`, `password=...`), then
    `printable` (ESC and `\\r` shown as escapes), and a newline is shown as `\\n` too: no
    node-supplied string can start a line of its own (a forged `## Where it went`).
    """
    return printable(redact(str(text))).replace("\n", "\\n")


def cell(text: object) -> str:
    """`md` for a cell of a Markdown table: a `|` cannot open another column."""
    return md(text).replace("|", "\\|")


def verdict(
    outcomes: Mapping[str, str],
    *,
    running: Sequence[str],
    local_missing: Sequence[tuple[str, str]],
    s3_categories: Sequence[str] = (),
    s3_configured: bool = True,
    s3_missing: Sequence[tuple[str, str]] = (),
    open_uploads: Sequence[str] = (),
    in_place_missing: Sequence[tuple[str, str]] = (),
    s3_unreadable: Sequence[str] = (),
    refused: Sequence[str] = (),
    credentials_left: int = 0,
    credentials_block: bool = False,
) -> list[str]:
    """Return why the node is not safe to terminate; an empty list is the only "safe".

    Pure: the step reads the node, the backup and the bucket, then asks this. Safe means every
    step passed or was fixed (the S3 step may be skipped when no category is marked s3), no
    process the manifest selects still runs, and every in-scope path (`(path, why)` items, as
    `Backup.verify` and the S3 verify return them) is verified in every destination; a file
    under an in_s3 root counts only once proved against its object there. An S3 destination
    the verdict could not read (`s3_unreadable`: one line each, "--backup-to URL: why") proves
    nothing of what is there. Credentials left on the node (`credentials_left`, a count) make
    it not safe only when `credentials_block` (`--credentials-left=unsafe`).
    """
    problems: list[str] = [f"refused before any change: {md(p)}" for p in refused]
    for step in STEPS:
        outcome = outcomes.get(step)
        if step == "data in s3" and outcome == "skipped":
            continue
        if outcome not in ("passed", "fixed"):
            problems.append(f"step {step!r}: {outcome or 'not run'}")
    problems += [f"still running: {md(p)}" for p in running]
    problems += [f"not in the local backup: {md(p)} ({md(why)})" for p, why in local_missing]
    if s3_categories and not s3_configured:
        problems.append(f"categories {', '.join(s3_categories)} marked s3 but no --backup-to")
    problems += [f"S3 not readable: {md(line)}" for line in s3_unreadable]
    problems += [f"not in S3: {md(p)} ({md(why)})" for p, why in s3_missing]
    problems += [f"open multipart upload: {md(k)}" for k in open_uploads]
    problems += [f"not proved where it already is in S3: {md(p)} ({md(why)})" for p, why in in_place_missing]
    if credentials_left and credentials_block:
        problems.append(
            f"{credentials_left} credentials remain on the node (--credentials-left=unsafe): rotate them; "
            "--fix=scrub removes them"
        )
    return problems


def notes_body(run: Decommission, problems: Sequence[str] = ()) -> str:
    """Return NOTES.md without its timeline: what the node was, what ran, what was kept where.

    `problems` are the verdict's, when NOTES.md is written by the verdict after a failed step
    (`notes_after_failure`): they open the file, under "Not safe to terminate". Every string
    from the node goes through `md` (one line, secrets hidden, control characters shown).
    """
    inv = run.inventory or run.take_inventory()
    listing: Listing = getattr(run, "_listing", None) or run.backup.walk()
    lines = [f"# Decommission notes: {md(inv.get('hostname'))} ({md(run.target)})", ""]
    if problems:
        lines += [f"## Not safe to terminate ({len(problems)} problems)", ""]
        lines += [f"- {md(p)}" for p in problems[:200]]
        if len(problems) > 200:
            lines.append(f"- ... and {len(problems) - 200} more (see the safe-to-terminate step)")
        lines.append("")
    lines += [
        "## The node",
        "",
        f"- hostname: {md(inv.get('hostname'))}",
        f"- kernel: {md(inv.get('kernel'))}",
        f"- manifest: {md(run.manifest.name)} ({md(run.manifest.path)})",
        "",
    ]
    if inv.get("gpus"):
        lines += ["| GPU | bus id | model | UUID | memory |", "|---|---|---|---|---|"]
        lines += [
            f"| {cell(g['index'])} | {cell(g['bus_id'])} | {cell(g['name'])} | {cell(g['uuid'])} "
            f"| {cell(g['memory_total_mib'])} MiB |"
            for g in inv["gpus"]
        ]
        lines.append("")
    lines += ["## What ran", ""]
    seen = set()
    for p in run.stopped():
        key = (p["pid"], p["starttime"])
        if key in seen:
            continue
        seen.add(key)
        gpus = f" on {md(', '.join(p['gpus']))}" if p.get("gpus") else ""
        lines.append(f"- PID {md(p['pid'])} ({md(p['why'])}){gpus}: `{md(p['cmdline'])}`")
    if not seen:
        lines.append("- nothing selected by the manifest was running")
    lines += [
        "",
        "## What was backed up",
        "",
        "| category | files | links | bytes | allocated on the node | destinations |",
        "|---|---|---|---|---|---|",
    ]
    totals = (run._node_listing or listing).totals()
    for cat in run.manifest.categories:
        t = totals.get(cat.name, {"files": 0, "links": 0, "bytes": 0, "allocated": 0})
        where = f"{run.dest / cat.name}"
        if cat.s3 and run.s3 is not None:
            where += f", {run.s3.url}/{cat.name}"
        for root, url in cat.in_s3:
            where += f", {root} already in {url}"
        lines.append(
            f"| {cell(cat.name)} | {t['files']} | {t['links']} | {t['bytes']} | {t.get('allocated', 0)} "
            f"| {cell(where)} |"
        )
    missing = run.backup.verify(listing)
    if missing:
        # The verdict fails on each of these; NOTES.md names them too (nothing dropped silently).
        lines += ["", f"## Not verified ({len(missing)})", ""]
        lines += [f"- `{md(p)}`: {md(why)}" for p, why in missing[:200]]
        if len(missing) > 200:
            lines.append(f"- ... and {len(missing) - 200} more (see the safe-to-terminate step)")
    lines += root_notes(run, run._node_listing or listing, missing)
    lines += in_place_notes(run)
    lines += credentials_notes(run)
    sums = run.dest / "SHA256SUMS"
    digest = hashlib.sha256(sums.read_bytes()).hexdigest() if sums.exists() else "(not written)"
    lines += [
        "",
        f"- checksums: `SHA256SUMS` (SHA-256 computed on the node, checked on arrival; "
        f"`sha256sum -c SHA256SUMS` in {md(run.dest)}); its own SHA-256: {digest}",
    ]
    if listing.skipped:
        lines.append(f"- left out by the manifest's rules: {len(listing.skipped)} files")
        lines += [f"  - {md(s['category'])}: {md(s['path'])} ({md(s['why'])})" for s in listing.skipped[:50]]
    lines += ["", "## Where it went", "", f"- local: {md(run.dest.resolve())}"]
    if run.s3 is not None:
        lines.append(
            f"- S3: {md(run.s3.url)} (endpoint {md(run.endpoint or 'AWS default')}), categories "
            f"{md(', '.join(run.s3_cats()) or 'none')}"
        )
    return "\n".join(lines) + "\n"


def credentials_notes(run: Decommission) -> list[str]:
    """NOTES.md lines on the credentials: those left on the node, removed, and in stopped processes.

    Each is its kind, place and fingerprint, never its value (suites/decommission/credentials.py).
    """
    scan = run.credentials
    out: list[str] = []
    if scan is not None:
        left = scan.remaining
        out += ["", f"## Credentials left on the node ({len(left)})", ""]
        out += [f"- {md(f.describe())}" for f in left[:200]] or ["- none found"]
        if len(left) > 200:
            out.append(f"- ... and {len(left) - 200} more (see the credentials step)")
        if scan.login:
            out.append(
                f"- never touched: {md(', '.join(scan.login))} (the run logs in with one of them; the provider's "
                "wipe removes them)"
            )
    removed = scrubbed(run)
    if removed:
        out += ["", f"## Credentials removed from the node ({len(removed)} files)", ""]
        for r in removed[:200]:
            kinds = ", ".join(
                sorted(
                    {
                        credentials.fingerprinted(f.get("kind"), f.get("fingerprint"))
                        for f in r.get("found", [])
                    }
                )
            )
            out.append(f"- {md(r.get('action'))} {md(r.get('path'))}: {md(kinds)}; rotate them")
        out.append(
            "- a deleted file's blocks are not erased (an SSD remaps them, an overlay keeps the lower "
            "layer): rotation is the protection"
        )
    if run.environ_findings:
        out += [
            "",
            f"## Credentials in the environments of the processes stopped ({len(run.environ_findings)})",
            "",
        ]
        out += [f"- {md(f.describe())}" for f in run.environ_findings[:200]]
    return out


def root_notes(run: Decommission, listing: Listing, missing: Sequence[tuple[str, str]]) -> list[str]:
    """NOTES.md's table of every root: what it is, files found, verified where, left out by what."""
    if not listing.roots:
        return []
    bad = {p for p, _ in missing}
    items = run.backup.state.items
    local_ok = [f.key for f in listing.files if f.key in items and f.display not in bad]
    verified: dict[str, list[str]] = {"local backup": local_ok}
    if run._in_place is not None and run._in_place.proofs:
        verified["in place in S3"] = list(run._in_place.proved)
    rows = root_rows(run.manifest, listing, verified, listing.skipped)
    out = ["", "## Every root", "", "| category | root | what it is | files found | verified | left out |"]
    out.append("|---|---|---|---|---|---|")
    for r in rows:
        where = ", ".join(f"{n} in {md(k)}" for k, n in r["verified"].items() if n) or "none"
        left = ", ".join(f"{n} by {md(why)}" for why, n in sorted(r["left_out"].items()))
        if r["not_listed"]:
            left = (left + ", " if left else "") + f"{r['not_listed']} not listed (see below)"
        out.append(
            f"| {cell(r['category'])} | {cell(r['root'])} | {cell(r['kind'])} | {r['found']} | {cell(where)} "
            f"| {cell(left or 'none')} |"
        )
    problems = root_problems(run.manifest, listing)
    if problems:
        out += ["", f"### Roots to answer ({len(problems)})", ""]
        out += [f"- {md(p)}" for p in problems]
    return out


def in_place_notes(run: Decommission) -> list[str]:
    """NOTES.md lines on the files under in_s3 roots: how each was proved, or why it was not."""
    r = run._in_place
    if r is None or not r.proofs:
        return []
    out = ["", f"## Verified where it already was in S3 ({len(r.proved)} of {len(r.proofs)})", ""]
    by_how: dict[tuple[int, str, str], int] = {}
    for p in r.proofs:
        if p.ok:
            how = p.how.removesuffix(" matches the node's file")
            k = (-STRENGTH.get(p.strength, 0), p.strength or "?", how)
            by_how[k] = by_how.get(k, 0) + 1
    out.append(
        f"- proofs by strength (sha256 > sha1 > md5 > crc64 > crc32); the least this run accepts: "
        f"{md(run.in_s3_min_proof)} (--in-s3-min-proof)"
    )
    out += [f"- {n} files by {md(how)} (strength {md(st)})" for (_, st, how), n in sorted(by_how.items())]
    proved_bytes = sum(p.file.size for p in r.proofs if p.ok)
    out.append(f"- {proved_bytes} bytes proved from the node's own reads of them, none copied off the node")
    bad = [p for p in r.proofs if not p.ok]
    if bad:
        elsewhere = f"; sent under --backup-to {run.s3.url}" if run.in_s3_to_backup_to() and run.s3 else ""
        out += ["", f"### Not proved there ({len(bad)})", ""]
        out += [f"- `{md(p.file.display)}` ({md(p.url)}): {md(p.how)}{md(elsewhere)}" for p in bad[:200]]
    shown = [p for p in r.proofs if p.ok][:200]
    out += ["", "### How each file was proved", ""]
    out += [f"- `{md(p.file.display)}`: {md(p.strength or '?')}: {md(p.how)}" for p in shown]
    if len(r.proved) > len(shown):
        out.append(f"- ... and {len(r.proved) - len(shown)} more (see the evidence of step 5)")
    return out


#: How NOTES.md's verdict line starts: step 8 writes it under the title, step 7 compares without it.
VERDICT = "**Verdict:"


def grouped(problems: Sequence[str]) -> list[str]:
    """The verdict's problems for a person: each step's line, then each kind counted with an example.

    A node not yet emptied has a line per running process and per file; thousands of them say
    less than "21 still running (e.g. PID 75 ...)".
    """
    steps = [p for p in problems if p.startswith(("step ", "refused "))]
    kinds: dict[str, list[str]] = {}
    for p in problems:
        if p in steps:
            continue
        kind, _, rest = p.partition(": ")
        kinds.setdefault(kind, []).append(rest)
    out = list(steps)
    for kind, items in kinds.items():
        out.append(f"{kind}: {items[0]}" if len(items) == 1 else f"{len(items):,} {kind}, e.g. {items[0]}")
    return out


def answer_line(run: Decommission, full: Listing, problems: Sequence[str]) -> str:
    """The verdict in words: "SAFE TO TERMINATE: 2,010 files, 145.7 MB verified in DIR; ..." or "NOT SAFE: ..."."""
    if problems and run.check_only:
        would = [s for s in STEPS if run.outcomes.get(s) == "would fix"]
        return f"NOT SAFE YET (check-only): {len(would)} steps would run: {', '.join(would)}"
    if problems:
        return f"NOT SAFE: {len(problems)} problem{'s' if len(problems) != 1 else ''}"
    size = sum(f.size for f in full.files)
    parts = [f"{len(full.files):,} files, {mb(size)} verified in {md(run.dest)}"]
    if run.s3 is not None and run.s3_cats():
        parts.append(f"categories {md(', '.join(run.s3_cats()))} also in {md(run.s3.url)}")
    r = run._in_place
    if r is not None and r.proved:
        urls = sorted({p.url.rsplit("/", 1)[0] for p in r.proofs if p.ok})
        where = md(urls[0]) if len(urls) == 1 else f"{len(urls)} S3 locations"
        parts.append(f"{len(r.proved):,} objects proved in place in {where}")
    return "SAFE TO TERMINATE: " + "; ".join(parts)


def category_table(run: Decommission, full: Listing) -> list[list[str]]:
    """The decommission's categories for the report's banner: files, bytes, where they went."""
    totals = full.totals()
    rows = [["category", "files", "bytes", "where"]]
    for cat in run.manifest.categories:
        t = totals.get(cat.name, {"files": 0, "bytes": 0})
        where = [str(run.dest / cat.name)]
        if cat.s3 and run.s3 is not None:
            where.append(f"{run.s3.url}/{cat.name}")
        where += [f"{root} in place in {url}" for root, url in cat.in_s3]
        rows.append([md(cat.name), f"{t['files']:,}", mb(int(t["bytes"])), md(", ".join(where))])
    return rows


def put_verdict(run: Decommission, headline: str) -> None:
    """Open NOTES.md with the verdict: its line goes under the title, replacing an older one."""
    path = run.dest / "NOTES.md"
    if not path.exists():
        return
    lines = [line for line in path.read_text(errors="replace").split("\n") if not line.startswith(VERDICT)]
    while len(lines) > 2 and lines[1] == "" and lines[2] == "":
        del lines[1]
    lines[1:1] = ["", f"{VERDICT} {md(headline)}**"]
    tmp = path.with_name(".NOTES.md.tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)


def step_notes_saved(run: Decommission) -> Step:
    """Step 7: NOTES.md says what the node was, what ran, what was kept and where."""
    path = run.dest / "NOTES.md"
    box: dict[str, str] = {}

    def check() -> Check:
        body = notes_body(run)
        box["body"] = body
        if notes_current(run, body):
            return Check(True, f"{path} is up to date")
        return Check(False, f"{path} is {'out of date' if path.exists() else 'missing'}")

    def plan(before: Check) -> list[Action]:
        return [
            Action(
                f"write {path}",
                "NOTES.md: node, what ran, what was backed up, where, timeline",
                destructive=False,
            )
        ]

    def fix(actions: list[Action], before: Check) -> None:
        write_notes(run, box["body"], "NOTES.md written")

    return run.step("notes saved", check, plan, fix)


def notes_current(run: Decommission, body: str) -> bool:
    """Whether NOTES.md holds `body` already (its timeline aside)."""
    path = run.dest / "NOTES.md"
    current = path.read_text(errors="replace") if path.exists() else ""
    lines = current.split("\n")
    if len(lines) > 2 and lines[2].startswith(VERDICT):  # the verdict step's line, not the notes
        current = "\n".join(lines[:1] + lines[3:])
    return current.split("\n## Timeline\n", 1)[0] == body.rstrip("\n") + "\n" or current.startswith(body)


def write_notes(run: Decommission, body: str, event: str) -> None:
    """Write NOTES.md: `body`, then the timeline with `event` as its last line (temp name, then rename)."""
    path = run.dest / "NOTES.md"
    run.event(event)
    timeline = ["", "## Timeline", ""] + [f"- {md(e['t'])} {md(e['event'])}" for e in run.timeline()]
    tmp = path.with_name(".NOTES.md.tmp")
    tmp.write_text(body.rstrip("\n") + "\n" + "\n".join(timeline) + "\n")
    os.replace(tmp, path)


def notes_after_failure(run: Decommission, problems: Sequence[str]) -> str | None:
    """Write NOTES.md from the verdict when step 7 did not (a failed step blocked it).

    A node that is not safe gets its NOTES.md all the same: the verdict's problems first, and
    what the node was, what ran, what is in the backup and what is not verified, as far as the
    run got. Never under --check-only. Return a problem line when it could not be written.
    """
    if run.check_only or run.refused or run.outcomes.get("notes saved") in ("passed", "fixed"):
        return None  # a run refused before any change writes nothing at its destinations
    try:
        body = notes_body(run, problems)
        if not notes_current(run, body):
            write_notes(run, body, "NOTES.md written by the verdict (not safe to terminate)")
    except Exception as exc:  # noqa: BLE001 - the verdict lists its problems whatever happens here
        return f"NOTES.md not written: {md(type(exc).__name__)}: {md(str(exc).splitlines()[0] if str(exc) else '')}"
    return None


def step_safe_to_terminate(run: Decommission) -> Step:
    """Step 8, the verdict: every step passed or was fixed and every byte is verified at its destination."""

    def check() -> Check:
        table = ProcessTable.read(run.conn, gpu_holders=run.manifest.stop.gpu_holders)
        running = [f"PID {p.pid} {p.cmdline}" for p, _ in table.select(run.manifest.stop)]
        unread = ""
        if run.credentials is None:  # the credentials step did not run: look now (read only)
            try:
                run.credentials = credentials.read(
                    run.conn, sorted({r for c in run.manifest.categories for r in c.roots})
                )
            except Exception as exc:  # noqa: BLE001 - one line, never a traceback wall
                unread = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        creds = run.credentials.remaining if run.credentials is not None else []
        full, listing = run.walk_local()
        s3_missing: list[tuple[str, str]] = []
        open_uploads: list[str] = []
        s3_unreadable: list[str] = []
        if (run.s3_cats() or run.in_s3_to_backup_to()) and run.s3 is not None:
            try:
                items, unverified = run.backup_to_items(listing)
                s3_missing = [*unverified, *run.s3_upload.verify(items)]
                open_uploads = [k for k, _ in run.s3_upload.open_uploads()]
            except Exception as exc:  # noqa: BLE001 - a problem line, never a traceback wall
                s3_unreadable.append(f"--backup-to {run.s3.url}: {s3_problem(exc, run.endpoint)}")
        problems = verdict(
            run.outcomes,
            running=running,
            local_missing=run.backup.verify(listing),
            s3_categories=run.s3_cats(),
            s3_configured=run.s3 is not None,
            s3_missing=s3_missing,
            open_uploads=open_uploads,
            in_place_missing=[(p.file.display, p.how) for p in run.in_place_outstanding()],
            s3_unreadable=s3_unreadable,
            refused=run.refused,
            credentials_left=len(creds),
            credentials_block=run.credentials_left == "unsafe",
        )
        if unread and run.credentials_left == "unsafe":
            problems.append(f"credentials on the node could not be read: {md(unread)}")
        problems += root_problems(run.manifest, full)
        if problems:
            run._listing = listing  # what the local backup is to hold, as step 4 sets it
            failed = notes_after_failure(run, problems)
            problems += [failed] if failed else []
        state = {
            "problems": problems,
            "files": len(full.files),
            "in_place": run.in_place_summary(),
            "credentials_left": len(creds),
        }
        left = (
            f"; {len(creds)} credentials remain on the node (rotate them; --fix=scrub removes them)"
            if creds
            else "; no credential left on the node"
        )
        if run.say is not None:
            run.say(f"verdict: {len(creds)} credentials remain on the node" if creds else left[2:])
        headline = answer_line(run, full, problems) + left
        evidence.current().answer(
            run.target, not problems, headline, grouped(problems), category_table(run, full)
        )
        if problems:
            head = "\n  ".join(problems[:30])
            more = f"\n  ... and {len(problems) - 30} more" if len(problems) > 30 else ""
            return Check(
                False, f"NOT safe to terminate: {len(problems)} problems{left}:\n  {head}{more}", state
            )
        run.event("safe to terminate")
        if not run.check_only:
            put_verdict(run, headline)
        return Check(
            True, f"safe to terminate: {len(full.files)} files verified in every destination{left}", state
        )

    def fix(actions: list[Action], before: Check) -> None:
        raise ProcedureError("nothing here can make the node safe; fix the steps above and run again")

    return run.step("safe to terminate", check, None, fix)

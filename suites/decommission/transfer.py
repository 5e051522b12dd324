"""Steps 4-5 of suites/decommission: artifacts backed up (S3 uploads start while it copies), data in S3."""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.exec.s3io import make_client, parse_s3_url, s3_problem
from pytest_gpuhost.modules.backup.local import BackupPlan, Listing, RemoteFile
from pytest_gpuhost.modules.backup.s3 import item_for
from pytest_gpuhost.run.procedure import ProcedureError, ProcedureStep, Step
from pytest_gpuhost.run.remediation import Action, Check

from . import in_s3
from .node import Decommission, mb

__all__ = [
    "DataInS3",
    "backup_actions",
    "finish_s3_pipeline",
    "start_s3_pipeline",
    "step_artifacts_backed_up",
    "step_data_in_s3",
]


def backup_actions(run: Decommission, p: BackupPlan) -> list[Action]:
    """What step 4's fix does: one copy per category, the symlinks, the S3 uploads as files arrive."""
    extra = []
    if run.s3 is not None and run.s3_cats():
        extra.append(
            Action(
                f"upload files of {', '.join(run.s3_cats())} to {run.s3.url} as they arrive",
                "boto3 put_object / multipart (ChecksumSHA256) from the verified local copy",
                destructive=False,
            )
        )
    by_cat: dict[str, list[int]] = {}
    for f in p.copy + p.rehash:
        c = by_cat.setdefault(f.category, [0, 0])
        c[0] += 1
        c[1] += f.size
    actions = [
        Action(
            f"copy {n} files ({mb(b)}) of category {cat} to {run.dest / cat}",
            "one bulk stream: python3 -c <agent/probe_backup.py sender> | local writer; "
            "SHA-256 on the node and on arrival, temp name then rename",
            destructive=False,
        )
        for cat, (n, b) in sorted(by_cat.items())
    ]
    if p.links:
        actions.append(
            Action(
                f"recreate {len(p.links)} symlinks as links (never followed)",
                "os.symlink(target) then rename",
                destructive=False,
            )
        )
    return actions + extra


def step_artifacts_backed_up(run: Decommission) -> Step:
    """Step 4: every manifest file is in the local backup, SHA-256 checked against the node's."""
    plan_box: list[BackupPlan] = []

    def check() -> Check:
        _, listing = run.walk_local()
        run._listing = listing
        plan = run.backup.plan(listing)
        plan_box[:] = [plan]
        missing = run.backup.verify(listing)
        state = {
            "plan": plan.summary(),
            "totals": listing.totals(),
            "skipped": listing.skipped,
            "walk_errors": listing.errors,
            "missing": len(missing),
        }
        if listing.errors:
            state["walk_errors"] = listing.errors
        in_place = run.in_place_summary()
        if in_place:
            state["in_place"] = in_place
        if not plan.copy and not plan.links and not plan.rehash and not missing and not listing.errors:
            run.backup.write_checksums(listing)
            return Check(
                True,
                f"{len(listing.files)} files verified in {run.dest} ({plan.summary()})" + run.in_place_line(),
                state,
            )
        return Check(
            False,
            plan.summary() + (f"; {len(listing.errors)} unreadable on the node" if listing.errors else ""),
            state,
        )

    def plan(before: Check) -> list[Action]:
        return backup_actions(run, plan_box[0])

    def fix(actions: list[Action], before: Check) -> None:
        run.event(f"backup started: {plan_box[0].summary()}")
        session = start_s3_pipeline(run)
        try:
            res = run.backup.run(plan_box[0])
        finally:
            run.backup.on_placed = None
            if session is not None:
                finish_s3_pipeline(run, session)
        run._measure("copied files", res.copied_files)
        run._measure("copied bytes", res.copied_bytes, "B")
        run._measure("copy time", round(res.duration, 3), "s")
        if res.duration > 0:
            run._measure("copy rate", round(res.copied_bytes / res.duration / 1e6, 1), "MB/s")
        run._state(
            "backup result",
            {
                "copied_files": res.copied_files,
                "copied_bytes": res.copied_bytes,
                "links": res.links,
                "same_by_node_hash": res.rehashed_same,
                "failed": res.failed[:200],
                "error": res.error,
            },
        )
        assert run._listing is not None  # walked by the check
        run.backup.write_checksums(run._listing)
        run.backup.finish()
        run.event(
            f"backup: {res.copied_files} files, {mb(res.copied_bytes)} in {res.duration:.1f} s"
            + (f"; {res.error}" if res.error else "")
        )
        if not res.ok:
            lines = [f"{p}: {why}" for p, why in res.failed[:20]]
            raise ProcedureError(
                (res.error or f"{len(res.failed)} files failed") + ("\n" + "\n".join(lines) if lines else "")
            )

    def verify() -> Check:
        _, listing = run.walk_local()
        run._listing = listing
        missing = run.backup.verify(listing)
        run.backup.write_checksums(listing)
        if missing:
            head = "; ".join(f"{p} ({why})" for p, why in missing[:10])
            return Check(
                False, f"{len(missing)} files not verified in {run.dest}: {head}", {"missing": missing}
            )
        return Check(
            True,
            f"{len(listing.files)} files verified in {run.dest}" + run.in_place_line(),
            {"totals": listing.totals(), "in_place": run.in_place_summary()},
        )

    return run.step("artifacts backed up", check, plan, fix, verify)


def start_s3_pipeline(run: Decommission) -> Any:
    """Start uploading the S3 categories while the local copy runs (None when not configured)."""
    if run.s3 is None or not run.s3_cats():
        return None
    cats = set(run.s3_cats())
    try:
        session = run.s3_upload.start(skip_current=True)
    except Exception as exc:  # noqa: BLE001 - the S3 step retries and reports
        run.event(f"S3 upload during the backup not started: {type(exc).__name__}: {exc}")
        return None

    def offer(f: RemoteFile, rec: dict[str, Any]) -> None:
        if f.category in cats:
            session.offer(item_for(f, rec))

    run.backup.on_placed = offer
    return session


def finish_s3_pipeline(run: Decommission, session: Any) -> None:
    res = session.finish()
    run.s3_upload.finish()
    run._state(
        "S3 upload during the backup",
        {
            "uploaded": res.uploaded,
            "failed": res.failed[:200],
            "aborted_uploads": res.aborted_uploads,
            "open_uploads_after": res.open_uploads_after,
        },
    )
    run.event(
        f"S3 (during the backup): {res.uploaded} objects, {mb(res.uploaded_bytes)}"
        + (f", {len(res.failed)} failed (the S3 step retries)" if res.failed else "")
    )


def step_data_in_s3(run: Decommission) -> Step:
    """Step 5: the categories marked s3 are in the bucket with the same SHA-256, the in_s3 files
    are proved where they already are (or sent back there); no upload left open."""
    return DataInS3(run)


class DataInS3(ProcedureStep[Decommission]):
    """Step 5 as a class: what its check found (`box`) is what its plan shows and its fix sends."""

    name = "data in s3"

    def __init__(self, run: Decommission) -> None:
        super().__init__(run)
        self.box: dict[str, Any] = {}

    def backup_to(self, listing: Listing | None) -> tuple[bool, str, dict[str, Any]]:
        """The categories marked s3 (and, with --in-s3-send-to=backup-to, the in_s3 files not
        proved in place), under --backup-to."""
        if self.run.s3 is None:
            return (
                False,
                f"categories {', '.join(self.run.s3_cats())} are marked s3 but there is no "
                "--backup-to=s3://BUCKET/PREFIX",
                {"categories": self.run.s3_cats()},
            )
        items, unverified = self.run.backup_to_items(listing or self.run.backup.walk())
        up = self.run.s3_upload
        try:
            plan = up.plan(items)
            open_uploads = up.open_uploads()
        except Exception as exc:  # noqa: BLE001 - one line, never a traceback wall
            line = f"--backup-to {self.run.s3.url}: {s3_problem(exc, self.run.endpoint)}"
            self.box.update(s3_error=line)
            return False, line, {"s3_unreadable": line}
        self.box.update(items=items, plan=plan, unverified=unverified)
        state = {
            "to_upload": len(plan.upload),
            "upload_bytes": plan.upload_bytes,
            "current": len(plan.current),
            "open_multipart_uploads": [k for k, _ in open_uploads],
            "not_in_local_backup": len(unverified),
        }
        if not plan.upload and not open_uploads and not unverified:
            return True, f"{len(items)} objects verified in {self.run.s3.url}", state
        summary = f"{len(plan.upload)} objects ({mb(plan.upload_bytes)}) to upload to {self.run.s3.url}"
        if unverified:
            summary += f"; {len(unverified)} files not in the local backup yet"
        if open_uploads:
            summary += f"; {len(open_uploads)} interrupted multipart uploads to abort"
        return False, summary, state

    def in_place(self) -> tuple[bool, str, dict[str, Any]]:
        """The files under in_s3 roots: proved there, or to be sent back there (or, with
        --in-s3-send-to=backup-to, counted under --backup-to by `backup_to`)."""
        if self.run.in_s3_to_backup_to():
            bad = in_s3.not_proved(self.run._in_place)
            n = len(self.run._in_place.proofs) if self.run._in_place else 0
            state = dict(self.run.in_place_summary(), sent_to="--backup-to")
            return True, f"{n - len(bad)} files proved in place, {len(bad)} go under --backup-to", state
        to_send, unverified = in_s3.sends(self.run._in_place, self.run.backup)
        client = make_client(self.run.endpoint) if to_send else None
        refused: list[str] = []
        for url in list(to_send):
            mine, theirs = in_s3.not_ours(
                client, parse_s3_url(url).bucket, to_send[url], self.run.owner_tag()
            )
            refused += theirs
            if mine:
                to_send[url] = mine
            else:
                del to_send[url]
        self.box.update(sends=to_send, send_unverified=unverified, not_ours=refused)
        bad = in_s3.not_proved(self.run._in_place)
        cannot = [p for p in bad if not p.send]
        n_send = sum(len(v) for v in to_send.values())
        state = dict(self.run.in_place_summary(), not_in_local_backup=len(unverified))
        if not bad:
            return (
                True,
                f"{len(self.run._in_place.proofs) if self.run._in_place else 0} files proved in place",
                state,
            )
        summary = f"{n_send + len(unverified)} files to send back to where they belong in S3"
        if refused:
            summary += (
                f"; {len(refused)} not overwritten: the object there is not this node's (the pipeline's or "
                f"another node's), e.g. {refused[0]}; --in-s3-send-to=backup-to sends them under --backup-to"
            )
        if cannot:
            head = "; ".join(f"{p.file.display} ({p.how})" for p in cannot[:3])
            summary += f"; {len(cannot)} cannot be verified there: {head}"
        return False, summary, state

    def check_state(self) -> Check:
        parts = []
        listing = self.run.walk_local()[0] if self.run.in_place_cats() else None
        if self.run.s3_cats() or self.run.in_s3_to_backup_to():
            parts.append(("backup_to", *self.backup_to(listing)))
        if self.run.in_place_cats():
            parts.append(("in_place", *self.in_place()))
        if not parts:
            return Check(True, "no category is marked s3", skip="the manifest marks no category for S3")
        ok = all(p[1] for p in parts)
        return Check(ok, "; ".join(p[2] for p in parts), {p[0]: p[3] for p in parts})

    def plan_actions(self, before: Check) -> list[Action]:
        actions = []
        if self.run.s3 is not None and "plan" in self.box:
            p = self.box["plan"]
            n_unverified = len(self.box["unverified"])
            actions.append(
                Action(
                    f"upload {len(p.upload) + n_unverified} objects "
                    f"({mb(p.upload_bytes)} known now) to {self.run.s3.url}",
                    f"boto3 put_object / multipart upload (ChecksumSHA256) to {self.run.endpoint or 'AWS'}",
                )
            )
            if before.state.get("backup_to", {}).get("open_multipart_uploads"):
                actions.append(
                    Action(
                        "abort interrupted multipart uploads under the prefix",
                        "boto3 abort_multipart_upload",
                    )
                )
        for url, items in sorted(self.box.get("sends", {}).items()):
            actions.append(
                Action(
                    f"send {len(items)} missing or changed files ({mb(sum(i.size for i in items))}) back to {url}",
                    "boto3 put_object / multipart upload (ChecksumSHA256) from the verified local copy, "
                    "each to its own key; nothing that cannot be verified is overwritten",
                )
            )
        return actions

    def upload(self, up: Any, plan: Any, where: str) -> None:
        self.run.event(f"S3 upload started: {len(plan.upload)} objects to {where}")
        res = up.run(plan)
        up.finish()
        self.run._measure("uploaded objects", res.uploaded)
        self.run._measure("uploaded bytes", res.uploaded_bytes, "B")
        self.run._measure("upload time", round(res.duration, 3), "s")
        self.run._state(
            f"S3 result ({where})",
            {
                "uploaded": res.uploaded,
                "aborted_uploads": res.aborted_uploads,
                "failed": res.failed[:200],
                "open_uploads_after": res.open_uploads_after,
            },
        )
        self.run.event(
            f"S3: {res.uploaded} objects, {mb(res.uploaded_bytes)} in {res.duration:.1f} s to {where}"
        )
        if not res.ok:
            lines = [f"{p}: {why}" for p, why in res.failed[:20]]
            raise ProcedureError(
                f"{len(res.failed)} uploads failed, {len(res.open_uploads_after)} left open\n"
                + "\n".join(lines)
            )

    def fix_actions(self, actions: list[Action], before: Check) -> None:
        if "s3_error" in self.box:
            raise ProcedureError(f"S3 not readable: {self.box['s3_error']}")
        unverified = [*self.box.get("unverified", []), *self.box.get("send_unverified", [])]
        if unverified:
            head = ", ".join(p for p, _ in unverified[:5])
            raise ProcedureError(f"{len(unverified)} files are not in the verified local backup: {head}")
        if self.run.s3_cats() or self.run.in_s3_to_backup_to():
            if self.run.s3 is None:
                raise ProcedureError("no --backup-to=s3://BUCKET/PREFIX given")
            self.upload(self.run.s3_upload, self.box["plan"], self.run.s3.url)
        for url, items in sorted(self.box.get("sends", {}).items()):
            up = self.run.in_place_upload(url)
            self.upload(up, up.plan(items), url)

    def verify_state(self) -> Check:
        problems: list[str] = []
        n = 0
        if "s3_error" in self.box:
            problems.append(self.box["s3_error"])
        elif self.run.s3_cats() or self.run.in_s3_to_backup_to():
            assert self.run.s3 is not None
            missing = self.run.s3_upload.verify(self.box["items"])
            open_uploads = self.run.s3_upload.open_uploads()
            problems += [f"{p} ({why})" for p, why in missing]
            problems += [f"open multipart upload {k}" for k, _ in open_uploads]
            n += len(self.box["items"])
        if self.run.in_place_cats():
            self.run.walk_local()
            problems += [f"{p.file.display} ({p.how})" for p in self.run.in_place_outstanding()]
            n += len(self.run._in_place.proofs) if self.run._in_place else 0
        if problems:
            return Check(
                False,
                f"{len(problems)} objects not verified: {'; '.join(problems[:10])}",
                {"missing": problems},
            )
        return Check(True, f"{n} objects verified in S3" + self.run.in_place_line())

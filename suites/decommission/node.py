"""The decommission procedure for one node: each step is a Remediation built from the modules.

State that must outlive a run (what was stopped, the timeline) lives in the backup directory's
`.gpuhost/` folder, so a rerun (or a run after an interruption) writes the same NOTES.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_gpuhost.modules.backup import Backup, BackupPlan, Listing, Manifest, Progress, RemoteFile
from pytest_gpuhost.modules.process import Proc, ProcessTable, stop_processes
from pytest_gpuhost.modules.s3 import S3Location, S3Upload, item_for, items_from_backup
from pytest_gpuhost.run.remediation import Action, Check, Remediation

GPU_QUERY = [
    "nvidia-smi",
    "--query-gpu=index,pci.bus_id,name,uuid,memory.used,memory.total",
    "--format=csv,noheader,nounits",
]
APPS_QUERY = [
    "nvidia-smi",
    "--query-compute-apps=pid,process_name,used_memory,gpu_bus_id",
    "--format=csv,noheader,nounits",
]
STEPS = ("inventory", "servers stopped", "GPUs idle", "artifacts backed up", "data in S3", "notes saved")


def _csv(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


@dataclass
class Decommission:
    """One node being emptied: its connection, manifest, destinations and what happened so far."""

    conn: Any
    target: str
    manifest: Manifest
    dest: Path
    s3: S3Location | None = None
    endpoint: str | None = None
    gpu_idle_mib: int = 256
    gpu_idle_timeout: float = 30.0
    stall_timeout: float = 60.0
    part_size: int | None = None
    progress: Callable[[Progress], None] | None = None
    record: Callable[[str, Any], None] | None = None  # evidence.state
    measure: Callable[..., None] | None = None  # evidence.measure
    outcomes: dict[str, str] = field(default_factory=dict)
    inventory: dict[str, Any] = field(default_factory=dict)
    _backup: Backup | None = None
    _s3: S3Upload | None = None

    # ---------------------------------------------------------------- shared state

    @property
    def backup(self) -> Backup:
        if self._backup is None:
            self._backup = Backup(
                self.conn,
                self.manifest,
                self.dest,
                progress=self.progress,
                progress_interval=2.0,
                stall_timeout=self.stall_timeout,
            )
        return self._backup

    @property
    def s3_upload(self) -> S3Upload:
        assert self.s3 is not None
        if self._s3 is None:
            self._s3 = S3Upload(
                self.dest,
                self.s3,
                endpoint=self.endpoint,
                progress=self.progress,
                progress_interval=2.0,
                part_size=self.part_size,
            )
        return self._s3

    @property
    def meta(self) -> Path:
        path = self.dest / ".gpuhost"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def event(self, text: str) -> None:
        """Append one line to the persistent timeline (UTC)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with open(self.meta / "timeline.jsonl", "a") as f:
            f.write(json.dumps({"t": stamp, "target": self.target, "event": text}) + "\n")

    def timeline(self) -> list[dict[str, str]]:
        path = self.meta / "timeline.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stopped(self) -> list[dict[str, Any]]:
        path = self.meta / "stopped.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def _state(self, label: str, value: Any) -> None:
        if self.record is not None:
            self.record(label, value)

    def _measure(self, name: str, value: Any, unit: str | None = None) -> None:
        if self.measure is not None:
            self.measure(name, value, unit)

    # ---------------------------------------------------------------- 1 inventory

    def take_inventory(self) -> dict[str, Any]:
        """Read host facts, processes, GPU use and the manifest's files in one round trip."""
        started = time.monotonic()
        reqs = [
            {"op": "hello"},
            {"op": "proc_list", "gpu_holders": True},
            {"op": "backup_walk", "categories": [c.wire() for c in self.manifest.categories], "timeout": 300},
            {"op": "run", "argv": GPU_QUERY, "timeout": 30},
            {"op": "run", "argv": APPS_QUERY, "timeout": 30},
            {
                "op": "run",
                "argv": ["df", "-P", "-k", *sorted({r for c in self.manifest.categories for r in c.roots})],
                "timeout": 30,
            },
        ]
        before = getattr(self.conn, "round_trips", 0)
        hello, procs, walk, gpus, apps, df = self.conn.batch(reqs)
        for res in (hello, procs, walk):
            if isinstance(res, Exception):
                raise res
        table = ProcessTable.from_result(procs)
        selected = table.select(self.manifest.stop)
        listing = self.backup.listing_from(walk)
        gpu_rows = _csv(gpus["stdout"]) if isinstance(gpus, dict) and gpus.get("rc") == 0 else []
        app_rows = _csv(apps["stdout"]) if isinstance(apps, dict) and apps.get("rc") == 0 else []
        inv = {
            "hostname": hello.get("hostname"),
            "kernel": hello.get("kernel"),
            "python": hello.get("python"),
            "gpus": [
                {
                    "index": r[0],
                    "bus_id": r[1],
                    "name": r[2],
                    "uuid": r[3],
                    "memory_used_mib": r[4],
                    "memory_total_mib": r[5],
                }
                for r in gpu_rows
                if len(r) >= 6
            ],
            "gpu_apps": [
                {"pid": r[0], "name": r[1], "used_mib": r[2], "bus_id": r[3]} for r in app_rows if len(r) >= 4
            ],
            "to_stop": [dict(p.record(), why=why) for p, why in selected],
            "categories": listing.totals(),
            "skipped": listing.skipped,
            "walk_errors": listing.errors,
            "df": df.get("stdout", "") if isinstance(df, dict) else str(df),
            "round_trips": getattr(self.conn, "round_trips", 0) - before,
            "duration": time.monotonic() - started,
        }
        if isinstance(gpus, dict) and gpus.get("rc") != 0:
            inv["nvidia_smi_error"] = (gpus.get("stderr") or "").strip()[:500]
        self.inventory = inv
        self._listing = listing
        return inv

    def inventory_step(self) -> Remediation:
        def check() -> Check:
            inv = self.take_inventory()
            self.event("inventory taken")
            cats = ", ".join(
                f"{k} {v['files']} files/{_mb(v['bytes'])}" for k, v in inv["categories"].items()
            )
            summary = (
                f"{inv['hostname']} ({inv['kernel']}): {len(inv['gpus'])} GPUs, {len(inv['gpu_apps'])} GPU processes, "
                f"{len(inv['to_stop'])} processes selected to stop; {cats}; {inv['round_trips']} round trip(s)"
            )
            return Check(ok=True, summary=summary, state=inv)

        return _rem("inventory", check)

    # ---------------------------------------------------------------- 2 servers stopped

    def servers_step(self) -> Remediation:
        sel = self.manifest.stop
        chosen: list[tuple[Proc, str]] = []

        def check() -> Check:
            nonlocal chosen
            table = ProcessTable.read(self.conn, gpu_holders=sel.gpu_holders)
            chosen = table.select(sel)
            state = [dict(p.record(), why=why) for p, why in chosen]
            if not chosen:
                return Check(True, "no process selected by the manifest is running", state)
            pids = ", ".join(str(p.pid) for p, _ in chosen)
            return Check(
                False, f"{len(chosen)} processes selected by the manifest are running: {pids}", state
            )

        def plan(before: Check) -> list[Action]:
            return [
                Action(
                    f"stop PID {p.pid} ({why}): {p.cmdline}",
                    f"kill -TERM {p.pid}; wait up to {sel.term_timeout:.0f} s; kill -KILL {p.pid}"
                    f"  (exact PID, start time {p.starttime} re-checked before each signal)",
                )
                for p, why in chosen
            ]

        def fix(actions: list[Action], before: Check) -> None:
            with open(self.meta / "stopped.jsonl", "a") as f:
                for p, why in chosen:
                    f.write(json.dumps(dict(p.record(), why=why, t=time.time())) + "\n")
            units = sorted({p.unit for p, why in chosen if why.startswith("unit ") and p.unit})
            self.event(f"stopping {len(chosen)} processes: " + ", ".join(str(p.pid) for p, _ in chosen))
            res = stop_processes(
                self.conn,
                [p for p, _ in chosen],
                term_timeout=sel.term_timeout,
                kill_timeout=sel.kill_timeout,
                record=self._state,
                units=units,
                run=lambda argv: self.conn.run(argv, timeout=30),
            )
            self.event(f"stopped: {len(res.termed)} took SIGTERM, {len(res.killed)} needed SIGKILL")
            if res.survivors:
                raise RuntimeError(f"still running after SIGKILL: PIDs {res.survivors}")

        return _rem("servers stopped", check, plan, fix)

    # ---------------------------------------------------------------- 3 GPUs idle

    def _gpu_state(self) -> dict[str, Any]:
        gpus, apps = self.conn.batch(
            [
                {"op": "run", "argv": GPU_QUERY, "timeout": 30},
                {"op": "run", "argv": APPS_QUERY, "timeout": 30},
            ]
        )
        if isinstance(gpus, Exception) or gpus.get("rc") != 0:
            err = gpus if isinstance(gpus, Exception) else (gpus.get("stderr") or "").strip()
            raise RuntimeError(f"nvidia-smi failed: {err}")
        rows = [r for r in _csv(gpus["stdout"]) if len(r) >= 6]
        app_rows = [r for r in _csv(apps.get("stdout", "")) if len(r) >= 4] if isinstance(apps, dict) else []
        busy = [
            {"index": r[0], "bus_id": r[1], "memory_used_mib": int(float(r[4]))}
            for r in rows
            if r[4].replace(".", "", 1).isdigit() and float(r[4]) > self.gpu_idle_mib
        ]
        return {
            "apps": [{"pid": r[0], "name": r[1], "used_mib": r[2], "bus_id": r[3]} for r in app_rows],
            "busy": busy,
            "gpus": len(rows),
        }

    def gpus_step(self) -> Remediation:
        def check() -> Check:
            st = self._gpu_state()
            if not st["apps"] and not st["busy"]:
                return Check(
                    True,
                    f"{st['gpus']} GPUs idle: no compute processes, memory at baseline "
                    f"(<= {self.gpu_idle_mib} MiB)",
                    st,
                )
            parts = []
            if st["apps"]:
                parts.append("compute processes " + ", ".join(f"{a['pid']} {a['name']}" for a in st["apps"]))
            if st["busy"]:
                parts.append(
                    "memory in use on GPU "
                    + ", ".join(f"{b['index']} ({b['memory_used_mib']} MiB)" for b in st["busy"])
                )
            return Check(False, "; ".join(parts), st)

        def plan(before: Check) -> list[Action]:
            if before.state["apps"]:
                # Servers that step 2 stops (still running under --check-only) leave on their own;
                # any other compute process is not ours to kill, so nothing is planned for it.
                table = ProcessTable.read(self.conn, gpu_holders=self.manifest.stop.gpu_holders)
                ours = {p.pid for p, _ in table.select(self.manifest.stop)}
                if any(int(a["pid"]) not in ours for a in before.state["apps"]):
                    return []
            return [
                Action(
                    f"wait up to {self.gpu_idle_timeout:.0f} s for GPU memory to return to baseline",
                    " ".join(GPU_QUERY),
                    destructive=False,
                )
            ]

        def fix(actions: list[Action], before: Check) -> None:
            if before.state["apps"]:
                raise RuntimeError(
                    "compute processes not selected by the manifest still hold GPUs: "
                    + ", ".join(f"PID {a['pid']} {a['name']}" for a in before.state["apps"])
                    + " (add a matcher to the manifest's stop: section, or stop them by hand)"
                )
            deadline = time.monotonic() + self.gpu_idle_timeout
            while time.monotonic() < deadline:
                st = self._gpu_state()
                if not st["apps"] and not st["busy"]:
                    return
                time.sleep(1.0)

        return _rem("GPUs idle", check, plan, fix)

    # ---------------------------------------------------------------- 4 artifacts backed up

    def backup_step(self) -> Remediation:
        plan_box: list[BackupPlan] = []

        def check() -> Check:
            listing = self.backup.walk()
            self._listing = listing
            plan = self.backup.plan(listing)
            plan_box[:] = [plan]
            missing = self.backup.verify(listing)
            state = {
                "plan": plan.summary(),
                "totals": listing.totals(),
                "skipped": listing.skipped,
                "walk_errors": listing.errors,
                "missing": len(missing),
            }
            if listing.errors:
                state["walk_errors"] = listing.errors
            if not plan.copy and not plan.links and not plan.rehash and not missing and not listing.errors:
                self.backup.write_checksums(listing)
                return Check(
                    True, f"{len(listing.files)} files verified in {self.dest} ({plan.summary()})", state
                )
            return Check(
                False,
                plan.summary()
                + (f"; {len(listing.errors)} unreadable on the node" if listing.errors else ""),
                state,
            )

        def plan(before: Check) -> list[Action]:
            p = plan_box[0]
            extra = []
            if self.s3 is not None and self.s3_cats():
                extra.append(
                    Action(
                        f"upload files of {', '.join(self.s3_cats())} to {self.s3.url} as they arrive",
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
                    f"copy {n} files ({_mb(b)}) of category {cat} to {self.dest / cat}",
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

        def fix(actions: list[Action], before: Check) -> None:
            self.event(f"backup started: {plan_box[0].summary()}")
            session = self._start_s3_pipeline()
            try:
                res = self.backup.run(plan_box[0])
            finally:
                self.backup.on_placed = None
                if session is not None:
                    self._finish_s3_pipeline(session)
            self._measure("copied files", res.copied_files)
            self._measure("copied bytes", res.copied_bytes, "B")
            self._measure("copy time", round(res.duration, 3), "s")
            if res.duration > 0:
                self._measure("copy rate", round(res.copied_bytes / res.duration / 1e6, 1), "MB/s")
            self._state(
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
            self.backup.write_checksums(self._listing)
            self.backup.finish()
            self.event(
                f"backup: {res.copied_files} files, {_mb(res.copied_bytes)} in {res.duration:.1f} s"
                + (f"; {res.error}" if res.error else "")
            )
            if not res.ok:
                lines = [f"{p}: {why}" for p, why in res.failed[:20]]
                raise RuntimeError(
                    (res.error or f"{len(res.failed)} files failed")
                    + ("\n" + "\n".join(lines) if lines else "")
                )

        def verify() -> Check:
            listing = self.backup.walk()
            self._listing = listing
            missing = self.backup.verify(listing)
            self.backup.write_checksums(listing)
            if missing:
                head = "; ".join(f"{p} ({why})" for p, why in missing[:10])
                return Check(
                    False, f"{len(missing)} files not verified in {self.dest}: {head}", {"missing": missing}
                )
            return Check(
                True, f"{len(listing.files)} files verified in {self.dest}", {"totals": listing.totals()}
            )

        return _rem("artifacts backed up", check, plan, fix, verify)

    def _start_s3_pipeline(self) -> Any:
        """Start uploading the S3 categories while the local copy runs (None when not configured)."""
        if self.s3 is None or not self.s3_cats():
            return None
        cats = set(self.s3_cats())
        try:
            session = self.s3_upload.start(skip_current=True)
        except Exception as exc:  # noqa: BLE001 - the S3 step retries and reports
            self.event(f"S3 upload during the backup not started: {type(exc).__name__}: {exc}")
            return None

        def offer(f: RemoteFile, rec: dict[str, Any]) -> None:
            if f.category in cats:
                session.offer(item_for(f, rec))

        self.backup.on_placed = offer
        return session

    def _finish_s3_pipeline(self, session: Any) -> None:
        res = session.finish()
        self.s3_upload.finish()
        self._state(
            "S3 upload during the backup",
            {
                "uploaded": res.uploaded,
                "failed": res.failed[:200],
                "aborted_uploads": res.aborted_uploads,
                "open_uploads_after": res.open_uploads_after,
            },
        )
        self.event(
            f"S3 (during the backup): {res.uploaded} objects, {_mb(res.uploaded_bytes)}"
            + (f", {len(res.failed)} failed (the S3 step retries)" if res.failed else "")
        )

    # ---------------------------------------------------------------- 5 data in S3

    def s3_cats(self) -> list[str]:
        return [c.name for c in self.manifest.categories if c.s3]

    def s3_step(self) -> Remediation:
        box: dict[str, Any] = {}

        def check() -> Check:
            if not self.s3_cats():
                return Check(True, "no category is marked s3", skip="the manifest marks no category for S3")
            if self.s3 is None:
                return Check(
                    False,
                    f"categories {', '.join(self.s3_cats())} are marked s3 but there is no "
                    "--backup-to=s3://BUCKET/PREFIX",
                    {"categories": self.s3_cats()},
                )
            listing = self.backup.walk()
            items, unverified = items_from_backup(self.backup, listing)
            up = self.s3_upload
            plan = up.plan(items)
            open_uploads = up.open_uploads()
            box.update(items=items, plan=plan, unverified=unverified)
            state = {
                "to_upload": len(plan.upload),
                "upload_bytes": plan.upload_bytes,
                "current": len(plan.current),
                "open_multipart_uploads": [k for k, _ in open_uploads],
                "not_in_local_backup": len(unverified),
            }
            if not plan.upload and not open_uploads and not unverified:
                return Check(True, f"{len(items)} objects verified in {self.s3.url}", state)
            summary = f"{len(plan.upload)} objects ({_mb(plan.upload_bytes)}) to upload to {self.s3.url}"
            if unverified:
                summary += f"; {len(unverified)} files not in the local backup yet"
            if open_uploads:
                summary += f"; {len(open_uploads)} interrupted multipart uploads to abort"
            return Check(False, summary, state)

        def plan(before: Check) -> list[Action]:
            if self.s3 is None:
                return []
            p = box["plan"]
            n_unverified = len(box["unverified"])
            actions = [
                Action(
                    f"upload {len(p.upload) + n_unverified} objects "
                    f"({_mb(p.upload_bytes)} known now) to {self.s3.url}",
                    f"boto3 put_object / multipart upload (ChecksumSHA256) to {self.endpoint or 'AWS'}",
                )
            ]
            if before.state.get("open_multipart_uploads"):
                actions.append(
                    Action(
                        "abort interrupted multipart uploads under the prefix", "boto3 abort_multipart_upload"
                    )
                )
            return actions

        def fix(actions: list[Action], before: Check) -> None:
            if self.s3 is None:
                raise RuntimeError("no --backup-to=s3://BUCKET/PREFIX given")
            if box["unverified"]:
                head = ", ".join(p for p, _ in box["unverified"][:5])
                raise RuntimeError(
                    f"{len(box['unverified'])} files are not in the verified local backup: {head}"
                )
            self.event(f"S3 upload started: {len(box['plan'].upload)} objects to {self.s3.url}")
            res = self.s3_upload.run(box["plan"])
            self.s3_upload.finish()
            self._measure("uploaded objects", res.uploaded)
            self._measure("uploaded bytes", res.uploaded_bytes, "B")
            self._measure("upload time", round(res.duration, 3), "s")
            self._state(
                "S3 result",
                {
                    "uploaded": res.uploaded,
                    "aborted_uploads": res.aborted_uploads,
                    "failed": res.failed[:200],
                    "open_uploads_after": res.open_uploads_after,
                },
            )
            self.event(f"S3: {res.uploaded} objects, {_mb(res.uploaded_bytes)} in {res.duration:.1f} s")
            if not res.ok:
                lines = [f"{p}: {why}" for p, why in res.failed[:20]]
                raise RuntimeError(
                    f"{len(res.failed)} uploads failed, {len(res.open_uploads_after)} left open\n"
                    + "\n".join(lines)
                )

        def verify() -> Check:
            assert self.s3 is not None
            missing = self.s3_upload.verify(box["items"])
            open_uploads = self.s3_upload.open_uploads()
            if missing or open_uploads:
                head = "; ".join(f"{p} ({why})" for p, why in missing[:10])
                return Check(
                    False,
                    f"{len(missing)} objects not verified, {len(open_uploads)} uploads open: {head}",
                    {"missing": missing},
                )
            return Check(True, f"{len(box['items'])} objects verified in {self.s3.url}")

        return _rem("data in S3", check, plan, fix, verify)

    # ---------------------------------------------------------------- 6 notes saved

    def notes_body(self) -> str:
        """Return NOTES.md without its timeline: what the node was, what ran, what was kept where."""
        inv = self.inventory or self.take_inventory()
        listing: Listing = getattr(self, "_listing", None) or self.backup.walk()
        lines = [f"# Decommission notes: {inv.get('hostname')} ({self.target})", ""]
        lines += [
            "## The node",
            "",
            f"- hostname: {inv.get('hostname')}",
            f"- kernel: {inv.get('kernel')}",
            f"- manifest: {self.manifest.name} ({self.manifest.path})",
            "",
        ]
        if inv.get("gpus"):
            lines += ["| GPU | bus id | model | UUID | memory |", "|---|---|---|---|---|"]
            lines += [
                f"| {g['index']} | {g['bus_id']} | {g['name']} | {g['uuid']} | {g['memory_total_mib']} MiB |"
                for g in inv["gpus"]
            ]
            lines.append("")
        lines += ["## What ran", ""]
        seen = set()
        for p in self.stopped():
            key = (p["pid"], p["starttime"])
            if key in seen:
                continue
            seen.add(key)
            gpus = f" on {', '.join(p['gpus'])}" if p.get("gpus") else ""
            lines.append(f"- PID {p['pid']} ({p['why']}){gpus}: `{p['cmdline']}`")
        if not seen:
            lines.append("- nothing selected by the manifest was running")
        lines += [
            "",
            "## What was backed up",
            "",
            "| category | files | links | bytes | destinations |",
            "|---|---|---|---|---|",
        ]
        totals = listing.totals()
        for cat in self.manifest.categories:
            t = totals.get(cat.name, {"files": 0, "links": 0, "bytes": 0})
            where = f"{self.dest / cat.name}"
            if cat.s3 and self.s3 is not None:
                where += f", {self.s3.url}/{cat.name}"
            lines.append(f"| {cat.name} | {t['files']} | {t['links']} | {t['bytes']} | {where} |")
        sums = self.dest / "SHA256SUMS"
        digest = hashlib.sha256(sums.read_bytes()).hexdigest() if sums.exists() else "(not written)"
        lines += [
            "",
            f"- checksums: `SHA256SUMS` (SHA-256 computed on the node, checked on arrival; "
            f"`sha256sum -c SHA256SUMS` in {self.dest}); its own SHA-256: {digest}",
        ]
        if listing.skipped:
            lines.append(f"- left out by the manifest's rules: {len(listing.skipped)} files")
            lines += [f"  - {s['category']}: {s['path']} ({s['why']})" for s in listing.skipped[:50]]
        lines += ["", "## Where it went", "", f"- local: {self.dest.resolve()}"]
        if self.s3 is not None:
            lines.append(
                f"- S3: {self.s3.url} (endpoint {self.endpoint or 'AWS default'}), categories "
                f"{', '.join(self.s3_cats()) or 'none'}"
            )
        return "\n".join(lines) + "\n"

    def notes_step(self) -> Remediation:
        path = self.dest / "NOTES.md"
        box: dict[str, str] = {}

        def check() -> Check:
            body = self.notes_body()
            box["body"] = body
            current = path.read_text(errors="replace") if path.exists() else ""
            if current.split("\n## Timeline\n", 1)[0] == body.rstrip("\n") + "\n" or current.startswith(body):
                return Check(True, f"{path} is up to date")
            return Check(False, f"{path} is {'missing' if not current else 'out of date'}")

        def plan(before: Check) -> list[Action]:
            return [
                Action(
                    f"write {path}",
                    "NOTES.md: node, what ran, what was backed up, where, timeline",
                    destructive=False,
                )
            ]

        def fix(actions: list[Action], before: Check) -> None:
            self.event("NOTES.md written")
            timeline = ["", "## Timeline", ""] + [f"- {e['t']} {e['event']}" for e in self.timeline()]
            tmp = path.with_name(".NOTES.md.tmp")
            tmp.write_text(box["body"].rstrip("\n") + "\n" + "\n".join(timeline) + "\n")
            os.replace(tmp, path)

        return _rem("notes saved", check, plan, fix)

    # ---------------------------------------------------------------- 7 safe to terminate

    def safe_step(self) -> Remediation:
        def check() -> Check:
            problems: list[str] = []
            for step in STEPS:
                outcome = self.outcomes.get(step)
                if step == "data in S3" and outcome == "skipped":
                    continue
                if outcome not in ("passed", "fixed"):
                    problems.append(f"step {step!r}: {outcome or 'not run'}")
            table = ProcessTable.read(self.conn, gpu_holders=self.manifest.stop.gpu_holders)
            running = table.select(self.manifest.stop)
            problems += [f"still running: PID {p.pid} {p.cmdline}" for p, _ in running]
            listing = self.backup.walk()
            missing = self.backup.verify(listing)
            problems += [f"not in the local backup: {p} ({why})" for p, why in missing]
            if self.s3_cats():
                if self.s3 is None:
                    problems.append(f"categories {', '.join(self.s3_cats())} marked s3 but no --backup-to")
                else:
                    items, unverified = items_from_backup(self.backup, listing)
                    problems += [f"not in S3: {p} ({why})" for p, why in unverified]
                    problems += [f"not in S3: {p} ({why})" for p, why in self.s3_upload.verify(items)]
                    problems += [f"open multipart upload: {k}" for k, _ in self.s3_upload.open_uploads()]
            state = {"problems": problems, "files": len(listing.files)}
            if problems:
                head = "\n  ".join(problems[:30])
                more = f"\n  ... and {len(problems) - 30} more" if len(problems) > 30 else ""
                return Check(
                    False, f"NOT safe to terminate: {len(problems)} problems:\n  {head}{more}", state
                )
            self.event("safe to terminate")
            return Check(
                True, f"safe to terminate: {len(listing.files)} files verified in every destination", state
            )

        def fix(actions: list[Action], before: Check) -> None:
            raise RuntimeError("nothing here can make the node safe; fix the steps above and run again")

        return _rem("safe to terminate", check, None, fix)


def _rem(
    name: str,
    check: Callable[[], Check],
    plan: Callable[[Check], list[Action]] | None = None,
    fix: Callable[[list[Action], Check], None] | None = None,
    verify: Callable[[], Check] | None = None,
) -> Remediation:
    from pytest_gpuhost.run.remediation import remediation_from

    return remediation_from(name=name, check=check, plan=plan, fix=fix, verify=verify)

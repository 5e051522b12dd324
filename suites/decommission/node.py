"""The decommission procedure for one node: the state its eight steps share.

The steps are tests in test_decommission.py, in order. Each builds its `Remediation` from the
node's one `Decommission`: steps 1-3 (inventory, servers stopped, GPUs idle) are the functions of
stop.py, 4-5 (artifacts backed up, data in S3) of transfer.py, 6 (credentials left) of
credentials.py, 7-8 (notes saved, safe to terminate) of notes.py. Step names follow the convention of every suite: the test is
`test_<name>`, its remediation `<name>` with spaces ("gpus idle"), its builder
`step_<name>(run)`.

State that must outlive a run (what was stopped, the timeline) lives in the backup directory's
`.gpuhost/` folder, so a rerun (or a run after an interruption) writes the same NOTES.md. Nothing
a decommission does is undone: servers stay stopped. What `Procedure` brings is the node's
link, whose loss makes the later steps fail at once, and the verdict naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_gpuhost.exec.s3io import make_client
from pytest_gpuhost.modules import credentials
from pytest_gpuhost.modules.backup.destination import OWNER_NAME, DestinationError
from pytest_gpuhost.modules.backup.inplace import InPlace, InPlaceResult, Proof
from pytest_gpuhost.modules.backup.local import (
    META,
    Backup,
    Listing,
    Manifest,
    Progress,
)
from pytest_gpuhost.modules.backup.ownership import (
    MINE,
    Place,
    claim_problems,
    describe,
    node_identity,
    object_owner_tag,
    run_places,
    s3_evidence,
)
from pytest_gpuhost.modules.backup.s3 import (
    S3Item,
    S3Location,
    S3Upload,
    items_from_backup,
    parse_s3_url,
    state_tag,
)
from pytest_gpuhost.modules.process import ProcessTable
from pytest_gpuhost.redact import redact
from pytest_gpuhost.run.suite import SuiteProcedure

from . import in_s3
from .options import DecommissionOptions

__all__ = ["APPS_QUERY", "GPU_QUERY", "Decommission", "csv_rows", "mb"]

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


def csv_rows(text: str) -> list[list[str]]:
    """Rows of nvidia-smi's CSV output, cells stripped."""
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


def mb(n: int) -> str:
    """Bytes as "12.3 MB"."""
    return f"{n / 1e6:.1f} MB"


class Decommission(SuiteProcedure):
    """One node being emptied: its link, manifest, destinations and what happened so far.

    The settings come from the suite's options (`opts`, suites/decommission/options.py); the
    manifest's own `gpu_idle_mib` and `gpu_idle_timeout` bound the GPUs-idle step.
    """

    def __init__(
        self,
        target: Any,
        opts: DecommissionOptions,
        *,
        manifest: Manifest,
        dest: Path,
        check_only: bool = False,
        s3: S3Location | None = None,
        node_name: str = "",
        progress: Callable[[Progress], None] | None = None,
        say: Callable[[str], None] | None = None,
        record: Callable[[str, Any], None] | None = None,
        measure: Callable[..., None] | None = None,
    ) -> None:
        super().__init__(target, check_only=check_only, journal_name=None)
        self.conn = self.host
        self.target = str(target.name)
        self.opts = opts
        self.manifest = manifest
        self.dest = dest
        self.s3 = s3
        self.endpoint = opts.s3_endpoint
        self.gpu_idle_mib = int(manifest.options.get("gpu_idle_mib", 256))
        self.gpu_idle_timeout = float(manifest.options.get("gpu_idle_timeout", 30))
        self.stall_timeout = opts.stall_timeout
        self.part_size = int(opts.s3_part_mib * 1024 * 1024)
        self.in_s3_send_to = opts.in_s3_send_to  # "location" or "backup-to" (--in-s3-send-to)
        self.fixes = tuple(opts.fixes)  # --fix=scrub
        self.credentials_left = opts.credentials_left  # report or unsafe (--credentials-left)
        self.credentials: credentials.Scan | None = None  # the credentials step's latest look
        self.environ_findings: list[credentials.Finding] = []  # stopped processes' environments
        self.environ_error: str | None = None
        self._environ_pending: list[credentials.Finding] = []
        self.node_name = node_name  # the operator's name of the node, part of its identity
        self.in_s3_min_proof = opts.in_s3_min_proof  # the weakest proof in place that counts
        self.progress = progress
        self.say = say  # one line on the operator's terminal
        self.record_state = record  # evidence.state
        self.record_measure = measure  # evidence.measure
        self.refused: list[str] = []  # what step 1 found the run cannot do: nothing is changed then
        self._stake: tuple[Any, ...] | None = None  # owner records to write once step 1 passed
        self._events: list[dict[str, str]] = []  # the timeline of a --check-only run, kept in memory
        self.inventory: dict[str, Any] = {}
        self._listing: Listing | None = None
        self._backup: Backup | None = None
        self._s3: S3Upload | None = None
        self._in_place: InPlaceResult | None = None
        self._node_listing: Listing | None = None  # every file, also those proved in place
        self._in_place_uploads: dict[str, S3Upload] = {}
        self._owner_tag: str | None = None

    # ---------------------------------------------------------------- shared state

    @property
    def backup(self) -> Backup:
        """The backup engine, on the node's connection itself (it streams on channels of its own)."""
        if self._backup is None:
            self._backup = Backup(
                self.conn.connection(),
                self.manifest,
                self.dest,
                progress=self.progress,
                progress_interval=2.0,
                stall_timeout=self.stall_timeout,
            )
        return self._backup

    @property
    def s3_upload(self) -> S3Upload:
        """The S3 uploader of the categories marked s3."""
        assert self.s3 is not None
        if self._s3 is None:
            self._s3 = S3Upload(
                self.dest,
                self.s3,
                endpoint=self.endpoint,
                progress=self.progress,
                progress_interval=2.0,
                part_size=self.part_size,
                owner_tag=self.owner_tag(),
            )
        return self._s3

    @property
    def meta(self) -> Path:
        """The backup directory's `.gpuhost/` folder (made on first use, never under --check-only)."""
        path = self.dest / ".gpuhost"
        if not self.check_only:
            path.mkdir(parents=True, exist_ok=True)
        return path

    def event(self, text: str) -> None:
        """Append one line to the persistent timeline (UTC); under --check-only, to this run's only."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        entry = {"t": stamp, "target": self.target, "event": text}
        if self.check_only or self._stake is not None:
            # --check-only writes nothing, the backup directory included; nor does a run whose
            # step 1 has not passed its preflight yet (`stake` writes these lines then)
            self._events.append(entry)
            return
        with open(self.meta / "timeline.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def timeline(self) -> list[dict[str, str]]:
        """The timeline so far, over every run (and this check-only run's events after them)."""
        path = self.meta / "timeline.jsonl"
        kept = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in kept if line.strip()] + list(self._events)

    def stopped(self) -> list[dict[str, Any]]:
        """Every process a run stopped, as recorded before it was signalled."""
        path = self.meta / "stopped.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def _state(self, label: str, value: Any) -> None:
        if self.record_state is not None:
            self.record_state(label, value)

    def _measure(self, name: str, value: Any, unit: str | None = None) -> None:
        if self.record_measure is not None:
            self.record_measure(name, value, unit)

    # ---------------------------------------------------------------- whose destinations

    def identity(self) -> dict[str, str]:
        """This node's owner record: machine-id, target name, host keys (the agent's hello)."""
        hello = dict(getattr(self.conn.connection(), "hello", None) or {})  # read at connect
        if "machine_id" not in hello or "host_key" not in hello:
            hello = self.conn.batch([{"op": "hello"}])[0]
            if isinstance(hello, Exception):
                raise hello
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return node_identity(
            self.target,
            str(hello.get("hostname") or ""),
            str(hello.get("machine_id") or ""),
            stamp,
            host_key=str(hello.get("host_key") or ""),
            node_name=self.node_name,
        )

    def places(self) -> list[Place]:
        """Every place this node's run reads or writes (see ownership.run_places)."""
        in_s3_urls = [
            (u, c.name) for c in self.manifest.categories for u in dict.fromkeys(u for _, u in c.in_s3)
        ]
        backup_to = {self.target: self.s3.url} if self.s3 is not None and self.writes_backup_to() else {}
        return run_places(
            [self.target],
            {self.target: str(self.dest)},
            backup_to,
            in_s3_urls,
            in_s3_writes=bool(in_s3_urls) and self.in_s3_send_to == "location",
        )

    def writes_backup_to(self) -> bool:
        """Whether the run writes under --backup-to (a category marked s3, or in_s3 misses there)."""
        return bool(self.s3_cats() or self.in_s3_to_backup_to())

    def claim(self) -> None:
        """Prove every destination is this node's, or refuse; mark new ones as this node's.

        Runs before the first step. The places the run reads and writes must not overlap
        (ownership.overlap_problems). The backup directory is judged by its owner record, and
        where that is lost, by its own state and timeline (ownership.local_ownership); the
        `--backup-to` prefix by its owner object, and where there is none, by whether this
        backup directory's own journal of that destination says it wrote the objects there.
        Raises DestinationError, one line for all, naming whose each refused destination is.
        Under --check-only nothing is written.
        """
        me = self.identity()
        local = self.dest / META / OWNER_NAME
        s3_key = None
        client = None
        theirs_s3: Any = None
        foreign = False
        above: list[tuple[str, Any]] = []
        if self.s3 is not None and self.writes_backup_to():
            client = make_client(self.endpoint)
            s3_key = self.s3.key(f"{META}/{OWNER_NAME}")
            journal = f"s3-{state_tag(str(client.meta.endpoint_url), self.s3.url)}"
            try:
                theirs_s3, foreign, above = s3_evidence(
                    client, self.s3.bucket, self.s3.prefix, self.dest, journal
                )
            except Exception as exc:  # noqa: BLE001 - one line, never a traceback wall
                code = getattr(exc, "response", {}).get("Error", {}).get("Code")
                raise DestinationError(
                    f"--backup-to {self.s3.url}: owner record not readable: {code or exc}"
                ) from None
        problems, verdict = claim_problems(
            me,
            self.places(),
            self.dest,
            s3_url=self.s3.url if client is not None and self.s3 is not None else None,
            s3_record=theirs_s3,
            s3_key=s3_key or "",
            s3_foreign=foreign,
            s3_above=above,
            meta=META,
        )
        if verdict is not None and verdict.status == MINE:
            s3_key = None  # already ours
        if problems:
            raise DestinationError(
                "; ".join(problems)
                + f"; this node is {describe(dict(me, claimed=''))}: give it a place of its own "
                "(a template with {host}, or a new --backup-dir/--backup-to)"
            )
        if self.check_only:
            return
        self._stake = (me, None if local.exists() else local, client, s3_key)

    def stake(self) -> None:
        """Write the owner records `claim` found missing: once step 1's preflight passed, not before.

        A run refused before any change leaves no trace at its destinations, an owner record included.
        """
        if self._stake is None:
            return
        me, local, client, s3_key = self._stake
        self._stake = None
        if local is not None:
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f".{OWNER_NAME}.tmp")
            tmp.write_text(json.dumps(me, indent=1) + "\n")
            os.replace(tmp, local)
        if client is not None and s3_key is not None and self.s3 is not None:
            client.put_object(Bucket=self.s3.bucket, Key=s3_key, Body=json.dumps(me, indent=1).encode())
        held, self._events = self._events, []
        with open(self.meta / "timeline.jsonl", "a") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in held)
        self._write_environ()

    # ---------------------------------------------------------------- 1 inventory

    def take_inventory(self) -> dict[str, Any]:
        """Read host facts, processes, GPU use and the manifest's files in one round trip."""
        started = time.monotonic()
        reqs: list[dict[str, Any]] = [
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
            # the environments of the processes the run may stop, read before any is stopped
            credentials.environ_request(),
        ]
        before = getattr(self.conn, "round_trips", 0)
        hello, procs, walk, gpus, apps, df, env = self.conn.batch(reqs)
        for res in (hello, procs, walk):
            if isinstance(res, Exception):
                raise res
        table = ProcessTable.from_result(procs)
        selected = table.select(self.manifest.stop)
        self.note_environ(env, {p.pid: (p.starttime, redact(p.cmdline)[:80]) for p, _ in selected})
        listing = self.backup.listing_from(walk)
        gpu_rows = csv_rows(gpus["stdout"]) if isinstance(gpus, dict) and gpus.get("rc") == 0 else []
        app_rows = csv_rows(apps["stdout"]) if isinstance(apps, dict) and apps.get("rc") == 0 else []
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

    def note_environ(self, reply: Any, processes: dict[int, tuple[int, str]]) -> None:
        """Keep the credentials in the environments of the processes to stop (and those of earlier runs).

        Read in the inventory's round trip, before any process is stopped; kept in the backup
        directory's `.gpuhost/credentials-environ.jsonl` (kinds, places, fingerprints: no value) so
        that a rerun, after the processes are gone, still names them. Nothing is written under
        --check-only.
        """
        found, self.environ_error = credentials.environ_findings(reply, processes)
        path = self.dest / META / "credentials-environ.jsonl"
        known: list[credentials.Finding] = []
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    known.append(credentials.Finding.from_record(json.loads(line)))
        new = [f for f in found if f not in known]
        self.environ_findings = known + new
        if self.check_only:
            return
        self._environ_pending += new
        if self._stake is None:  # a run whose step 1 has not passed its preflight writes nothing yet
            self._write_environ()

    def _write_environ(self) -> None:
        pending, self._environ_pending = self._environ_pending, []
        if pending:
            with open(self.meta / "credentials-environ.jsonl", "a") as f:
                f.writelines(json.dumps(n.record()) + "\n" for n in pending)

    def s3_cats(self) -> list[str]:
        """The manifest's categories marked s3."""
        return [c.name for c in self.manifest.categories if c.s3]

    # ---------------------------------------------------------------- files already in S3

    def in_place_cats(self) -> list[str]:
        """The manifest's categories with a root already in S3 (in_s3)."""
        return [c.name for c in self.manifest.categories if c.in_s3]

    def check_in_place(self, listing: Listing) -> InPlaceResult:
        """Prove the files under in_s3 roots where they are (reusing this run's earlier proofs).

        An S3 location that cannot be read (credentials, no such bucket) proves nothing: every
        file under it is an item with the one-line reason, and goes to the local backup.
        """
        client = make_client(self.endpoint)
        checker = InPlace(
            self.conn.connection(), self.manifest, lambda loc: client, min_proof=self.in_s3_min_proof
        )
        try:
            res = checker.check(listing, self._in_place)
        except Exception as exc:  # noqa: BLE001 - one line, never a traceback wall
            code = getattr(exc, "response", {}).get("Error", {}).get("Code") or type(exc).__name__
            why = f"S3 not readable: {code}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            res = InPlaceResult(
                [Proof(f, loc.url, False, why, location=loc.url) for f, loc in checker.files(listing)]
            )
        self._in_place = res
        return res

    def local_view(self, listing: Listing) -> Listing:
        """The listing without the files proved where they already are (nothing to copy for them)."""
        proved = self._in_place.proved if self._in_place is not None else set()
        if not proved:
            return listing
        held = self.backup.state.items  # a file sent back from the local copy stays in it
        keep = [f for f in listing.files if f.key not in proved or "sha256" in held.get(f.key, {})]
        return dataclasses.replace(listing, files=keep)

    def walk_local(self) -> tuple[Listing, Listing]:
        """Walk the node; prove the in_s3 files; return (every file, those the local backup holds)."""
        listing = self.backup.walk()
        self._node_listing = listing
        if self.in_place_cats():
            self.check_in_place(listing)
        return listing, self.local_view(listing)

    def in_s3_to_backup_to(self) -> bool:
        """Whether files under in_s3 roots that are not proved there go under --backup-to."""
        return self.in_s3_send_to == "backup-to" and bool(self.in_place_cats())

    def backup_to_items(self, listing: Listing) -> tuple[list[S3Item], list[tuple[str, str]]]:
        """The S3 items to have under --backup-to, and (path, why) of those not in the local backup.

        The categories marked s3; with `--in-s3-send-to=backup-to`, also every file under an in_s3
        root that this run's in-place check did not prove, in the same layout (PREFIX/<rel>).
        """
        items, unverified = items_from_backup(self.backup, listing) if self.s3_cats() else ([], [])
        if self.in_s3_to_backup_to():
            more, missing = in_s3.to_backup_to(self._in_place, self.backup)
            items, unverified = [*items, *more], [*unverified, *missing]
        return items, unverified

    def in_place_outstanding(self) -> list[Proof]:
        """The in_s3 files the verdict still owes a proof: not proved where they are, and (with
        `--in-s3-send-to=location`) not covered elsewhere. With backup-to, --backup-to's own
        check of each object (`backup_to_items`) proves them instead."""
        return [] if self.in_s3_to_backup_to() else list(in_s3.not_proved(self._in_place))

    def in_place_summary(self) -> dict[str, Any]:
        """Counts of the latest in-place check, for the evidence (empty when there is none)."""
        r = self._in_place
        if r is None:
            return {}
        return {
            "proved": len(r.proved),
            "to_send": len(r.to_send),
            "cannot_verify": [(p.file.display, p.how) for p in r.unverifiable][:200],
            "hashed_bytes": r.hashed_bytes,
            "heads": r.heads,
            "seconds": round(r.duration, 3),
        }

    def in_place_line(self) -> str:
        """'; N verified where they already are in S3 (...)' for a step's summary, or ''."""
        r = self._in_place
        if r is None or not r.proofs:
            return ""
        return (
            f"; {len(r.proved)} verified where they already are in S3, {len(r.to_send)} to send there,"
            f" {len(r.unverifiable)} that cannot be verified there"
        )

    def in_place_upload(self, url: str) -> S3Upload:
        """The uploader that sends a missing or changed file back to its in_s3 location."""
        if url not in self._in_place_uploads:
            self._in_place_uploads[url] = S3Upload(
                self.dest,
                parse_s3_url(url),
                endpoint=self.endpoint,
                progress=self.progress,
                progress_interval=2.0,
                part_size=self.part_size,
                owner_tag=self.owner_tag(),
            )
        return self._in_place_uploads[url]

    def owner_tag(self) -> str:
        """This node's tag in the metadata of every object its runs write (ownership.object_owner_tag)."""
        if self._owner_tag is None:
            self._owner_tag = object_owner_tag(self.identity())
        return self._owner_tag

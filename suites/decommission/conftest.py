"""Fixtures of suites/decommission: the node being emptied and where its files go."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.exec.s3io import location_problem
from pytest_gpuhost.modules.backup.destination import DestinationError, per_target
from pytest_gpuhost.modules.backup.local import Manifest, Progress, load_manifest
from pytest_gpuhost.modules.backup.ownership import run_overlaps
from pytest_gpuhost.modules.backup.s3 import parse_s3_url
from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.remediation import Remediation, WouldFix
from pytest_gpuhost.run.targets_stash import targets_key

from . import options, preflight
from .node import Decommission


def _progress_sink(config: pytest.Config) -> Any:
    """Print progress lines on the terminal (capture suspended), or on stderr under xdist."""
    say = _line_sink(config)

    def sink(p: Progress) -> None:
        say(p.line())

    return sink


def _line_sink(config: pytest.Config) -> Any:
    """Print one line, "decommission TEXT" (redacted, control characters shown), as progress lines are."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    worker = hasattr(config, "workerinput")

    def sink(text: str) -> None:
        line = "decommission " + printable(redact(text))
        evidence.current().note(line)
        if tr is not None and capman is not None and not worker:
            with capman.global_and_fixture_disabled():
                tr.write_line(line)
        elif sys.__stderr__ is not None:
            sys.__stderr__.write(line + "\n")

    return sink


def destinations(config: pytest.Config, target_name: str) -> tuple[str, str | None]:
    """Return this target's backup directory and S3 URL, one place per target by construction.

    Refused with one line (before anything is stopped) when several targets would share a place:
    see pytest_gpuhost/modules/backup/destination.py.
    """
    names = [str(t.name) for t in config.stash.get(targets_key, [])] or [target_name]
    backup_dir, _ = options.get(config, "backup_dir")
    backup_to, _ = options.get(config, "backup_to")
    try:
        dest = per_target(backup_dir or "backups/{host}", names, option="--backup-dir")[target_name]
        url = per_target(backup_to, names, option="--backup-to")[target_name] if backup_to else None
    except DestinationError as exc:
        pytest.fail(str(exc), pytrace=False)
    return dest, url


@pytest.hookimpl(trylast=True)  # after the plugin's configure has loaded the run's targets
def pytest_configure(config: pytest.Config) -> None:
    """Refuse, as one usage error before any test runs, everything the run would need and lacks.

    Every problem is one line, and all of them are listed at once (suites/decommission/preflight.py):
    destinations that several targets would share, the options the manifest implies, backup
    directories this user cannot make, S3 locations that do not answer. No node is reached.
    """
    names = [str(t.name) for t in config.stash.get(targets_key, [])]
    if not names:
        return
    backup_dir, _ = options.get(config, "backup_dir")
    backup_to, _ = options.get(config, "backup_to")
    try:
        dirs = per_target(backup_dir or "backups/{host}", names, option="--backup-dir")
        urls = per_target(backup_to, names, option="--backup-to") if backup_to else {}
    except DestinationError as exc:
        raise pytest.UsageError(f"gpuhost: {exc}") from None
    manifest_path, _ = options.get(config, "manifest")
    if not manifest_path or config.option.collectonly or hasattr(config, "workerinput"):
        return  # no manifest: the steps say so; --co touches nothing; xdist: the controller checked
    endpoint, _ = options.get(config, "s3_endpoint")
    send_to, _ = options.get(config, "in_s3_send_to")
    manifest = load_manifest(manifest_path)
    overlaps = run_overlaps(
        manifest, names, dirs, urls, send_to or "location", str(config.invocation_params.dir)
    )
    if overlaps:
        raise pytest.UsageError("\n".join(f"gpuhost: {printable(redact(p))}" for p in overlaps))
    problems = preflight.options_problems(manifest, backup_to=backup_to, send_to=send_to)
    here = Path(config.invocation_params.dir)
    for d in dict.fromkeys(dirs.values()):
        why = preflight.backup_dir_problem(here / d)
        if why:
            problems.append(why)
    dests = s3_destinations(manifest, list(urls.values()), in_s3_to_backup_to=send_to == "backup-to")
    problems = [printable(redact(p)).replace("\n", "\\n") for p in problems] + s3_problems(dests, endpoint)
    if problems:
        raise pytest.UsageError("\n".join(f"gpuhost: {p}" for p in problems))


def s3_destinations(
    manifest: Manifest, backup_to: list[str], *, in_s3_to_backup_to: bool = False
) -> list[tuple[str, str]]:
    """Return (s3:// URL, how the operator named it) of every S3 location the run will use, once each.

    `--backup-to` (each target's URL) when a category is marked s3, or when in_s3 files not
    proved in place go there (`--in-s3-send-to=backup-to`) ("--backup-to s3://B/P"), and each
    category's `in_s3` locations ("in_s3 s3://B/P of category data").
    """
    out: list[tuple[str, str]] = []
    if any(c.s3 or (in_s3_to_backup_to and c.in_s3) for c in manifest.categories):
        out += [(url, f"--backup-to {url}") for url in dict.fromkeys(backup_to)]
    for cat in manifest.categories:
        out += [
            (url, f"in_s3 {url} of category {cat.name}") for url in dict.fromkeys(u for _, u in cat.in_s3)
        ]
    return out


def s3_problems(dests: list[tuple[str, str]], endpoint: str | None) -> list[str]:
    """Check that every destination can be read, before anything is stopped; one line per one that cannot.

    Each is asked what the run asks first (`location_problem`: HeadBucket, then a listing of one
    key under the prefix); nothing is written, so a bucket that lists but refuses writes is
    still found only by the upload itself.
    """
    problems = []
    for url, named in dests:
        why = location_problem(url, endpoint=endpoint)
        if why is not None:
            problems.append(printable(redact(f"{named}: {why}")).replace("\n", "\\n"))
    return problems


@pytest.fixture(scope="module")
def decom(target: Any, check_only: bool, pytestconfig: pytest.Config) -> Iterator[Decommission]:
    """The Decommission of the current target (module scope: shared by the eight steps)."""
    manifest_path, _ = options.get(pytestconfig, "manifest")
    if not manifest_path:
        pytest.fail("no manifest: pass --manifest=PATH (see fixtures/manifests/README.md)", pytrace=False)
    manifest = load_manifest(manifest_path)
    backup_dir, backup_to = destinations(pytestconfig, target.name)
    dest = Path(backup_dir)
    if not dest.is_absolute():
        dest = Path(pytestconfig.invocation_params.dir) / dest
    endpoint, _ = options.get(pytestconfig, "s3_endpoint")
    d = Decommission(
        target,
        manifest=manifest,
        dest=dest,
        check_only=check_only,
        s3=parse_s3_url(backup_to) if backup_to else None,
        endpoint=endpoint,
        progress=_progress_sink(pytestconfig),
        say=_line_sink(pytestconfig),
        record=lambda label, value: evidence.current().state(label, value, target=target.name),
        measure=lambda n, v, unit=None: evidence.current().measure(n, v, unit, target=target.name),
        gpu_idle_mib=int(manifest.options.get("gpu_idle_mib", 256)),
        gpu_idle_timeout=float(manifest.options.get("gpu_idle_timeout", 30)),
        stall_timeout=options.tuning(pytestconfig, "decommission_stall_timeout"),
        part_size=int(options.tuning(pytestconfig, "decommission_s3_part_mib") * 1024 * 1024),
        in_s3_send_to=options.get(pytestconfig, "in_s3_send_to")[0] or "location",
        fixes=options.fixes(pytestconfig),
        credentials_left=options.get(pytestconfig, "credentials_left")[0] or "report",
        in_s3_min_proof=options.get(pytestconfig, "in_s3_min_proof")[0] or "crc64",
    )
    refused = None
    try:
        d.claim()  # before the first step: a destination another node's backup holds is refused
    except DestinationError as exc:
        refused = str(exc)
    except Exception as exc:  # noqa: BLE001 - one line: nothing is stopped without this check
        first = str(exc).splitlines()[0] if str(exc) else ""
        refused = f"could not tell whose backup the destinations hold: {type(exc).__name__}: {first}"
    if refused is not None:
        d.finish()
        pytest.fail(f"gpuhost: {printable(redact(refused))}", pytrace=False)
    yield d
    d.finish()


@pytest.fixture
def step(decom: Decommission, remediate: Any) -> Any:
    """Run one step through `remediate` and remember its outcome for "safe to terminate"."""

    def run(rem: Remediation) -> Any:
        name = rem.name
        try:
            out = remediate(rem)
        except pytest.skip.Exception:
            decom.outcomes[name] = "skipped"
            raise
        except WouldFix:
            decom.outcomes[name] = "would fix"
            raise
        except BaseException:
            decom.outcomes[name] = "failed"
            raise
        decom.outcomes[name] = out.outcome
        return out

    return run

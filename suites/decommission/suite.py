"""suites/decommission declared: its options, its procedure, its eight steps, its preconditions.

The tests of test_decommission.py are made from `STEPS` (run/suite.py). The preconditions are
checked at configure, before any node is reached, and all of them are listed at once in one
usage error (preflight.py): destinations that several targets would share, the options the
manifest implies, backup directories this user cannot make, S3 locations that do not answer.
The verdict is the last step's (notes.py `step_safe_to_terminate`), which always runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.modules.backup.destination import DestinationError
from pytest_gpuhost.modules.backup.ownership import run_overlaps
from pytest_gpuhost.modules.backup.s3 import parse_s3_url
from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.suite import Configured, StepSpec, Suite

from . import preflight
from .credentials import step_credentials_left
from .node import Decommission
from .notes import step_notes_saved, step_safe_to_terminate
from .options import DecommissionOptions, settle
from .stop import step_gpus_idle, step_inventory, step_servers_stopped
from .transfer import step_artifacts_backed_up, step_data_in_s3

__all__ = ["STEPS", "SUITE"]

Step = StepSpec[Decommission]

STEPS: tuple[Step, ...] = (
    Step(
        "inventory",
        "Host facts, GPU processes, servers to stop and the manifest's files, in one round trip.",
        step_inventory,
    ),
    Step(
        "servers stopped",
        "The manifest's servers are stopped (SIGTERM, bounded wait, SIGKILL), and nothing else.",
        step_servers_stopped,
    ),
    Step("gpus idle", "No compute process on any GPU, memory back to baseline.", step_gpus_idle),
    Step(
        "artifacts backed up",
        "Every manifest file is in the local backup, SHA-256 checked against the node's.",
        step_artifacts_backed_up,
    ),
    Step(
        "data in s3",
        "The categories marked s3 are in the bucket with the same SHA-256; no upload left open.",
        step_data_in_s3,
    ),
    Step(
        "credentials left",
        "No credential left on the node: each listed by kind, place and fingerprint; --fix=scrub removes them.",
        step_credentials_left,
    ),
    Step(
        "notes saved", "NOTES.md says what the node was, what ran, what was kept and where.", step_notes_saved
    ),
    Step(
        "safe to terminate",
        "Every step passed or was fixed and every byte is verified at its destination.",
        step_safe_to_terminate,
        final=True,
    ),
)


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


def _procedure(
    target: Any, opts: DecommissionOptions, check_only: bool, config: pytest.Config
) -> Decommission:
    """The Decommission of a target; refused (every step errors) when its destinations are another's."""
    if opts.loaded is None:
        pytest.fail("no manifest: pass --manifest=PATH (see fixtures/manifests/README.md)", pytrace=False)
    backup_dir, backup_to = opts.destinations(str(target.name))
    dest = Path(backup_dir)
    if not dest.is_absolute():
        dest = Path(config.invocation_params.dir) / dest
    say = _line_sink(config)
    d = Decommission(
        target,
        opts,
        manifest=opts.loaded,
        dest=dest,
        check_only=check_only,
        s3=parse_s3_url(backup_to) if backup_to else None,
        progress=lambda p: say(p.line()),
        say=say,
        record=lambda label, value: evidence.current().state(label, value, target=target.name),
        measure=lambda n, v, unit=None: evidence.current().measure(n, v, unit, target=target.name),
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
    return d


def _preconditions(ctx: Configured[DecommissionOptions]) -> list[str]:
    """Everything the run would need and lacks, one line each; no node is reached."""
    opts, config = ctx.options, ctx.config
    if not ctx.targets or opts.loaded is None:
        return []  # no manifest: the steps say so
    if config.option.collectonly or hasattr(config, "workerinput"):
        return []  # --co touches nothing; xdist: the controller checked
    here = Path(config.invocation_params.dir)
    overlaps = run_overlaps(opts.loaded, ctx.targets, opts.dirs, opts.urls, opts.in_s3_send_to, str(here))
    if overlaps:
        return [printable(redact(p)) for p in overlaps]
    problems = preflight.options_problems(opts.loaded, backup_to=opts.backup_to, send_to=opts.in_s3_send_to)
    for d in dict.fromkeys(opts.dirs.values()):
        why = preflight.backup_dir_problem(here / d)
        if why:
            problems.append(why)
    dests = preflight.s3_destinations(
        opts.loaded, list(opts.urls.values()), in_s3_to_backup_to=opts.in_s3_send_to == "backup-to"
    )
    problems = [printable(redact(p)).replace("\n", "\\n") for p in problems]
    return problems + preflight.s3_problems(dests, opts.s3_endpoint)


SUITE: Suite[DecommissionOptions, Decommission] = Suite(
    name="decommission",
    options=DecommissionOptions,
    procedure=_procedure,
    steps=STEPS,
    settle=settle,
    preconditions=_preconditions,
)

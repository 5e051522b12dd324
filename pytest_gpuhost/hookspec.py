"""Hooks that projects and plugins implement to steer pytest-gpuhost.

Implement them in a `conftest.py` or a plugin; the plugin registers these specs in
`pytest_addhooks`, so pytest validates implementations against them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_gpuhost.run.remediation import Action, Check, Outcome, Remediation

hookspec = pytest.hookspec


@hookspec
def pytest_gpuhost_targets(config: pytest.Config, targets: list[Any]) -> None:
    """Filter or extend the list of targets before any test is collected.

    Called once per process (controller and every xdist worker) from `pytest_configure`, after
    `--host` and `--inventory` are parsed into `TargetSpec`s. `targets` is the list itself: remove,
    reorder or append `TargetSpec`s in place (use `pytest_gpuhost.exec.targets.parse_host_url`). Every
    xdist worker must end with the same list in the same order, so decide from `config` and the
    specs only, never from timing or randomness. `--limit` is applied after every implementation
    (a hook wrapper in `pytest_gpuhost.report.fleet`), so it also filters the targets added here.
    The final list is in `config.stash[pytest_gpuhost.run.targets_stash.targets_key]`. The return
    value is ignored.
    """


@hookspec(firstresult=True)
def pytest_gpuhost_reads_up_front(config: pytest.Config) -> bool | None:
    """Say whether the suite reads every target it checks at the end of collection, all at once.

    Called once, in the controller, from `pytest_configure` (so a suite's top conftest can answer:
    suites/health does). True lets a `--check-only` run of a few targets (at most
    `run.scheduling.IN_PROCESS_HOSTS`) run in the controller without xdist workers: its tests
    only judge what was read, and a worker would cost a Python start. None (no answer) keeps the
    workers for more than one target, since a suite that reads each host in its tests needs
    them to check hosts side by side.
    """


@hookspec(firstresult=True)
def pytest_gpuhost_before_fix(
    item: pytest.Item, target: Any, remediation: Remediation, actions: list[Action], check_only: bool
) -> str | None:
    """Veto or extend a fix before it runs; return a reason string to veto.

    Called after a check failed and the remediation planned its `actions`, before its `fix` runs.
    It is also called under `--check-only` (`check_only` is True) so that the planned actions the
    report shows are the ones that would really run; there the hook must not change anything.
    `target` is the test's `Target` (None for a test without one). Append `Action`s to `actions`
    to run more (the remediation's `fix` receives the same list). Return a non-empty string to
    veto: the fix does not run and the test fails with outcome "failed" and "vetoed: REASON".
    The first non-None result wins.
    """


@hookspec
def pytest_gpuhost_after_fix(
    item: pytest.Item,
    target: Any,
    remediation: Remediation,
    actions: list[Action],
    outcome: str,
    after: Check | None,
) -> None:
    """Observe a fix that ran: `outcome` is "fixed" or "failed".

    Called after `fix` returned (or raised) and the verification re-read the host; never under
    `--check-only` and never for a veto. `after` is the re-check (None when the re-check itself
    raised). Use it to notify, to record a journal, or to add evidence with
    `pytest_gpuhost.run.evidence.current()`. The return value is ignored.
    """


@hookspec
def pytest_gpuhost_command(target: str, result: Any) -> None:
    """Observe one command that ran on a target (already redacted).

    Called by the execution layer after every `Connection.run` and `write_file`, in the process
    that ran it (an xdist worker or the controller). `target` is the target's name and `result`
    the `CommandResult`. Keep it cheap: it runs once per command. The return value is ignored.
    """


@hookspec
def pytest_gpuhost_outcome(item: pytest.Item, outcome: Outcome) -> None:
    """Observe the outcome of one remediation, whatever it was.

    Called once per `remediate(...)` call, after the outcome is decided and before the test
    continues (or fails, or is skipped). `outcome.outcome` is one of "passed", "fixed", "failed",
    "would fix", "skipped". The return value is ignored.
    """

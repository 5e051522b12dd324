"""The remediation engine: check, plan, fix, re-check; outcomes; check-only; procedures.

It follows Ansible's check-mode contract: read the state, compare, record before/after, and
only then, unless in check-only mode, act. Verification re-reads the host instead of trusting
the fix. The outcome of a remediation becomes the test's outcome:

| outcome   | pytest outcome | `report.gpuhost_outcome` |
|-----------|----------------|--------------------------|
| passed    | passed         | "passed"                 |
| fixed     | passed         | "fixed"                  |
| would fix | failed         | "would fix"              |
| failed    | failed         | "failed"                 |
| skipped   | skipped        | "skipped"                |
| cannot see| skipped (failed with `--cannot-see=fail`) | "cannot see" |

`cannot see` is a check whose input the node does not give (the kernel log denied, no systemd,
a tool missing): it neither passes nor fails the node, says what it could not read and what
would let it, and is counted apart in every output. `--cannot-see=fail` (ini
`gpuhost_cannot_see`) makes CI treat it as a failure; docs/fleet.md says why the default does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.redact import printable, redact, redact_obj
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.record import (
    CANNOT_SEE,
    FAILED,
    FIXED,
    OUTCOMES,
    PASSED,
    SKIPPED,
    TARGET_PARAM,
    WOULD_FIX,
    target_name,
)

__all__ = [
    "CANNOT_SEE",
    "OUTCOMES",
    "TARGET_PARAM",
    "Action",
    "CannotSee",
    "Check",
    "NoFixKnown",
    "Outcome",
    "Remediation",
    "Remediator",
    "RemediationFailed",
    "WouldFix",
    "remediation_from",
    "target_name",
]

# When one test runs several remediations, the test shows the worst of them.
_RANK = {PASSED: 0, SKIPPED: 0, CANNOT_SEE: 0, FIXED: 1, WOULD_FIX: 2, FAILED: 3}

PROCEDURE_MARK = "gpuhost_procedure"
FINAL_MARK = "gpuhost_final"  # a procedure's verdict step: runs even after a failed step


@dataclass
class Check:
    """The result of reading one condition on a host."""

    ok: bool
    summary: str
    state: Any = None
    skip: str | None = None
    #: what the check could not read on this node and what would let it: neither pass nor fail
    cannot_see: str | None = None


@dataclass
class Action:
    """One change a fix makes; `command` is the exact command or sysfs write."""

    description: str
    command: str
    target: str = ""
    destructive: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Return the action as a JSON-able dict."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        where = f"[{self.target}] " if self.target else ""
        return f"{where}{self.description}: {self.command}"


class NoFixKnown(GpuhostError):
    """A remediation built without `fix=` was asked to fix (the engine reports it as a failed fix)."""


class Remediation:
    """A condition to hold on a host and the way to make it hold.

    Subclass it (or build one from callables with `remediate(name=..., check=..., ...)`).
    `check` and `verify` only read; `fix` changes the host and raises when it cannot.
    """

    name: str = ""

    def check(self) -> Check:
        """Read the condition on the host."""
        raise NotImplementedError(f"{type(self).__name__}.check")

    def plan(self, before: Check) -> list[Action]:
        """Return the exact actions `fix` would take, given the failed check."""
        return []

    def fix(self, actions: list[Action], before: Check) -> None:
        """Apply `actions`; raise to report the fix as failed."""
        raise NotImplementedError(f"{type(self).__name__}.fix")

    def verify(self) -> Check:
        """Re-read the condition after the fix (default: the same check)."""
        return self.check()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class _FunctionRemediation(Remediation):
    def __init__(
        self,
        name: str,
        check: Callable[[], Check],
        plan: Callable[[Check], list[Action]] | None,
        fix: Callable[..., None] | None,
        verify: Callable[[], Check] | None,
    ) -> None:
        self.name = name
        self._check, self._plan, self._fix, self._verify = check, plan, fix, verify

    def check(self) -> Check:
        return self._check()

    def plan(self, before: Check) -> list[Action]:
        return list(self._plan(before)) if self._plan is not None else []

    def fix(self, actions: list[Action], before: Check) -> None:
        if self._fix is None:
            raise NoFixKnown(f"{self.name}: no fix is known")
        self._fix(actions, before)

    def verify(self) -> Check:
        return self._verify() if self._verify is not None else self._check()


def remediation_from(
    rem: Remediation | None = None,
    *,
    name: str | None = None,
    check: Callable[[], Check] | None = None,
    plan: Callable[[Check], list[Action]] | None = None,
    fix: Callable[..., None] | None = None,
    verify: Callable[[], Check] | None = None,
) -> Remediation:
    """Return `rem`, or a Remediation built from the callables."""
    if rem is not None:
        if check or plan or fix or verify:
            raise TypeError("pass a Remediation or callables, not both")
        if name:
            rem.name = name
        elif not rem.name:
            rem.name = type(rem).__name__
        return rem
    if check is None:
        raise TypeError("remediate() needs a Remediation or check=")
    return _FunctionRemediation(name or str(getattr(check, "__name__", "check")), check, plan, fix, verify)


@dataclass
class Outcome:
    """What one remediation ended as, with what it saw and did."""

    name: str
    outcome: str
    before: Check
    after: Check | None = None
    actions: list[Action] = field(default_factory=list)
    reason: str = ""
    target: str = ""

    def __bool__(self) -> bool:
        return self.outcome in (PASSED, FIXED)

    def to_dict(self) -> dict[str, Any]:
        """Return the outcome as a JSON-able dict (redacted)."""
        data = {
            "name": self.name,
            "outcome": self.outcome,
            "target": self.target,
            "reason": self.reason,
            "before": evidence.jsonable(self.before),
            "after": evidence.jsonable(self.after),
            "actions": [a.to_dict() for a in self.actions],
        }
        return dict(redact_obj(data))

    def describe(self) -> str:
        """Return the multi-line text shown for a failure or a would-fix."""
        lines = [f"{self.outcome}: {self.name}: {self.reason or self.before.summary}"]
        lines.append(f"  before: {self.before.summary}")
        if self.after is not None:
            lines.append(f"  after:  {self.after.summary}")
        if self.actions:
            lines.append("  actions:" if self.outcome != WOULD_FIX else "  actions that would run:")
            lines.extend(f"    - {a}" for a in self.actions)
        return printable(redact("\n".join(lines)))


class WouldFix(pytest.fail.Exception):  # type: ignore[name-defined,misc]
    """Raised by `remediate` under --check-only when a fix would run.

    A test outcome, like pytest's own `Failed`, not a GpuhostError: it derives from
    BaseException so that a suite's `except Exception` cannot swallow a test's verdict.
    """

    # As pytest does for its own outcomes: summaries then read "WouldFix: ..." without a module path.
    __module__ = "builtins"


class CannotSee(pytest.fail.Exception):  # type: ignore[name-defined,misc]
    """Raised by `remediate` for a check that cannot see its input, under `--cannot-see=fail`."""

    __module__ = "builtins"


class RemediationFailed(pytest.fail.Exception):  # type: ignore[name-defined,misc]
    """Raised by `remediate` when a fix was vetoed, raised, or did not verify."""

    __module__ = "builtins"


_outcomes_key = pytest.StashKey[list[Outcome]]()
_blocked_key = pytest.StashKey[dict[tuple[str, str], str]]()


class Remediator:
    """The `remediate` fixture: run one remediation for the current test and target."""

    def __init__(
        self, item: pytest.Item, target: Any, check_only: bool, cannot_see_fails: bool = False
    ) -> None:
        self.item = item
        self.target = target
        self.check_only = check_only
        self.cannot_see_fails = cannot_see_fails
        self.target_name = target_name(item) or str(getattr(target, "name", "") or "")

    def __call__(
        self,
        rem: Remediation | None = None,
        *,
        name: str | None = None,
        check: Callable[[], Check] | None = None,
        plan: Callable[[Check], list[Action]] | None = None,
        fix: Callable[..., None] | None = None,
        verify: Callable[[], Check] | None = None,
    ) -> Outcome:
        """Check; when the condition fails, plan and (unless check-only) fix and re-check.

        Returns the Outcome for passed and fixed; skips the test for skipped; fails it (with the
        planned actions, before and after in the message) for would fix and failed.
        """
        remediation = remediation_from(rem, name=name, check=check, plan=plan, fix=fix, verify=verify)
        ev = evidence.current()
        before = remediation.check()
        ev.state("before", before.state, target=self.target_name)
        ev.note(f"check {remediation.name}: {'ok' if before.ok else 'not ok'}: {before.summary}")
        if before.skip:
            return self._finish(
                Outcome(remediation.name, SKIPPED, before, reason=before.skip, target=self.target_name)
            )
        if before.cannot_see:
            return self._finish(
                Outcome(
                    remediation.name, CANNOT_SEE, before, reason=before.cannot_see, target=self.target_name
                )
            )
        if before.ok:
            return self._finish(Outcome(remediation.name, PASSED, before, target=self.target_name))

        actions = list(remediation.plan(before))
        hook = self.item.config.hook
        veto = hook.pytest_gpuhost_before_fix(
            item=self.item,
            target=self.target,
            remediation=remediation,
            actions=actions,
            check_only=self.check_only,
        )
        for action in actions:
            if not action.target:
                action.target = self.target_name
            ev.action(action, "planned")
        if veto:
            for action in actions:
                ev.action(action, "vetoed")
            return self._finish(
                Outcome(remediation.name, FAILED, before, None, actions, f"vetoed: {veto}", self.target_name)
            )
        if self.check_only:
            if not actions:  # nothing would run: a would-fix with no actions would promise a repair
                return self._finish(
                    Outcome(
                        remediation.name,
                        FAILED,
                        before,
                        None,
                        actions,
                        f"no fix is planned: {before.summary}",
                        self.target_name,
                    )
                )
            return self._finish(
                Outcome(remediation.name, WOULD_FIX, before, None, actions, before.summary, self.target_name)
            )

        after: Check | None = None
        reason = ""
        try:
            remediation.fix(actions, before)
        except Exception as exc:  # a fix that raises is a failed remediation, not an error
            # the plugin's own errors carry a line meant for the operator: no class name before it
            reason = str(exc) if isinstance(exc, GpuhostError) else f"fix raised {type(exc).__name__}: {exc}"
            for action in actions:
                ev.action(action, "failed")
        fix_ran = not reason
        try:
            after = remediation.verify()
        except Exception as exc:
            reason = reason or f"re-check raised {type(exc).__name__}: {exc}"
        if after is not None:
            ev.state("after", after.state, target=self.target_name)
            ev.note(f"re-check {remediation.name}: {'ok' if after.ok else 'not ok'}: {after.summary}")
        if not reason and after is not None and not after.ok:
            reason = "fix did not verify"
        result = FAILED if reason else FIXED
        if fix_ran:
            # The fix returned: its actions ran, whatever the re-check says; never left as "planned".
            for action in actions:
                ev.action(action, "done" if result == FIXED else "ran, not verified")
        hook.pytest_gpuhost_after_fix(
            item=self.item,
            target=self.target,
            remediation=remediation,
            actions=actions,
            outcome=result,
            after=after,
        )
        return self._finish(
            Outcome(remediation.name, result, before, after, actions, reason, self.target_name)
        )

    def _finish(self, outcome: Outcome) -> Outcome:
        self.item.stash.setdefault(_outcomes_key, []).append(outcome)
        self.item.config.hook.pytest_gpuhost_outcome(item=self.item, outcome=outcome)
        if outcome.outcome == SKIPPED:
            pytest.skip(f"{outcome.name}: {outcome.reason}")
        if outcome.outcome == CANNOT_SEE:
            text = printable(redact(f"cannot see: {outcome.name}: {outcome.reason}"))
            if self.cannot_see_fails:
                raise CannotSee(text, pytrace=False)
            pytest.skip(text)
        if outcome.outcome == WOULD_FIX:
            raise WouldFix(outcome.describe(), pytrace=False)
        if outcome.outcome == FAILED:
            raise RemediationFailed(outcome.describe(), pytrace=False)
        return outcome


# --- pytest integration (called from plugin.py's hooks) -------------------------------------


def outcomes_of(item: pytest.Item) -> list[Outcome]:
    """Return the remediation outcomes recorded by an item so far."""
    return item.stash.get(_outcomes_key, [])


def annotate_report(item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport) -> None:
    """Set `report.gpuhost_outcome` (and the remediations) and record procedure failures.

    The JUnit property `gpuhost_outcome` is written from it by `record.annotate`.
    """
    outcomes = outcomes_of(item)
    if report.when == "call":
        report.gpuhost_remediations = [o.to_dict() for o in outcomes]  # type: ignore[attr-defined]
    if report.failed:
        excinfo = call.excinfo
        would_fix = report.when == "call" and excinfo is not None and isinstance(excinfo.value, WouldFix)
        blind = report.when == "call" and excinfo is not None and isinstance(excinfo.value, CannotSee)
        report.gpuhost_outcome = (  # type: ignore[attr-defined]
            WOULD_FIX if would_fix else CANNOT_SEE if blind else FAILED
        )
        if not (would_fix or blind) and item.get_closest_marker(PROCEDURE_MARK) is not None:
            blocked = item.config.stash.setdefault(_blocked_key, {})
            blocked.setdefault(
                _procedure_key(item), item.originalname if isinstance(item, pytest.Function) else item.name
            )
    elif report.skipped:
        blind = report.when == "call" and any(o.outcome == CANNOT_SEE for o in outcomes)
        report.gpuhost_outcome = CANNOT_SEE if blind else SKIPPED  # type: ignore[attr-defined]
    elif report.when == "call":
        worst = max((o.outcome for o in outcomes), key=lambda o: _RANK[o], default=PASSED)
        report.gpuhost_outcome = worst if worst in (PASSED, FIXED) else PASSED  # type: ignore[attr-defined]
    else:
        report.gpuhost_outcome = PASSED  # type: ignore[attr-defined]


def _procedure_key(item: pytest.Item) -> tuple[str, str]:
    return item.nodeid.split("::", 1)[0], target_name(item)


def check_blocked(item: pytest.Item) -> None:
    """Skip a procedure step whose earlier step failed for the same target."""
    if item.get_closest_marker(PROCEDURE_MARK) is None or item.get_closest_marker(FINAL_MARK) is not None:
        return  # the verdict step must run to say exactly what is missing
    failed_step = item.config.stash.get(_blocked_key, {}).get(_procedure_key(item))
    if failed_step is not None:
        pytest.skip(f"blocked: step {failed_step} failed")

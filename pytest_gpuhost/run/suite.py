"""The suite contract: a suite is declared once, as data, and the plugin makes the rest from it.

A suite (suites/p2p, ...) declares one `Suite`:

- `name` ("p2p"): the entry point's name in pyproject.toml's `gpuhost.suites` group, the
  prefix of its ini names (`p2p_stop_timeout`) and of its help texts ("suites/p2p: ...").
- `options`: ONE dataclass whose fields are declared with `option()` (flag, help with a
  `{default}` placeholder, parser, kind). Each default is written once, in that field; the
  `Option` table (`Suite.table`), the `addoption` calls, the help texts and docs/options.md's
  table all read it from there. The values are read once, in `pytest_configure`
  (`Suite.configure`), and stashed in `config.stash`; `Suite.settings(config, vars)` returns
  them, with the target's inventory variables applied by the suite's `per_target`.
  A field declared with a plain default (no `option()`) is a setting with no flag.
- `label`: the help texts' prefix ("suites/<name>" unless given).
- `procedure`: a factory `(target, options, check_only, config) -> SuiteProcedure` (it may
  `pytest.fail` after `finish()` when the procedure cannot start: every step then errors). `SuiteProcedure`
  (a `Procedure`) owns the links, the run lock, the journal (`journal_name`) and reading what
  an interrupted run left (`old_journal`); a suite adds its own state and facts.
- `steps`: ordered `StepSpec`s (none for a suite of checks, health, whose tests come from the
  checks' declaration: it declares its options and preconditions only) (name, one-line "holds" sentence, `make(procedure) ->
  Remediation`, flags `final` and `first`). `Suite.tests(globals())` in the suite's test module
  makes one `test_<name>` per step (spaces become `_`), in order, with `holds` as its docstring,
  each running `remediate(spec.make(procedure))` through `run_step`. A step is added to
  `steps`, not written as a test.
- `settle`: `(Configured) -> options`, run once at configure after the targets are known:
  values derived from the options and the targets (a manifest loaded, a path per target); it
  may raise `Configured.sources[field].error(why)`. `preconditions`: `(Configured) -> problems`,
  checked at configure before any target is reached; every problem is listed in one usage error
  (exit 4). `refusals`: `(procedure) -> problems`, checked by the first step before its
  remediation (facts the configure could not know: "refusing to act: ...").
- `verdict`: `(procedure) -> (ok, sentence, details) | None`, said once per target at the end
  (the module fixture's teardown, after `finish()`), through `evidence.answer`
  (report/answer.py prints it first).
- `blocking`: a failed step skips the steps after it (the module is marked `gpuhost_procedure`),
  as a repair must; False for a suite of checks whose every step runs whatever the others
  found (accept). A check-only step is an `Observation`; `run_step` records every step's
  outcome (and a failed or blind step's one line) on the procedure for the final step.

The conftest of the suite holds one line: `procedure = SUITE.fixture()`. The suites' conftest
(suites/conftest.py) reads every registered suite through `registered()`, the one place that
reads the entry point group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest

from pytest_gpuhost.modules.journal import Journal
from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.options import Kind, Option, Parse, Source, read, register
from pytest_gpuhost.run.procedure import Procedure
from pytest_gpuhost.run.remediation import Action, Check, Remediation, WouldFix

__all__ = [
    "ENTRY_POINTS",
    "Configured",
    "Observation",
    "StepSpec",
    "Suite",
    "SuiteProcedure",
    "option",
    "registered",
    "run_step",
    "table_of",
]

ENTRY_POINTS = "gpuhost.suites"
_META = "gpuhost_option"

P = TypeVar("P", bound="SuiteProcedure")
O = TypeVar("O")  # noqa: E741 - the suite's options dataclass


# ------------------------------------------------------------------ options


@dataclass(frozen=True)
class _Declared:
    flag: str | None
    help: str
    parse: Parse | None
    kind: Kind
    metavar: str | None
    ini: str | None


def option(
    default: Any = None,
    *,
    flag: str | None,
    help: str,
    parse: Parse | None = None,
    kind: Kind = "value",
    metavar: str | None = None,
    ini: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """Declare one field of a suite's options dataclass as an option (flag and ini twin).

    `default` is the field's default and the option's: written here only. `ini` names the ini
    value when it is not `<suite>_<field>`; `flag` None makes an ini-only option. `factory`
    stands for a mutable default (a dict), as `dataclasses.field(default_factory=...)`.
    """
    meta = {_META: _Declared(flag, help, parse, kind, metavar, ini)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def table_of(cls: type, suite: str, *, label: str = "") -> tuple[Option, ...]:
    """Return the `Option` table of an options dataclass, in field order, defaults from its fields.

    Each help text starts with `label` ("suites/<suite>" unless given) and a colon.
    """
    out = []
    for f in dataclasses.fields(cls):
        d = f.metadata.get(_META)
        if d is None:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(
            Option(
                d.ini or f"{suite}_{f.name}",
                d.flag,
                f"{label or 'suites/' + suite}: {d.help}",
                parse=d.parse,
                default=default,
                kind=d.kind,
                metavar=d.metavar,
            )
        )
    return tuple(out)


def _fields_of(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if _META in f.metadata]


# ------------------------------------------------------------------ procedure


class SuiteProcedure(Procedure):
    """The base of every suite's procedure: links, run lock, journal, and an interrupted run's journal.

    `journal_name` is the file under the target's state directory (modules/journal.py), None
    for a suite that keeps its state elsewhere (decommission: in the backup directory);
    `outcomes` holds each step's outcome by remediation name ("passed", "fixed", "would fix",
    "skipped", "cannot see", "failed"), for a final step that judges the others; `summaries`
    the one line of a step that failed or could not see (redacted), for the same.
    """

    def __init__(self, target: Any, *, check_only: bool, journal_name: str | None) -> None:
        host, container = Procedure.links_of(target)
        journal = Journal(host, journal_name) if journal_name else None
        super().__init__(host, check_only=check_only, container=container, journal=journal)
        self.old_journal: dict[str, Any] | None = None  # what an interrupted run left (resume)
        self.outcomes: dict[str, str] = {}
        self.summaries: dict[str, str] = {}

    def take_lock(self, *, wait: float, stale_s: float, owner: dict[str, Any]) -> dict[str, Any]:
        """Take the run lock on the target (waiting up to `wait`); note a stale lock taken over."""
        assert self.journal is not None, "a suite without a journal takes no lock"
        got = self.journal.acquire(wait=wait, stale_s=stale_s, owner=owner)
        if got.get("took_over"):
            evidence.current().note(f"took over a stale lock: {got['took_over'].get('why')}")
        return got

    def interrupted(self) -> dict[str, Any] | None:
        """The journal another (interrupted) run left, None when there is none or it is this run's."""
        return self.journal.cut_run(self.old_journal) if self.journal is not None else None


# ------------------------------------------------------------------ steps


@dataclass(frozen=True)
class StepSpec(Generic[P]):
    """One step of a suite: `name` with spaces ("service stopped"), the test is `test_service_stopped`.

    `holds` is the one line that holds once it passed (the test's docstring). `make` builds the
    step's `Remediation` from the procedure. `first`: the step checks the suite's `refusals`
    before its remediation. `final`: marked `gpuhost_final`, it runs even when a step before it
    failed (the verdict step that lists what is missing).
    """

    name: str
    holds: str
    make: Callable[[P], Remediation]
    first: bool = False
    final: bool = False

    @property
    def test_name(self) -> str:
        return "test_" + self.name.replace(" ", "_")


class Observation(Remediation):
    """A check-only step: read once (the engine's re-check reads the same answer), never a fix.

    A failed check fails the test with its one line (plan raises, as a health check with no
    fix allowed does): there is nothing to plan and nothing "would fix". A check that cannot
    see skips, and `run_step` records it as "cannot see": nothing was proved.
    """

    def __init__(self, name: str, read: Callable[[], Check]) -> None:
        self.name = name
        self._read = read
        self._seen: Check | None = None

    @property
    def seen(self) -> Check | None:
        """The check's result once it ran."""
        return self._seen

    def check(self) -> Check:
        if self._seen is None:
            self._seen = self._read()
        return self._seen

    def plan(self, before: Check) -> list[Action]:
        pytest.fail(f"failed: {self.name}: {before.summary}", pytrace=False)

    def fix(self, actions: list[Action], before: Check) -> None:  # never reached: plan fails
        raise AssertionError(f"{self.name} has no fix")


def run_step(proc: SuiteProcedure, remediate: Any, rem: Remediation) -> Any:
    """Run one step's remediation for this test; remember its outcome in `proc.outcomes`.

    An `Observation` that could not see is "cannot see", its reason in `proc.summaries`; a
    failure's first line (redacted) goes to `proc.summaries` unless the step said its own.
    """
    name = rem.name
    try:
        out = remediate(rem)
    except pytest.skip.Exception:
        seen = rem.seen if isinstance(rem, Observation) else None
        if seen is not None and seen.cannot_see:
            proc.outcomes[name] = "cannot see"
            proc.summaries.setdefault(name, seen.cannot_see)
        else:
            proc.outcomes[name] = "skipped"
        raise
    except WouldFix:
        proc.outcomes[name] = "would fix"
        raise
    except BaseException as exc:
        proc.outcomes[name] = "failed"
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        proc.summaries.setdefault(name, printable(redact(first))[:300])
        raise
    proc.outcomes[name] = out.outcome
    return out


# ------------------------------------------------------------------ the suite


@dataclass
class Configured(Generic[O]):
    """What configure read for a suite: its options, where each came from, the run's target names.

    `sources[field]` is the `Source` of each option field (`.error(why)` makes the usage error
    that names the value and where it came from); `targets` is filled before `settle`.
    """

    config: pytest.Config
    options: O
    sources: dict[str, Source]
    targets: list[str]


@dataclass(frozen=True)
class Suite(Generic[O, P]):
    """One suite, declared (see the module docstring for each field)."""

    name: str
    options: type[O]
    procedure: Callable[[Any, O, bool, pytest.Config], P] | None = None
    steps: tuple[StepSpec[P], ...] = ()
    label: str = ""  # the help texts' prefix, "suites/<name>" unless given
    per_target: Callable[[O, dict[str, Any]], O] | None = None
    settle: Callable[[Configured[O]], O] | None = None
    preconditions: Callable[[Configured[O]], list[str]] | None = None
    refusals: Callable[[P], list[str]] | None = None
    verdict: Callable[[P], tuple[bool, str, list[str]] | None] | None = None
    blocking: bool = True  # a failed step skips the later ones (False: each step runs regardless)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", pytest.StashKey[Any]())

    @property
    def table(self) -> tuple[Option, ...]:
        """The suite's options, as registered (made from the options dataclass)."""
        return table_of(self.options, self.name, label=self.label)

    def addoption(self, parser: pytest.Parser) -> None:
        """Register the suite's options in the gpuhost group, each with its ini twin."""
        register(parser, self.table)

    def configure(self, config: pytest.Config) -> None:
        """Read every option once (a bad value is a usage error naming it) and stash the values."""
        values, sources = {}, {}
        for name, opt in zip(_fields_of(self.options), self.table, strict=True):
            value, source = read(config, opt)
            sources[name] = source
            if source.origin != "default":  # a default is the field's own (or its factory's)
                values[name] = value
        config.stash[self._key] = Configured(config, self.options(**values), sources, [])  # type: ignore[attr-defined]

    def check(self, config: pytest.Config) -> None:
        """Settle the values that need the targets, then check every precondition (one usage error).

        Runs after the plugin's configure has loaded the targets (suites/conftest.py, trylast),
        before collection: no target has been reached.
        """
        from pytest_gpuhost.run.targets_stash import targets_key

        ctx: Configured | None = config.stash.get(self._key, None)  # type: ignore[attr-defined]
        if ctx is None:
            return
        ctx.targets = [str(t.name) for t in config.stash.get(targets_key, [])]
        if self.settle is not None:
            ctx.options = self.settle(ctx)
        problems = self.preconditions(ctx) if self.preconditions is not None else []
        if problems:
            raise pytest.UsageError("\n".join(f"gpuhost: {p}" for p in problems))

    def in_run(self, config: pytest.Config) -> bool:
        """Whether pytest was pointed at this suite: its conftest (`<name>/conftest.py`) is loaded.

        pytest loads the conftests of its path arguments before configure (suites/pyargs.py does
        the same for `--pyargs`); every suite's `check` runs in every run, so a precondition that
        only this suite's run needs (accept's order file) asks this first.
        """
        for plugin in config.pluginmanager.get_plugins():
            path = getattr(plugin, "__file__", None)
            if path and Path(path).name == "conftest.py" and Path(path).parent.name == self.name:
                return True
        return False

    def settings(self, config: pytest.Config, target_vars: dict[str, Any] | None = None) -> O:
        """The options read at configure (defaults when the suite was not configured), for a target."""
        ctx = config.stash.get(self._key, None)  # type: ignore[attr-defined]
        opts = ctx.options if ctx is not None else self.options()
        if self.per_target is not None:
            opts = self.per_target(opts, dict(target_vars or {}))
        return opts  # type: ignore[no-any-return]

    def fixture(self) -> Any:
        """The suite's `procedure` fixture: one procedure per target, finished and judged at the end."""

        make = self.procedure
        assert make is not None, f"{self.name}: a suite with steps declares its procedure"

        def procedure(target: Any, check_only: bool, pytestconfig: pytest.Config) -> Iterator[P]:
            opts = self.settings(pytestconfig, getattr(target, "vars", None))
            proc = make(target, opts, check_only, pytestconfig)
            yield proc
            problems = proc.finish()
            said = self.verdict(proc) if self.verdict is not None else None
            if said is not None:
                ok, line, details = said
                evidence.current().answer(proc.host.name, ok and not problems, line, [*problems, *details])

        procedure.__doc__ = f"The {self.name} procedure of this target; finished at the end of the module."
        return pytest.fixture(scope="module", name="procedure")(procedure)

    def tests(self, namespace: MutableMapping[str, Any]) -> None:
        """Put one `test_<step>` per declared step into a test module's `namespace`, in order."""
        if self.blocking:
            namespace["pytestmark"] = pytest.mark.gpuhost_procedure
        for spec in self.steps:
            namespace[spec.test_name] = self._test_of(spec, namespace.get("__name__", __name__))

    def _test_of(self, spec: StepSpec[P], module: str) -> Callable[..., None]:
        suite = self

        def test(procedure: P, remediate: Any) -> None:
            if spec.first and suite.refusals is not None:
                errors = suite.refusals(procedure)
                if errors:
                    pytest.fail("refusing to act: " + "; ".join(errors), pytrace=False)
            run_step(procedure, remediate, spec.make(procedure))

        test.__name__ = test.__qualname__ = spec.test_name
        test.__module__ = module
        test.__doc__ = spec.holds
        return pytest.mark.gpuhost_final(test) if spec.final else test


# ------------------------------------------------------------------ registration


def registered(package: str) -> list[Suite[Any, Any]]:
    """Every suite of the `gpuhost.suites` entry points, in name order, imported from `package`.

    The entry points name the installed package (`gpuhost_suites.p2p.suite:SUITE`); a checkout
    imports the same files as `suites` (its conftests' package). The module is imported under
    the caller's `package`, so that the suite's tests and its conftest share one module object
    (one StashKey) whichever name pytest imported the conftest by.
    """
    out: list[Suite[Any, Any]] = []
    for ep in sorted(entry_points(group=ENTRY_POINTS), key=lambda e: e.name):
        module, _, attr = ep.value.partition(":")
        head, _, rest = module.partition(".")
        obj: Any = import_module(f"{package}.{rest}" if head == "gpuhost_suites" and rest else module)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
        if not isinstance(obj, Suite):
            raise TypeError(f"entry point {ep.name} = {ep.value}: not a Suite")
        out.append(obj)
    return out

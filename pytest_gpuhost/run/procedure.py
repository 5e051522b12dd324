"""The base of a destructive procedure: ordered steps, an undo stack, and per-connection reachability.

A suite that changes a host in several ordered steps (suites/p2p, suites/decommission) builds one
`Procedure` per target and asks it for each step's `Remediation`. Three things are shared:

- Links. Each connection the procedure uses (the host, and a container reached through it) is a
  `Link`. A call that raises `Unreachable` marks that link lost; later calls on it (and on links
  opened through it) fail at once with `LinkLost` instead of each waiting out its own timeout.
  Which target is lost is known from which link raised, never from an error's text: `pct exec`
  failing because the container stopped loses the container, not the host.
- The undo stack. Before a destructive action the step journals it (on the target, when the
  procedure has a journal) and pushes the action that puts it back. `finish()` (the module
  fixture's teardown) runs what is still pending in reverse, as pytest's monkeypatch does; an
  undo on a lost link is reported and left to the next run, which reads the journal.
- Steps. `step()` makes a Remediation from callables whose `Unreachable` errors are charged to
  the link they came from; a long step is a `ProcedureStep` subclass instead, its check, plan,
  fix and verify named methods sharing what the check found as attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pytest_gpuhost.errors import AgentError, GpuhostError, Unreachable
from pytest_gpuhost.modules.journal import Journal
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.remediation import Action, Check, Remediation

__all__ = ["Link", "LinkLost", "Procedure", "ProcedureError", "ProcedureStep", "Step", "Undo"]


class ProcedureError(GpuhostError):
    """A step cannot go on; the message is one line for the operator."""


class LinkLost(Unreachable):
    """A link of the procedure is unreachable (the connection's own error is its `__cause__`)."""


class Link:
    """One connection of a procedure (a host, or a container through it), watched for loss.

    The connection opens on first use. An `Unreachable` from any call, or any agent or connect
    error while opening, marks the link lost. A link opened through a `parent` is lost with it.
    """

    def __init__(self, name: str, opener: Callable[[], Any], *, parent: Link | None = None) -> None:
        self.name = name
        self.parent = parent
        self._opener = opener
        self._conn: Any = None
        self._lost: str | None = None
        self.lost_by: BaseException | None = None  # the exception that lost it (to charge it once)

    def __repr__(self) -> str:
        return f"<Link {self.name}{' lost' if self.lost else ''}>"

    @property
    def lost(self) -> str | None:
        """Why this link (or the one it goes through) is unreachable; None while it answers."""
        if self._lost is not None:
            return self._lost
        if self.parent is not None and self.parent.lost is not None:
            return f"through {self.parent.name}: {self.parent.lost}"
        return None

    def mark_lost(self, exc: BaseException) -> None:
        """Record that `exc` showed this link unreachable (the first reason is kept)."""
        if self._lost is None:
            self._lost = str(exc) or type(exc).__name__
            self.lost_by = exc

    def connection(self) -> Any:
        """Return the open connection (opened now if needed); raise LinkLost when the link is lost."""
        self._check()
        if self._conn is None:
            try:
                self._conn = self._opener()
            except (Unreachable, AgentError) as exc:  # it could not be opened: it cannot be reached
                self.mark_lost(exc)
                raise LinkLost(f"{self.name} unreachable: {self.lost}") from exc
        return self._conn

    def _check(self) -> None:
        why = self.lost
        if why is not None:
            raise LinkLost(f"{self.name} unreachable since: {why}")

    def _do(self, method: str, *args: Any, **kw: Any) -> Any:
        conn = self.connection()
        try:
            return getattr(conn, method)(*args, **kw)
        except Unreachable as exc:
            self.mark_lost(exc)
            # the same type family, with the link named: the report says which target is gone
            raise LinkLost(f"{self.name} unreachable: {exc}") from exc

    # The connection methods the modules call; each is watched.

    def call(self, op: str, **params: Any) -> Any:
        """Run a raw agent op (Connection.call)."""
        return self._do("call", op, **params)

    def batch(self, requests: list[dict[str, Any]]) -> list[Any]:
        """Run several agent ops in one round trip; an Unreachable among the replies loses the link."""
        replies: list[Any] = self._do("batch", requests)
        for r in replies:
            if isinstance(r, Unreachable):
                self.mark_lost(r)
        return replies

    def facts(self, *names: str, **params: Any) -> dict[str, Any]:
        """Read facts (Connection.facts)."""
        result: dict[str, Any] = self._do("facts", *names, **params)
        return result

    def run(self, command: Any, **kw: Any) -> Any:
        """Run a command (Connection.run)."""
        return self._do("run", command, **kw)

    def read_files(self, paths: Sequence[str], **kw: Any) -> Any:
        """Read files (Connection.read_files)."""
        return self._do("read_files", paths, **kw)

    def write_file(self, path: str, data: str | bytes, **kw: Any) -> Any:
        """Write a file, watched (Connection.write_file)."""
        return self._do("write_file", path, data, **kw)

    @property
    def hello(self) -> dict[str, Any]:
        """The agent's hello (kernel, hostname...), or {} when not connected."""
        return dict(getattr(self._conn, "hello", None) or {})

    @property
    def round_trips(self) -> int:
        """Round trips made on the connection so far."""
        return int(getattr(self._conn, "round_trips", 0) or 0)


@dataclass
class Undo:
    """One pending undo: what it puts back, on which link, and how."""

    key: str
    what: str
    link: Link
    fn: Callable[[], None]
    after_failure: bool = True  # False: skipped once an undo run before it has failed


class Step(Remediation):
    """A step built from callables; an `Unreachable` it raises is charged to the link it came from."""

    def __init__(
        self,
        proc: Procedure,
        name: str,
        check: Callable[[], Check],
        plan: Callable[[Check], list[Action]] | None = None,
        fix: Callable[[list[Action], Check], None] | None = None,
        verify: Callable[[], Check] | None = None,
        *,
        on: Link | None = None,
    ) -> None:
        self.proc = proc
        self.name = name
        self.on = on or proc.host
        self._c, self._p, self._f, self._v = check, plan, fix, verify

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Unreachable as exc:
            # raised by a raw connection (not a Link): charge it to the link the step runs on
            if not isinstance(exc, LinkLost) and not any(x.lost_by is exc for x in self.proc.links):
                self.on.mark_lost(exc)
            raise

    def check(self) -> Check:
        result: Check = self._guard(self._c)
        return result

    def plan(self, before: Check) -> list[Action]:
        return list(self._guard(self._p, before)) if self._p is not None else []

    def fix(self, actions: list[Action], before: Check) -> None:
        if self._f is None:
            raise ProcedureError(f"{self.name}: no fix is known")
        self._guard(self._f, actions, before)

    def verify(self) -> Check:
        result: Check = self._guard(self._v or self._c)
        return result


class Procedure:
    """Steps, undo stack and links of one procedure run against one target.

    Subclasses build their steps with `step()`, journal each destructive action with `record()`
    before taking it, and may override `unfinished()` to name what a later run must complete.
    """

    def __init__(
        self,
        host: Link,
        *,
        check_only: bool,
        container: Link | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.host = host
        self.container = container
        self.check_only = check_only
        self.journal = journal
        self._undo: list[Undo] = []

    @staticmethod
    def links_of(target: Any) -> tuple[Link, Link | None]:
        """Return the target's host link and its container's link (None when it has none).

        The container's connection opens on first use, so a stopped container fails the steps
        that need it, not the fixture that builds the procedure.
        """
        host = Link(str(target.name), lambda: target.conn)
        spec = getattr(getattr(target, "spec", None), "container", None)
        if spec is None:
            return host, None
        name = f"{target.name}/{getattr(spec, 'name', 'container')}"
        return host, Link(name, lambda: target.container_conn, parent=host)

    @property
    def links(self) -> list[Link]:
        """The procedure's links, host first."""
        return [self.host] + ([self.container] if self.container is not None else [])

    def step(
        self,
        name: str,
        check: Callable[[], Check],
        plan: Callable[[Check], list[Action]] | None = None,
        fix: Callable[[list[Action], Check], None] | None = None,
        verify: Callable[[], Check] | None = None,
        *,
        on: Link | None = None,
    ) -> Step:
        """Return one step: `name` is the condition that holds once it passes ("service stopped")."""
        return Step(self, name, check, plan, fix, verify, on=on)

    # ------------------------------------------------------------------ undo stack

    def record(self, what: str, **detail: Any) -> None:
        """Journal one destructive action on the target before it is taken (no-op without a journal)."""
        if self.journal is not None:
            self.journal.step(what, **detail)

    def push_undo(
        self, key: str, what: str, fn: Callable[[], None], *, link: Link, after_failure: bool = True
    ) -> None:
        """Push the undo of an action about to be taken; a key already pending keeps its place."""
        if not any(u.key == key for u in self._undo):
            self._undo.append(Undo(key, what, link, fn, after_failure))

    def resolve(self, key: str) -> None:
        """Drop a pending undo: its step has put things back itself."""
        self._undo = [u for u in self._undo if u.key != key]

    def pending(self) -> list[Undo]:
        """The undos not run yet, oldest first."""
        return list(self._undo)

    def undo(self) -> list[str]:
        """Run the pending undos in reverse; return the problems (an unreachable link's undo is one).

        Every undo is tried: an undo on a lost link is skipped and reported, the others still run.
        """
        problems: list[str] = []
        while self._undo:
            u = self._undo.pop()
            how = "done"
            if u.link.lost is not None:
                how = f"not done: {u.link.name} unreachable ({u.link.lost})"
            elif problems and not u.after_failure:
                how = "not done: an undo before it failed"
            else:
                try:
                    u.fn()
                except Unreachable as exc:
                    if not isinstance(exc, LinkLost):
                        u.link.mark_lost(exc)
                    how = f"not done: {u.link.name} unreachable ({u.link.lost or exc})"
                except Exception as exc:  # noqa: BLE001 - one failed undo must not stop the others
                    how = f"failed: {type(exc).__name__}: {exc}"
            evidence.current().note(f"undo [{u.link.name}] {u.what}: {how}")
            if how != "done":
                problems.append(f"{u.what}: {how}")
        return problems

    def unfinished(self) -> list[str]:
        """What a later run must still complete although every undo ran (override)."""
        return []

    def reachability(self) -> dict[str, str]:
        """Each link's state for the report: "reachable", or "unreachable: why"."""
        return {x.name: "reachable" if x.lost is None else f"unreachable: {x.lost}" for x in self.links}

    def finish(self) -> list[str]:
        """End of run: undo what is pending, then retire the journal if nothing is left; return problems.

        Runs from the module fixture's teardown, whatever the steps did; under --check-only it
        does nothing. The journal stays on the target whenever a problem is left, for the next run.
        """
        if self.check_only:
            return []
        problems = self.undo() + self.unfinished()
        ev = evidence.current()
        if self.journal is not None and self.journal.held:
            if self.host.lost is not None:
                problems.append(f"{self.host.name} unreachable: the journal on it tells the next run")
            else:
                try:
                    if not problems:
                        self.journal.retire()
                    self.journal.release()
                except GpuhostError as exc:
                    if isinstance(exc, Unreachable):
                        self.host.mark_lost(exc)
                    problems.append(f"closing the journal: {exc}")
        if any(x.lost is not None for x in self.links):
            ev.state("reachability", self.reachability(), target=self.host.name)
        for p in problems:
            ev.note(f"finish: {p}")
        return problems


P = TypeVar("P", bound=Procedure)


class ProcedureStep(Step, Generic[P]):
    """A step written as a class: `check_state`, `plan_actions`, `fix_actions`, `verify_state`.

    `name` (a class attribute) is the condition that holds once it passes; `run` is the
    procedure. What the check found and the plan and fix use is kept on the instance. Errors
    are charged to the link `on` as for any `Step`; `verify_state` is the check again unless
    overridden.
    """

    name = ""

    def __init__(self, run: P, *, on: Link | None = None) -> None:
        super().__init__(
            run,
            type(self).name,
            self.check_state,
            self.plan_actions,
            self.fix_actions,
            self.verify_state,
            on=on,
        )
        self.run: P = run

    def check_state(self) -> Check:
        """Read the target: does the condition hold now?"""
        raise NotImplementedError(f"{type(self).__name__}.check_state")

    def plan_actions(self, before: Check) -> list[Action]:
        """The actions the fix would take, from what the check found (none by default)."""
        return []

    def fix_actions(self, actions: list[Action], before: Check) -> None:
        """Take the planned actions."""
        raise ProcedureError(f"{self.name}: no fix is known")

    def verify_state(self) -> Check:
        """Read the target again after the fix."""
        return self.check_state()

"""Command observers: who hears of every command and watched write a connection makes.

Observers registered here hear from every connection in the process; a connection's own
`on_command` list hears from it (and from the containers opened through it).  An observer is
called as `observer(target_name, result)` with a `CommandResult` that is already redacted and
whose outputs are clipped to `OBSERVED_OUTPUT` characters; a watched write arrives as a
`CommandResult` too (`echo VALUE > PATH`, rc 0 or the errno).  The evidence recorder in
`pytest_gpuhost.run.evidence` registers itself here: the execution layer never imports it.

Nothing is redacted when nobody listens, so a connection without observers pays nothing.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable, Iterable, Mapping

from pytest_gpuhost.exec.results import CommandResult
from pytest_gpuhost.redact import redact, redact_env

__all__ = [
    "OBSERVED_OUTPUT",
    "CommandObserver",
    "add_command_observer",
    "command_observers",
    "notify",
    "redacted",
    "remove_command_observer",
]

CommandObserver = Callable[[str, CommandResult], None]

#: Observers get at most this much of each output (reports keep far less); bounds redaction cost.
OBSERVED_OUTPUT = 1 << 20

_observers: list[CommandObserver] = []
_lock = threading.Lock()


def add_command_observer(observer: CommandObserver) -> None:
    """Have `observer` hear of every command from now on (once, however often it is added)."""
    with _lock:
        if observer not in _observers:
            _observers.append(observer)


def remove_command_observer(observer: CommandObserver) -> None:
    """Stop calling `observer`; removing one that is not registered does nothing."""
    with _lock:
        if observer in _observers:
            _observers.remove(observer)


def command_observers() -> list[CommandObserver]:
    """Return the process-wide observers, in the order they were added."""
    with _lock:
        return list(_observers)


def _clip(text: str) -> str:
    if len(text) <= OBSERVED_OUTPUT:
        return text
    return text[:OBSERVED_OUTPUT] + f"\n... [{len(text) - OBSERVED_OUTPUT} more characters not recorded]"


def redacted(result: CommandResult, env: Mapping[str, str] | None = None) -> CommandResult:
    """Return a copy of `result` fit for observers: `env` shown before the command, secrets
    masked, outputs clipped."""
    shown = result.command
    if env:
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in redact_env(env).items()) + " " + shown
    return CommandResult(
        result.target,
        redact(shown),
        result.rc,
        redact(_clip(result.stdout)),
        redact(_clip(result.stderr)),
        result.start,
        result.duration,
        result.timed_out,
    )


def notify(
    target: str,
    result: CommandResult,
    env: Mapping[str, str] | None = None,
    extra: Iterable[CommandObserver] = (),
) -> CommandResult | None:
    """Redact `result` once and hand it to the process-wide observers, then to `extra`.

    Return what the observers got, or None when there was nobody to tell.
    """
    everyone = command_observers() + list(extra)
    if not everyone:
        return None
    red = redacted(result, env)
    for observer in everyone:
        observer(target, red)
    return red

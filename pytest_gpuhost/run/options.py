"""Options declared once, as data: one `Option` per flag and ini twin, one reader for all of them.

The plugin (`run/settings.py`) and every suite (`suites/*/options.py`) declare their options as a
table of `Option`s and register it with `register`. `read` returns an option's value and a
`Source` (command line, ini file, default); a value that does not parse is a `pytest.UsageError`
that names the option, the value, where it came from and what to type instead:

    gpuhost: --command-timeout='abc': expected a number of seconds, e.g. 60
    gpuhost: ini gpuhost_check_only='maybe': expected true or false (from /srv/tox.ini)

A default is written once, in its table (or in the dataclass the table takes it from); help
texts show it through the `{default}` placeholder, so the help cannot disagree with the code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.exec.targets import MAX_TIMEOUT
from pytest_gpuhost.values import as_bool

__all__ = [
    "GROUP",
    "GROUP_HELP",
    "BadValue",
    "Option",
    "Source",
    "add_flag",
    "boolean",
    "choice",
    "existing_file",
    "lines",
    "lookup",
    "number",
    "read",
    "register",
    "seconds",
    "show_default",
    "text",
]

GROUP = "gpuhost"
GROUP_HELP = "gpuhost: verify and repair GPU hosts"

Kind = Literal["value", "flag", "list"]
Parse = Callable[[Any], Any]


class BadValue(GpuhostError):
    """An option's value does not parse; the message says what was expected (no option name).

    `item` names the one bad item of a list value (`--fix=a --fix=b`), to quote it alone.
    """

    def __init__(self, why: str, item: Any = None) -> None:
        super().__init__(why)
        self.item = item


def show_default(value: Any) -> str:
    """Render a default the way help texts show it (`60`, `0.5`, `a, b`)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Option:
    """One option: its flag, its ini twin, how its text becomes a value, its default and its help.

    `name` is the ini name and, unless `dest` says otherwise, the attribute on `config.option`.
    `flag` None makes an ini-only option. `parse` turns the raw text (or the list, for kind
    "list") into the value, checking it on the way, and raises `BadValue` saying what it
    expected; without one the value is the text, the list of texts, or `boolean` for a flag.
    A value given nowhere is never parsed: `default` is used as it is, and `{default}` in
    `help` shows it.
    """

    name: str
    flag: str | None
    help: str
    parse: Parse | None = None
    default: Any = None
    kind: Kind = "value"
    metavar: str | None = None
    dest: str | None = None

    @property
    def attr(self) -> str:
        """The attribute of `config.option` that holds the command-line value."""
        return self.dest or self.name

    @property
    def help_text(self) -> str:
        """The help with the default filled in."""
        return self.help.replace("{default}", show_default(self.default))


@dataclass(frozen=True)
class Source:
    """Where an option's value came from, and the raw value, to name both in an error."""

    option: Option
    origin: Literal["command line", "ini", "default"]
    raw: Any = None
    file: str | None = None

    def __str__(self) -> str:
        if self.origin == "command line" and self.option.flag:
            return self.option.flag
        if self.origin == "ini" or self.option.flag is None:
            return f"ini {self.option.name}"
        return f"default {self.option.flag}"

    def error(self, why: str, raw: Any = None) -> pytest.UsageError:
        """Return the usage error for this value (or one item `raw` of it): name, value, source, fix."""
        value = self.raw if raw is None else raw
        message = f"gpuhost: {self}={value!r}: {why}"
        if self.origin == "ini" and self.file:
            message += f" (from {self.file})"
        return pytest.UsageError(message)


# ------------------------------------------------------------------ registering


def add_flag(group: pytest.OptionGroup, opt: Option) -> None:
    """Add one option's command-line flag to `group` (its ini twin is `register`'s business)."""
    if opt.flag is None:
        return
    if opt.kind == "flag":
        group.addoption(opt.flag, action="store_true", dest=opt.attr, default=None, help=opt.help_text)
    else:
        action = "append" if opt.kind == "list" else "store"
        group.addoption(
            opt.flag, action=action, dest=opt.attr, default=None, metavar=opt.metavar, help=opt.help_text
        )


def register(parser: pytest.Parser, table: Iterable[Option], *, except_flags: Sequence[str] = ()) -> None:
    """Register a table of options in the gpuhost group, each flag with its ini twin.

    `except_flags` are registered as ini names only (their flag is added later, see
    `settings.add_sudo_if_missing`).
    """
    group = parser.getgroup(GROUP, GROUP_HELP)
    for opt in table:
        if opt.flag not in except_flags:
            add_flag(group, opt)
        if opt.kind == "list":
            parser.addini(opt.name, opt.help_text, type="linelist", default=None)
        else:  # parsed by `read`, so that a bad value is named like a bad flag
            parser.addini(opt.name, opt.help_text, type="string", default=None)


# ------------------------------------------------------------------ reading


def lookup(config: pytest.Config, opt: Option) -> Source:
    """Return where an option's raw value comes from: the command line, else the ini file, else none."""
    if opt.flag is not None:
        cli = config.getoption(opt.attr, default=None)
        if cli is not None and cli is not False and cli != []:
            return Source(opt, "command line", cli)
    ini = config.getini(opt.name)
    if ini not in (None, "", []):
        return Source(opt, "ini", ini, _ini_file(config, opt.name))
    return Source(opt, "default", opt.default)


def _ini_file(config: pytest.Config, name: str) -> str | None:
    """Say where an ini value was set: `-o NAME=...` on the command line, else the ini file."""
    overrides = config.getoption("override_ini", default=None) or []
    if any(str(o).split("=", 1)[0].strip() == name for o in overrides):
        return "-o on the command line"
    return str(config.inipath) if config.inipath else None


def read(config: pytest.Config, opt: Option) -> tuple[Any, Source]:
    """Return an option's value and its source; raise `pytest.UsageError` when it does not parse."""
    source = lookup(config, opt)
    if source.origin == "default":
        return opt.default, source
    parse = opt.parse or {"list": _texts, "flag": boolean}.get(opt.kind, text)
    try:
        return parse(source.raw), source
    except BadValue as exc:
        raise source.error(str(exc), raw=exc.item) from None


# ------------------------------------------------------------------ parsers


def text(raw: Any) -> str:
    """Take the value as it is written."""
    return str(raw).strip()


def _texts(raw: Any) -> list[str]:
    items = raw if isinstance(raw, list | tuple) else str(raw).splitlines()
    return [str(item).strip() for item in items if str(item).strip()]


def lines(raw: Any) -> list[str]:
    """Take a repeated flag, or an ini value of one item a line; commas separate items too."""
    items = raw if isinstance(raw, list | tuple) else str(raw).splitlines()
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def boolean(raw: Any) -> bool:
    """Take true/false, yes/no, on/off or 1/0 (values.as_bool)."""
    try:
        return as_bool(raw)
    except ValueError:
        raise BadValue("expected true or false") from None


def seconds(raw: Any) -> float:
    """Take a number of seconds greater than 0."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise BadValue("expected a number of seconds, e.g. 60") from None
    if not 0 < value <= MAX_TIMEOUT:  # also false for NaN and inf
        raise BadValue(f"expected a number of seconds greater than 0 and at most {MAX_TIMEOUT:.0f} (a week)")
    return value


def number(low: float, high: float, *, integer: bool = False) -> Parse:
    """Return a parser for a number from `low` to `high` (a whole number with `integer`)."""
    span = f"give a value from {low:g} to {high:g}"

    def parse(raw: Any) -> float | int:
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise BadValue(f"not a number; {span}") from None
        if not low <= value <= high:
            raise BadValue(f"out of range; {span}")
        if integer:
            if value != int(value):
                raise BadValue(f"not a whole number; {span}")
            return int(value)
        return value

    return parse


def choice(*choices: str) -> Parse:
    """Return a parser for one of `choices`."""

    def parse(raw: Any) -> str:
        value = str(raw).strip()
        if value not in choices:
            raise BadValue("choose one of " + ", ".join(choices))
        return value

    return parse


def existing_path(raw: Any) -> str:
    """Take the path of a file or directory that exists (`~` is expanded when checking)."""
    path = str(raw).strip()
    if not Path(path).expanduser().exists():
        raise BadValue("no such file or directory")
    return path


def existing_file(raw: Any) -> str:
    """Take the path of a file that exists (`~` is expanded when checking)."""
    path = str(raw).strip()
    if not Path(path).expanduser().is_file():
        raise BadValue("no such file")
    return path

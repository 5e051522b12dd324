"""systemd's ``EnvironmentFile=`` syntax, read as systemd reads it, never through a shell.

systemd.exec(5) (systemd 252, ``EnvironmentFile=``; upstream
https://github.com/systemd/systemd/blob/main/man/systemd.exec.xml): "Empty lines, lines without
an "=" separator, or lines starting with ";" or "#" will be ignored"; an unquoted value follows
the backslash rules of unquoted POSIX shell text, "but unlike in a shell, interior whitespace is
preserved and quotes after the first non-whitespace character are preserved"; "A line ending
with a backslash will be continued to the following one"; a '-quoted value may span lines and
knows no escapes; in a "-quoted value a backslash keeps one of ``"\\`$``, joins lines before a
newline, and is kept with any other character. The file is data: nothing in it is run.

`parse` transcribes ``parse_env_file_internal`` of src/basic/env-file.c
(https://github.com/systemd/systemd/blob/0002453b101dc85db2be76703a85297a59c646a9/src/basic/env-file.c)
state for state: a key runs to ``=`` (trailing blanks dropped; a newline first drops the line);
blanks before the value are skipped; after a closing quote the value goes on (``"a"b`` is ``ab``,
``"a" "b"`` too) while a quote inside an unquoted value is kept (``a"b"`` stays ``a"b"``); trailing
blanks of an unquoted value are dropped. A comment line that ends in a backslash does not swallow
the next line from v254 on (the COMMENT_ESCAPE state; before v254 it did, systemd/systemd#27975):
this module reads it as v254 does, so on older systemd it may report a line systemd ignores.
Then, as the service manager passes each file's assignments through ``strv_env_clean``
(``exec_context_load_environment``, src/core/execute.c), one whose name is not a valid variable
name is dropped: ``export NAME=value`` sets nothing (its key is ``export NAME``). A later
assignment of the same name wins.
"""

from __future__ import annotations

import re

__all__ = ["MAX_BYTES", "parse"]

# an environment file that sets NCCL variables is a few lines; a bigger one is read this far
MAX_BYTES = 256 << 10

_WHITESPACE = " \t\n\r"
_NEWLINE = "\n\r"
_COMMENTS = "#;"
_SHELL_NEED_ESCAPE = '"\\`$'
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # env_name_is_valid (src/basic/env-util.c)


def parse(text: str) -> dict[str, str]:
    """Return the assignments systemd takes from an ``EnvironmentFile=``'s text (later ones win)."""
    out: dict[str, str] = {}
    state = "PRE_KEY"
    key: list[str] = []
    value: list[str] = []
    key_ws: int | None = None  # where trailing blanks of the key start
    value_ws: int | None = None  # where trailing blanks of an unquoted value start

    def push(strip_value: bool) -> None:
        k = "".join(key[:key_ws] if key_ws is not None else key)
        v = "".join(value[:value_ws] if strip_value and value_ws is not None else value)
        if _NAME.match(k):
            out[k] = v

    for c in text:
        if state == "PRE_KEY":
            if c in _COMMENTS:
                state = "COMMENT"
            elif c not in _WHITESPACE:
                state, key, key_ws = "KEY", [c], None
        elif state == "KEY":
            if c in _NEWLINE:
                state, key = "PRE_KEY", []
            elif c == "=":
                state, value, value_ws = "PRE_VALUE", [], None
            else:
                if c not in _WHITESPACE:
                    key_ws = None
                elif key_ws is None:
                    key_ws = len(key)
                key.append(c)
        elif state == "PRE_VALUE":
            if c in _NEWLINE:
                push(False)
                state, key, value = "PRE_KEY", [], []
            elif c == "'":
                state = "SINGLE_QUOTE_VALUE"
            elif c == '"':
                state = "DOUBLE_QUOTE_VALUE"
            elif c == "\\":
                state = "VALUE_ESCAPE"
            elif c not in _WHITESPACE:
                state = "VALUE"
                value.append(c)
        elif state == "VALUE":
            if c in _NEWLINE:
                push(True)
                state, key, value = "PRE_KEY", [], []
            elif c == "\\":
                state, value_ws = "VALUE_ESCAPE", None
            else:
                if c not in _WHITESPACE:
                    value_ws = None
                elif value_ws is None:
                    value_ws = len(value)
                value.append(c)
        elif state == "VALUE_ESCAPE":
            state = "VALUE"
            if c not in _NEWLINE:  # an escaped newline is eaten
                value.append(c)
        elif state == "SINGLE_QUOTE_VALUE":
            if c == "'":
                state = "PRE_VALUE"
            else:
                value.append(c)
        elif state == "DOUBLE_QUOTE_VALUE":
            if c == '"':
                state = "PRE_VALUE"
            elif c == "\\":
                state = "DOUBLE_QUOTE_VALUE_ESCAPE"
            else:
                value.append(c)
        elif state == "DOUBLE_QUOTE_VALUE_ESCAPE":
            state = "DOUBLE_QUOTE_VALUE"
            if c in _SHELL_NEED_ESCAPE:
                value.append(c)
            elif c != "\n":
                value += ["\\", c]
        elif state == "COMMENT":
            if c == "\\":
                state = "COMMENT_ESCAPE"
            elif c in _NEWLINE:
                state = "PRE_KEY"
        elif state == "COMMENT_ESCAPE":
            state = "PRE_KEY" if c in _NEWLINE else "COMMENT"
    if state in ("PRE_VALUE", "VALUE", "VALUE_ESCAPE", "SINGLE_QUOTE_VALUE", "DOUBLE_QUOTE_VALUE"):
        push(state == "VALUE")
    elif state == "DOUBLE_QUOTE_VALUE_ESCAPE":
        push(False)
    return out

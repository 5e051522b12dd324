"""Where a systemd service turns NCCL off P2P: its unit, its environment files, its processes.

An operator who hit an NCCL hang often sets ``NCCL_P2P_DISABLE=1`` in the service, which keeps it
on SHM after a perfect repair. The setting can live in four places, each read here:

- the unit's ``Environment=`` (``systemctl show -p Environment``);
- each ``EnvironmentFile=`` (``systemctl show -p EnvironmentFiles``: one ``PATH (ignore_errors=no)``
  line per file, a pattern as written; each read over the connection, at most `env_file.MAX_BYTES`,
  and parsed as systemd parses it, never by a shell: pytest_gpuhost/modules/env_file.py);
- the running processes (``MainPID`` and its descendants): ``/proc/PID/environ``, the value the
  process really has, whatever set it (the unit, the manager's environment, a wrapper script);
- SGLang's and vLLM's ``--disable-custom-all-reduce`` on the command line (``/proc/PID/cmdline``,
  else ``ExecStart=``). That flag is not NCCL P2P: it turns off the servers' own all-reduce
  kernels, and NCCL still picks its transport. It is reported, never changed.

The same read names the service's Python interpreters (`ServiceEnv.pythons`), which the NCCL
collective check runs its torch program with where nccl-tests is missing (modules/nccl_run.py):
a process's ``argv[0]`` when it is an absolute path (a venv's ``bin/python``: ``/proc/PID/exe``
names the base interpreter behind the venv's symlink, which does not see the venv's packages),
``$VIRTUAL_ENV/bin/python`` and ``$CONDA_PREFIX/bin/python`` from its environment, its
``/proc/PID/exe``, and last ``ExecStart=``'s program; only names that look like a Python
(``python``, ``python3``, ``python3.11``).

``UnsetEnvironment=`` is applied as the final step when the environment is compiled
(systemd.exec(5); src/core/exec-invoke.c at
https://github.com/systemd/systemd/blob/000057e5b36d08791700af60e0585d779594cd75/src/core/exec-invoke.c:
``strv_env_merge(params->environment, our_env, joined_exec_search_path, pass_env,
context->environment, params->files_env)`` first, then, just before the command line's variables
are expanded and the program is executed, ``strv_env_delete(accum_env, 1,
context->unset_environment)``). So a drop-in with ``UnsetEnvironment=NAME`` removes NAME from
every later start, wherever the unit or the manager set it; what a wrapper sets after exec, it
cannot. A name the unit sets but also unsets is not reported; a running process keeps what it
started with until it is started again.

Every string read from the node is shown clipped and with control characters escaped.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.redact import printable

from . import env_file, nccl
from .process import ProcessTable

__all__ = [
    "CUSTOM_ALL_REDUCE",
    "DROPIN_NAME",
    "FIXABLE",
    "ServiceEnv",
    "Setting",
    "dropin_path",
    "dropin_text",
    "parse_environ",
    "parse_show",
    "read",
]

CUSTOM_ALL_REDUCE = "--disable-custom-all-reduce"  # SGLang's and vLLM's server flag
DROPIN_NAME = "gpuhost-p2p-env.conf"
# what a drop-in unsets: the settings that keep NCCL off P2P (NCCL_SHM_DISABLE is reported only)
FIXABLE = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL")
SHOW = ("Environment", "EnvironmentFiles", "UnsetEnvironment", "MainPID", "ExecStart")
MAX_FILES = 16  # EnvironmentFile= entries (patterns expanded) read per unit
MAX_PROCS = 64  # processes of the service whose environment is read
MAX_ENVIRON = 1 << 20  # bytes of one /proc/PID/environ (the kernel caps argv+env near 2 MiB)
READ_TIMEOUT = 15.0  # seconds to wait for the files' contents
_CLIP = 160
_NAMES = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE")  # what nccl.env_findings judges
_FILES = re.compile(r"^(.*) \(ignore_errors=(yes|no)\)$")
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


class _Conn(Protocol):
    name: str

    def run(self, command: Any, *, timeout: float | None = None, **kw: Any) -> Any: ...

    def call(self, op: str, **params: Any) -> Any: ...


def shown(text: str, limit: int = _CLIP) -> str:
    """A node's string as shown in a report: control characters escaped, at most `limit` characters."""
    s = printable(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


@dataclass
class Setting:
    """One place a setting that keeps NCCL off P2P is made: what, where, and whether it is unset."""

    name: str  # NCCL_P2P_DISABLE, or the flag
    text: str  # the sentence of nccl.env_findings, or the flag
    where: str  # "EnvironmentFile=/etc/default/sglang", "the environment of PID 1234 (x.service)"
    kind: str  # "unit", "file", "process", "argv"
    unset: bool = False  # the unit's UnsetEnvironment= removes it (from the next start, for a process)

    def describe(self) -> str:
        """ "NCCL_P2P_DISABLE=1 in EnvironmentFile=/etc/default/sglang"."""
        tail = ""
        if self.unset and self.kind == "process":
            tail = " (the unit's UnsetEnvironment= drops it from the next start)"
        return f"{self.text} in {self.where}{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "setting": self.text,
            "where": self.where,
            "kind": self.kind,
            "unset": self.unset,
        }


@dataclass
class ServiceEnv:
    """What a unit and its processes set that keeps NCCL off P2P, and what could not be read."""

    unit: str
    settings: list[Setting] = field(default_factory=list)
    unset: list[str] = field(default_factory=list)  # the unit's UnsetEnvironment= now
    main_pid: int = 0
    notes: list[str] = field(default_factory=list)
    pythons: list[tuple[str, str]] = field(default_factory=list)  # (interpreter, where it was seen)

    @property
    def findings(self) -> list[Setting]:
        """The settings in force: on a process always, in the unit only when not unset."""
        return [s for s in self.settings if s.kind in ("process", "argv") or not s.unset]

    @property
    def p2p_off(self) -> list[Setting]:
        """The findings that keep NCCL off P2P (not the custom all-reduce flag, not NCCL_SHM_DISABLE)."""
        return [s for s in self.findings if s.name in FIXABLE]

    def names_to_unset(self) -> list[str]:
        """The variable names a drop-in would unset (in FIXABLE's order)."""
        found = {s.name for s in self.p2p_off}
        return [n for n in FIXABLE if n in found]

    @property
    def in_processes(self) -> bool:
        """A running process of the service has one of them (it keeps it until restarted)."""
        return any(s.kind == "process" for s in self.p2p_off)

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "main_pid": self.main_pid,
            "unset_environment": self.unset,
            "findings": [s.describe() for s in self.findings],
            "settings": [s.to_dict() for s in self.settings],
            "notes": self.notes,
            "pythons": [f"{path} ({where})" for path, where in self.pythons],
        }


def _words(value: str) -> list[str]:
    try:
        return shlex.split(value)
    except ValueError:
        return value.split()


def parse_show(text: str) -> dict[str, Any]:
    """Read ``systemctl show -p Environment,EnvironmentFiles,UnsetEnvironment,MainPID,ExecStart``.

    Returns ``environment`` (dict), ``files`` ([(path, ignore_errors)]), ``unset`` (names or
    assignments), ``main_pid`` and ``exec_start`` (the argv words of the first command).
    """
    out: dict[str, Any] = {"environment": {}, "files": [], "unset": [], "main_pid": 0, "exec_start": []}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "Environment":
            out["environment"].update(nccl.parse_unit_environment(line))
        elif key == "EnvironmentFiles":
            m = _FILES.match(value)
            if m:
                out["files"].append((m[1], m[2] == "yes"))
            elif value:
                out["files"].append((value, False))
        elif key == "UnsetEnvironment":
            out["unset"] += _words(value)
        elif key == "MainPID":
            out["main_pid"] = int(value) if value.isdigit() else 0
        elif key == "ExecStart" and not out["exec_start"]:
            # { path=/usr/bin/x ; argv[]=/usr/bin/x --a b ; ignore_errors=no ; ... }
            m = re.search(r"argv\[\]=(.*?) ; ", value)
            out["exec_start"] = _words(m[1]) if m else []
    return out


def parse_environ(data: str) -> dict[str, str]:
    """Read ``/proc/PID/environ`` (NUL-separated ``NAME=value``); of a name given twice the first
    counts, as getenv(3) finds it."""
    env: dict[str, str] = {}
    for item in data.split("\0"):
        k, sep, v = item.partition("=")
        if sep and k and k not in env:  # getenv(3) returns the first match
            env[k] = v
    return env


def _is_unset(name: str, value: str, unset: list[str]) -> bool:
    """Whether ``UnsetEnvironment=`` removes NAME=VALUE (a bare name matches any value)."""
    return any(u == name or u == f"{name}={value}" for u in unset)


def _settings(env: dict[str, str], where: str, kind: str, unset: list[str]) -> list[Setting]:
    shown_env: dict[str, str] = {k: shown(env[k], 80) for k in _NAMES if k in env}
    out = []
    for text in nccl.env_findings(shown_env):
        name = text.split("=", 1)[0]
        out.append(Setting(name, text, where, kind, _is_unset(name, env[name], unset)))
    return out


def _expand(conn: _Conn, files: list[tuple[str, bool]], notes: list[str]) -> list[str]:
    """The files the unit reads: absolute paths, patterns expanded on the node, at most MAX_FILES."""
    paths: list[str] = []
    for path, _ignore in files:
        if not path.startswith("/"):
            notes.append(f"EnvironmentFile={shown(path)}: not an absolute path: not read")
            continue
        if any(c in path for c in "*?["):
            try:
                found = conn.call("glob", pattern=path)
            except GpuhostError as exc:
                notes.append(f"EnvironmentFile={shown(path)}: pattern not expanded: {shown(str(exc))}")
                continue
            paths += [str(p) for p in found if isinstance(p, str)]
        else:
            paths.append(path)
    if len(paths) > MAX_FILES:
        notes.append(f"{len(paths)} environment files: only the first {MAX_FILES} read")
    return paths[:MAX_FILES]


def read(conn: _Conn, unit: str) -> ServiceEnv:
    """Read every place `unit` (on `conn`) may set NCCL's P2P variables; nothing is changed."""
    res = ServiceEnv(unit)
    r = conn.run(["systemctl", "show", "-p", ",".join(SHOW), "--", unit], timeout=15)
    if r.rc != 0:
        res.notes.append(f"systemctl show {unit} failed (rc {r.rc}): {shown((r.stderr or r.stdout).strip())}")
        return res
    show = parse_show(r.stdout)
    res.unset, res.main_pid = list(show["unset"]), int(show["main_pid"])
    res.settings += _settings(show["environment"], f"the Environment= of {unit}", "unit", res.unset)
    paths = _expand(conn, show["files"], res.notes)
    texts, errors = _read(conn, paths, env_file.MAX_BYTES)
    file_env: dict[str, tuple[str, str]] = {}  # name -> (value, file): a later file wins
    for path in paths:
        if path not in texts:
            if not any(ignore for p, ignore in show["files"] if p == path):
                res.notes.append(f"EnvironmentFile={shown(path)}: not read: {shown(errors.get(path, ''))}")
            continue
        for k, v in env_file.parse(texts[path]).items():
            file_env[k] = (v, path)
    for name in _NAMES:
        if name in file_env:
            value, path = file_env[name]
            res.settings += _settings({name: value}, f"EnvironmentFile={shown(path)}", "file", res.unset)
    procs = _processes(conn, res.main_pid, res.notes) if res.main_pid else []
    argv_seen = False
    if procs:
        environs, _ = _read(conn, [f"/proc/{p.pid}/environ" for p in procs], MAX_ENVIRON)
        for p in procs:
            data = environs.get(f"/proc/{p.pid}/environ")
            label = f"the environment of PID {p.pid} ({unit})"
            env = parse_environ(data) if data is not None else {}
            if data is not None:
                res.settings += _settings(env, label, "process", res.unset)
            res.pythons += interpreters(p.argv, p.exe, env, f"process {p.pid} of {unit}")
            if CUSTOM_ALL_REDUCE in p.argv and not argv_seen:
                argv_seen = True
                res.settings.append(_flag(f"the command line of PID {p.pid} ({unit})"))
    if not argv_seen and CUSTOM_ALL_REDUCE in show["exec_start"]:
        res.settings.append(_flag(f"the ExecStart= of {unit}"))
    res.pythons += interpreters(show["exec_start"][:1], None, {}, f"the ExecStart= of {unit}")
    first: dict[str, str] = {}
    for path, where in res.pythons:
        first.setdefault(path, where)
    res.pythons = list(first.items())
    return res


def interpreters(
    argv: Sequence[str], exe: str | None, env: dict[str, str], where: str
) -> list[tuple[str, str]]:
    """The Python interpreters one process names, best first, each with `where` (see the docstring)."""
    out: list[str] = []
    is_python = bool(exe and _PYTHON.match(exe.rsplit("/", 1)[-1]))
    a0 = argv[0] if argv else ""
    if a0.startswith("/") and _PYTHON.match(a0.rsplit("/", 1)[-1]):
        out.append(a0)
        is_python = True
    if is_python:
        for var in ("VIRTUAL_ENV", "CONDA_PREFIX"):
            prefix = env.get(var, "")
            if prefix.startswith("/") and "\n" not in prefix:
                out.append(f"{prefix.rstrip('/')}/bin/python")
        if exe and exe.startswith("/") and _PYTHON.match(exe.rsplit("/", 1)[-1]):
            out.append(exe)
    return [(p, where) for p in out]


def _read(conn: _Conn, paths: list[str], max_bytes: int) -> tuple[dict[str, str], dict[str, str]]:
    """Read `paths` in one round trip, each cut at `max_bytes`: (path -> text, path -> why not).

    The agent opens each path with O_NONBLOCK (a FIFO does not block it), the wait for the reply
    is bounded, and nothing read is put in the evidence.
    """
    texts: dict[str, str] = {}
    errors: dict[str, str] = {}
    if not paths:
        return texts, errors
    reply = conn.call("read_files", paths=paths, max_bytes=max_bytes, reply_timeout=READ_TIMEOUT)
    for p in paths:
        entry = reply.get(p) if isinstance(reply, dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("data"), str):
            texts[p] = entry["data"]
        else:
            errors[p] = str((entry or {}).get("error") or "no reply")
    return texts, errors


def _flag(where: str) -> Setting:
    return Setting(CUSTOM_ALL_REDUCE, CUSTOM_ALL_REDUCE, where, "argv")


def _processes(conn: _Conn, main_pid: int, notes: list[str]) -> list[Any]:
    """The main process and its descendants (at most MAX_PROCS), from one process-table read."""
    try:
        table = ProcessTable.read(conn, gpu_holders=False)
    except GpuhostError as exc:
        notes.append(f"process table not read: {shown(str(exc))}")
        return []
    main = [p for p in table.procs if p.pid == main_pid]
    procs = main + [d for d, _ in table.descendants(main)]
    if len(procs) > MAX_PROCS:
        notes.append(f"{len(procs)} processes in the service: the environment of the first {MAX_PROCS} read")
    return procs[:MAX_PROCS]


def dropin_path(unit: str) -> str:
    """``/etc/systemd/system/UNIT.d/gpuhost-p2p-env.conf`` (the unit name is validated by Service)."""
    return f"/etc/systemd/system/{unit}.d/{DROPIN_NAME}"


def dropin_text(names: list[str]) -> str:
    """The drop-in that unsets `names` (each one of FIXABLE) for every later start of the unit."""
    bad = [n for n in names if n not in FIXABLE]
    if bad or not names:
        raise ValueError(f"not a name this drop-in unsets: {bad or names!r}")
    return (
        "# Installed by pytest-gpuhost suites/p2p (--p2p-unset-service-env): NCCL may use P2P again.\n"
        "# UnsetEnvironment= is applied after Environment= and EnvironmentFile= (systemd.exec(5)).\n"
        "# Remove this file and run `systemctl daemon-reload` to put the old settings back.\n"
        "[Service]\n"
        f"UnsetEnvironment={' '.join(names)}\n"
    )

"""The node's Python: which interpreter starts the agent, found in the agent's own start.

The agent needs CPython 3.6 or newer with the standard-library modules its core imports
(`pytest_gpuhost.exec.agent.agent_needs`). Nodes differ: RHEL 8 has no `python3` on PATH but
`/usr/libexec/platform-python`; Debian's `python3-minimal` has no `json`; an old image may have
Python 2.7 installed as `python3`; a rented container's Python may live only in the inference
server's conda or virtualenv, off a login's PATH. So the agent is not started as `python3 ...` but through a POSIX
`sh` script (`PROBE_SH`) given the candidates in order (`candidates`; last, the interpreters of
the Pythons running on the node, `RUNNING`): it `exec`s the first one
that exists, with `PRELUDE` ahead of the bootstrap. The prelude (valid Python 2 and 3, so even a
2.7 can run it) checks the version and imports the modules before the bootstrap reads a byte of
stdin; when they are not there it `exec`s the same sh script again with the remaining candidates
and a note of what it found. When no candidate is left, sh prints `NO_PYTHON_MARK` and the notes
on stderr and exits 127, and `no_python_line` turns them into one line for the operator.

Nothing here adds a round trip or an interpreter start: on a node whose `python3` is usable the
chain is `sh` then `exec python3`, the process the agent always was (its PID and argv unchanged).
An explicit interpreter (`?python=` in the target URL, `ansible_python_interpreter`) is the only
candidate: the operator named it, so nothing else is tried in its place.
"""

from __future__ import annotations

from pytest_gpuhost.exec.agent import BOOTSTRAP, PYTHON_FLAGS, agent_needs

__all__ = [
    "CANDIDATES",
    "MIN_PYTHON",
    "NO_PYTHON_MARK",
    "PRELUDE",
    "PROBE_SH",
    "RUNNING",
    "candidates",
    "needs_text",
    "no_python_line",
    "start_argv",
]

MIN_PYTHON = (3, 6)

#: Where a node's Python may be, in the order tried: what PATH calls `python3`; RHEL 8's
#: platform-python (python3 is an optional module there, platform-python always installed:
#: docs/FACTS.md); then versioned names, newest first (a python3.x without the python3 link).
#: Last, the interpreters of the Pythons running on the node (RUNNING): an inference server's
#: own, from its virtualenv or conda, which a login's PATH does not reach.
CANDIDATES = (
    "python3",
    "/usr/libexec/platform-python",
    *(f"python3.{minor}" for minor in range(14, MIN_PYTHON[1] - 1, -1)),
    "@running",
)
#: The candidate that stands for the running Pythons: sh replaces it, once, with the distinct
#: `/proc/PID/exe` targets named python, python3, python3.X (a deleted binary is left out).
RUNNING = "@running"

#: The first line sh writes on stderr when no candidate was usable; the notes follow.
NO_PYTHON_MARK = "gpuhost: no usable python"

# POSIX sh, run as `sh -c PROBE_SH gpuhost-agent PROBE_SH BOOT NOTES CANDIDATE...`.  A candidate
# with a slash must be an executable file; a bare name is looked up on PATH by `command -v`
# (a builtin: no process per candidate).  The loop takes candidates off "$@", which then holds
# the ones after `p`, handed on so the prelude can come back here with them.  RUNNING costs a
# pipeline, and only where every candidate before it failed; `set -f`: a path is not a glob.
PROBE_SH = (
    "s=$1 b=$2 n=$3; shift 3\n"
    "while [ $# -gt 0 ]; do\n"
    " p=$1; shift\n"
    f' if [ "$p" = {RUNNING} ]; then r=$(ls -l /proc/[0-9]*/exe 2>/dev/null |'
    " sed -n 's|^.* -> \\(/[^ ]*/python[0-9.]*\\)$|\\1|p' | sort -u)\n"
    '  set -f; set -- $r "$@"; set +f; continue; fi\n'
    ' case $p in */*) [ -f "$p" ] && [ -x "$p" ];; *) command -v "$p" >/dev/null 2>&1;; esac &&'
    ' exec "$p" ' + " ".join(PYTHON_FLAGS) + ' -c "$b" "$s" "$b" "$n" "$p" "$@"\n'
    "done\n"
    f'printf "%s\\n%s\\n" "{NO_PYTHON_MARK}" "$n" >&2\n'
    "exit 127\n"
)


def _prelude() -> str:
    # Python 2 and 3 alike (no f-strings, no print): a 2.7 named python3 must reach the note.
    # argv: [-c, PROBE_SH, BOOT, NOTES, CANDIDATE, REST...]; without them (started by hand) the
    # reason goes to stderr and the exit status is the probe's.
    program = (
        "import os,sys\n"
        "def _gpuhost_check():\n"
        " v=sys.version_info\n"
        " if v<(@MAJOR@,@MINOR@):return 'is Python %d.%d.%d (needs @MAJOR@.@MINOR@+)'%tuple(v[:3])\n"
        " m=[]\n"
        " for n in '@NEEDS@'.split(','):\n"
        "  try:__import__(n)\n"
        "  except ImportError:m.append(n)\n"
        " if m:return 'is Python %d.%d.%d without %s'%(tuple(v[:3])+(', '.join(m),))\n"
        "_w=_gpuhost_check()\n"
        "if _w:\n"
        " a=sys.argv[1:]\n"
        " if len(a)<4:\n"
        "  sys.stderr.write('@MARK@\\n%s\\t%s\\t%s\\n'%(sys.executable,sys.executable,_w));sys.exit(127)\n"
        " n=a[2]+'\\n'+a[3]+'\\t'+(sys.executable or a[3])+'\\t'+_w\n"
        " os.execvp('sh',['sh','-c',a[0],'gpuhost-agent',a[0],a[1],n.strip()]+a[4:])\n"
    )
    for key, value in (
        ("@MAJOR@", str(MIN_PYTHON[0])),
        ("@MINOR@", str(MIN_PYTHON[1])),
        ("@NEEDS@", ",".join(agent_needs())),
        ("@MARK@", NO_PYTHON_MARK),
    ):
        program = program.replace(key, value)
    return program


#: Runs before the bootstrap, in the same `-c` program: see the module docstring.
PRELUDE = _prelude()


def candidates(python: str | None) -> tuple[str, ...]:
    """Return the interpreters to try: the one the operator named, else `CANDIDATES`."""
    return (python,) if python else CANDIDATES


def start_argv(python: str | None) -> list[str]:
    """Return the argv that starts the agent on a target (its program then goes to stdin)."""
    boot = PRELUDE + BOOTSTRAP
    return ["sh", "-c", PROBE_SH, "gpuhost-agent", PROBE_SH, boot, "", *candidates(python)]


def needs_text() -> str:
    """Say what the agent needs of a node's Python, in words."""
    return f"Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} with {', '.join(agent_needs())}"


def _found(stderr: str) -> list[tuple[str, str, str]] | None:
    """The (candidate, path, why) notes after `NO_PYTHON_MARK` in `stderr`; None without it."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == NO_PYTHON_MARK:
            notes = []
            for note in lines[i + 1 :]:
                parts = note.split("\t")
                if len(parts) == 3:
                    notes.append((parts[0], parts[1], parts[2]))
            return notes
    return None


def no_python_line(name: str, stderr: str, python: str | None) -> str | None:
    """Return "NAME: no usable Python: ...; the agent needs ..." from the probe's stderr, or None.

    None when `stderr` does not carry the probe's mark (something else went wrong).
    """
    from pytest_gpuhost.redact import printable

    notes = _found(stderr)
    if notes is None:
        return None
    tried = candidates(python)
    seen = {cand for cand, _path, _why in notes}
    parts = []
    for cand, path, why in notes:
        shown = printable(cand) if path in (cand, "") else f"{printable(cand)} ({printable(path)})"
        if cand not in tried:
            shown = f"the running {shown}"
        parts.append(f"{shown} {printable(why)}")
    running = any(cand not in tried for cand in seen)
    absent = [c for c in tried if c not in seen and c != RUNNING]
    versioned = [c for c in absent if c.startswith("python3.")]
    others = [c for c in absent if c not in versioned]
    parts += [f"{printable(c)} absent" for c in others]
    if len(versioned) > 2:
        parts.append(f"no {versioned[-1]} to {versioned[0]}")
    else:
        parts += [f"{c} absent" for c in versioned]
    if RUNNING in tried and not running:
        parts.append("no Python running")
    return f"{printable(name)}: no usable Python: {', '.join(parts)}; the agent needs {needs_text()}"

"""Worker children of the lab's SGLang stand-in, titled, parented and holding GPUs as SGLang's do.

What real SGLang does (sgl-project/sglang, ``python/sglang/srt``):

- ``entrypoints/engine.py`` ``_launch_subprocesses`` starts one scheduler per GPU rank, or with
  ``--dp-size`` > 1 one ``data_parallel_controller`` that starts them itself, plus one
  detokenizer; the server process keeps the HTTP front end.
- Each worker renames itself with the ``setproctitle`` module, so ``ps`` and
  ``/proc/PID/cmdline`` no longer show ``-m sglang.launch_server``:
  ``managers/scheduler.py`` ``run_scheduler_process``:
  ``setproctitle.setproctitle(f"sglang::scheduler{prefix.replace(' ', '_')}")`` with prefix
  `` TP{tp_rank}`` or `` DP{dp_rank} TP{tp_rank}`` (0.4 releases; later ones drop ``_TP0`` when
  tp_size is 1); ``managers/detokenizer_manager.py`` ``run_detokenizer_process``:
  ``setproctitle.setproctitle("sglang::detokenizer")``; ``managers/data_parallel_controller.py``:
  ``setproctitle.setproctitle("sglang::data_parallel_controller")``.
- Each arms ``kill_itself_when_parent_died()`` (``utils``: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``),
  except where a release disabled it in the scheduler ("This is disabled because it does not
  work for `--dp 2`"); the server's exit runs ``kill_process_tree(os.getpid(),
  include_parent=False)`` (``launch_server.py``), which follows ppid, so a worker already
  reparented escapes it. sgl-project/sglang#23627: after the job ended, ``nvidia-smi`` showed
  ``sglang::scheduler_DP0_TP0_EP0`` .. ``DP3`` with PPID 1, about 100 GB each.

Modes (``--gpulab-workers`` or ``GPULAB_WORKERS``):

``off``       no children: the server alone holds its GPUs (the stand-in's earlier behaviour).
``on``        schedulers, detokenizer (and controller) as above, all armed with PDEATHSIG and
              killed by the server's exit.
``orphans``   as ``on``, but the schedulers are not armed and the server's exit leaves them: a
              plain SIGTERM to the server reproduces what a crash, an OOM kill or ``kill -9``
              of the real one leaves behind (#23627). Each exits on its own SIGTERM.
``stubborn``  as ``orphans``, and the detokenizer survives too and ignores SIGTERM (SIGKILL only).

Workers are forked before the server starts any thread, then open ``/dev/nvidiactl``,
``/dev/nvidia-uvm`` and their own ``/dev/nvidiaN`` themselves (nothing inherited), like a CUDA
context. Titles come from the real ``setproctitle`` module (Debian's ``python3-setproctitle`` for
``/usr/bin/python3``); without it a worker re-executes Python with the title as argv[0].
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MODES = ("off", "on", "orphans", "stubborn")
Dev = Callable[[str], str]  # device name -> its path on this host ("nvidia0" -> /dev/nvidia0)
Record = Callable[[dict[str, Any]], None]  # appends a line to the host's record
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


@dataclass(frozen=True)
class Plan:
    """What one worker is: its title, role, GPU device minors, and how it treats its parent."""

    title: str
    role: str  # scheduler | detokenizer | controller
    minors: tuple[int, ...] = ()
    armed: bool = True  # PR_SET_PDEATHSIG: dies with its parent
    ignore_term: bool = False
    children: tuple[Plan, ...] = ()


def mode(value: str | None) -> str:
    """Return the workers mode from the flag or the environment; exit 2 on an unknown one."""
    m = (value if value is not None else os.environ.get("GPULAB_WORKERS", "off")).strip() or "off"
    if m not in MODES:
        sys.stderr.write(f"launch_server: --gpulab-workers {m!r}: expected one of {', '.join(MODES)}\n")
        raise SystemExit(2)
    return m


def plans(mode_: str, minors: list[int], tp: int, dp: int) -> list[Plan]:
    """Return the server's direct children for this mode (empty for ``off``)."""
    if mode_ == "off":
        return []
    survive = mode_ in ("orphans", "stubborn")
    tp = max(tp, 1)

    def scheduler(title: str, minor: int | None) -> Plan:
        return Plan(title, "scheduler", (minor,) if minor is not None else (), armed=not survive)

    def at(i: int) -> int | None:
        return minors[i] if i < len(minors) else None

    out: list[Plan] = []
    if dp > 1:
        scheds = tuple(
            scheduler(f"sglang::scheduler_DP{d}_TP{t}", at(d * tp + t)) for d in range(dp) for t in range(tp)
        )
        out.append(Plan("sglang::data_parallel_controller", "controller", children=scheds))
    else:
        out += [scheduler(f"sglang::scheduler_TP{t}", at(t)) for t in range(tp)]
    stubborn = mode_ == "stubborn"
    out.append(Plan("sglang::detokenizer", "detokenizer", armed=not stubborn, ignore_term=stubborn))
    return out


def survivors(mode_: str) -> set[str]:
    """Return the roles the server's exit leaves running in this mode."""
    return {"orphans": {"scheduler"}, "stubborn": {"scheduler", "detokenizer"}}.get(mode_, set())


def _set_title(title: str, plan: Plan) -> None:
    try:
        import setproctitle  # type: ignore[import-not-found]
    except ImportError:
        # no module: argv can only be rewritten by exec; the title becomes argv[0]
        env = dict(os.environ, GPULAB_WORKER_PLAN=json.dumps(_to_json(plan)))
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
        code = "from sglang import workers; workers.exec_main()"
        # sys.executable is "" in a process exec'd so (argv[0] is no path): ask the kernel
        os.execve(sys.executable or os.readlink("/proc/self/exe"), [title, "-c", code], env)
    setproctitle.setproctitle(title)


def _to_json(p: Plan) -> dict[str, object]:
    return {
        "title": p.title,
        "role": p.role,
        "minors": list(p.minors),
        "armed": p.armed,
        "ignore_term": p.ignore_term,
        "children": [_to_json(c) for c in p.children],
    }


def _from_json(d: dict[str, object]) -> Plan:
    kids = d.get("children") or []
    minors = d.get("minors") or []
    assert isinstance(kids, list) and isinstance(minors, list)
    return Plan(
        str(d["title"]),
        str(d["role"]),
        tuple(int(m) for m in minors),
        bool(d["armed"]),
        bool(d["ignore_term"]),
        tuple(_from_json(k) for k in kids),
    )


def _arm(parent: int) -> None:
    """Die with the parent, as SGLang's kill_itself_when_parent_died() does."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died between fork and prctl
        os._exit(0)


def spawn(plan: Plan, dev: Dev, record: Record) -> int:
    """Fork one worker (and, for a controller, its schedulers); return its PID in the parent."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _child(plan, parent, dev, record)
        except BaseException:
            os._exit(1)
        os._exit(0)
    return pid


def _child(plan: Plan, parent: int, dev: Dev, record: Record) -> None:
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(s, signal.SIG_DFL)
    os.closerange(3, 1 << 16)  # nothing of the server's: its GPU files, log, sockets
    _set_title(plan.title, plan)
    _run(plan, parent, dev, record)


def _run(plan: Plan, parent: int, dev: Dev, record: Record) -> None:
    if plan.armed:
        _arm(parent)

    def on_term(signum: int, _frame: object) -> None:
        record(
            {
                "t": round(time.time(), 6),
                "kind": "signal",
                "pid": os.getpid(),
                "signal": signal.Signals(signum).name,
                "service": os.environ.get("GPULAB_SERVICE", ""),
                "title": plan.title,
            }
        )
        if not plan.ignore_term:
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    fds = []
    if plan.minors:
        # CUDA (driver >= 535.43.02) opens /dev/nvidia-uvm twice per process: the VA space and the
        # UVM_MM_INITIALIZE descriptor (open-gpu-kernel-modules kernel-open/nvidia-uvm/uvm_ioctl.h)
        for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm", *(f"nvidia{m}" for m in plan.minors)):
            try:
                fds.append(os.open(dev(name), os.O_RDONLY))
            except OSError:
                os._exit(1)  # CUDA's "no CUDA-capable device": the server notices the exit
    for child in plan.children:
        spawn(child, dev, record)
    while True:
        time.sleep(1)
        try:  # reap finished children of a controller; never block
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass


def exec_main() -> None:
    """Run a worker that was re-executed with its title as argv[0] (no setproctitle module)."""
    from gpulab_tools import path, record

    plan = _from_json(json.loads(os.environ.pop("GPULAB_WORKER_PLAN")))
    _run(plan, os.getppid(), lambda name: path("dev", name), record)


def descendants(pid: int) -> list[tuple[int, str]]:
    """Return (PID, title) of every process below ``pid``, by ppid, as psutil's children() would."""
    parent_of: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    parent_of[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found = {pid}
    changed = True
    while changed:
        changed = False
        for child, ppid in parent_of.items():
            if ppid in found and child not in found:
                found.add(child)
                changed = True
    out = []
    for child in sorted(found - {pid}):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                title = f.read().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        out.append((child, title))
    return out


def role_of(title: str) -> str:
    """Return the role a worker's title names (``sglang::scheduler_TP0`` -> scheduler)."""
    if title.startswith("sglang::scheduler"):
        return "scheduler"
    if title == "sglang::detokenizer":
        return "detokenizer"
    return "controller" if title == "sglang::data_parallel_controller" else ""


def kill_tree(mode_: str) -> list[int]:
    """Do what the server's exit does (kill_process_tree, SIGKILL), sparing this mode's survivors."""
    keep = survivors(mode_)
    killed = []
    for pid, title in descendants(os.getpid()):
        if role_of(title) not in keep:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed

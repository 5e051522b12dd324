"""The service's own NCCL settings: found in step 1, reported in step 7, unset only when asked.

What the unit, its environment files and its running processes set is read by
pytest_gpuhost/modules/service_env.py before anything is stopped (a stopped service has no
``/proc/PID/environ``). With ``--p2p-unset-service-env``, and only once the collective has proven
P2P on the repaired GPUs, step 7 writes ``/etc/systemd/system/UNIT.d/gpuhost-p2p-env.conf`` with
``UnsetEnvironment=`` for the names found and reloads systemd; a service still running with them
is stopped (bounded, as in step 2) so that step 9 starts it without them, and step 9 reads the
new process's environment. The write is journaled with the file's previous text; until step 9 has
started the service, the undo (the previous text back, or the file removed, then
``daemon-reload``) is pending, so a failed run starts the service with the settings it had, and the
next run after a cut one puts them back unless it was given the option too.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.modules import service_env
from pytest_gpuhost.modules.service_env import ServiceEnv
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError
from pytest_gpuhost.run.remediation import Action

from . import actions
from .procedure import P2PProcedure

__all__ = [
    "adopt_env_journal",
    "env_actions",
    "env_hint",
    "env_left_after_start",
    "env_note",
    "env_started",
    "env_state",
    "push_env_undo",
    "put_dropin_back",
    "read_dropin",
    "run_on_service",
    "service_env_now",
    "unset_env",
    "wants_unset",
]


def service_env_now(run: P2PProcedure) -> ServiceEnv | None:
    """The service's settings now; while it is stopped, its processes' as step 1 read them.

    A name the unit now unsets is left out of the processes' settings then: the service's
    next start, by this run's step 9, goes without it.
    """
    env = run.read_service_env()
    before = run.service_env
    if env is not None and before is not None and not env.main_pid:
        for s in before.settings:
            if s.kind == "argv" or (s.kind == "process" and s.name not in env.unset):
                env.settings.append(s)
    return env


def env_note(run: P2PProcedure, env: ServiceEnv | None) -> str:
    """The sentence for what the service sets itself ("" when nothing)."""
    if env is None or not env.findings:
        return ""
    parts = []
    if env.p2p_off:
        parts.append(
            "the service disables P2P itself ("
            + "; ".join(s.describe() for s in env.p2p_off)
            + "); after the repair it would still use SHM"
        )
    other = [s for s in env.findings if s not in env.p2p_off]
    for s in other:
        if s.kind == "argv":
            parts.append(
                f"{s.describe()}: SGLang/vLLM's own custom all-reduce kernels are off (not NCCL P2P: "
                "NCCL still picks its transport); left as it is"
            )
        else:
            parts.append(s.describe())
    return "; ".join(parts)


def wants_unset(run: P2PProcedure, env: ServiceEnv | None) -> list[str]:
    """The names the option would unset now ([] without the option or without findings)."""
    if not run.opts.unset_service_env or env is None:
        return []
    return env.names_to_unset()


def env_actions(run: P2PProcedure, env: ServiceEnv) -> list[Action]:
    """The drop-in, the reload and, for a service running with the names, its restart."""
    unit, t = run.service.unit, run.svc_conn.name
    names = env.names_to_unset()
    acts = [
        Action(
            f"unset {' '.join(names)} for {unit} (only once the collective proves P2P)",
            f"write {service_env.dropin_path(unit)}: [Service] UnsetEnvironment={' '.join(names)}",
            t,
        ),
        Action("reload systemd", "systemctl daemon-reload", t),
    ]
    if env.in_processes and not run.stopped_service:
        acts += actions.stop_actions(run)
        acts.append(actions.start_action(run))
    return acts


def read_dropin(run: P2PProcedure) -> str | None:
    """The drop-in's text now (None when there is none)."""
    path = service_env.dropin_path(run.service.unit)
    text = run.svc_conn.read_files([path]).get(path)
    return text if isinstance(text, str) else None


def _ensure_journal(run: P2PProcedure) -> None:
    """Take the lock and start a journal when no repair of this run did (a healthy host)."""
    if run.journal.held:
        return
    owner = {"controller": socket.gethostname(), "procedure": "suites/p2p"}
    run.journal.acquire(wait=run.opts.lock_wait, stale_s=run.opts.lock_stale, owner=owner)
    run.journal.data = {
        "procedure": "suites/p2p",
        "started": time.time(),
        "controller": owner["controller"],
        "service": {"unit": run.service.unit, "where": run.service.where},
        "service_stopped": run.stopped_service,
        "persistenced_stopped": run.stopped_persistenced,
        "steps": [],
    }
    run.journal.write(phase="planned")


def unset_env(run: P2PProcedure, env: ServiceEnv) -> None:
    """Write the drop-in (journaled, its undo pending), reload systemd, restart a service that has the names."""
    names = env.names_to_unset()
    unit, path = run.service.unit, service_env.dropin_path(run.service.unit)
    _ensure_journal(run)
    previous = read_dropin(run)
    restart = env.in_processes and not run.stopped_service and bool(run.service.state().running)
    if restart:  # pushed first, so that a failed run removes the drop-in before it starts the service
        run.push_service_undo()
    record = {
        "unit": unit,
        "where": run.service.where,
        "path": path,
        "names": names,
        "previous": previous,
    }
    run.record("unset-service-env", **record)
    run.journal.write(service_env=record | {"pending": True})
    push_env_undo(run, path, previous)
    run_on_service(run, ["mkdir", "-p", "--", path.rsplit("/", 1)[0]])
    w = run.svc_conn.write_file(path, service_env.dropin_text(names), timeout=15)
    if not w.ok:
        raise ProcedureError(f"writing {path} failed: {w.error}")
    run_on_service(run, ["systemctl", "daemon-reload"])
    now = run.read_service_env()
    left = [n for n in names if now is None or n not in now.unset]
    if left:
        raise ProcedureError(
            f"{unit}'s UnsetEnvironment= does not list {' '.join(left)} after the reload "
            "(a later drop-in resets it?): not restarting"
        )
    evidence.current().note(f"{path} written: UnsetEnvironment={' '.join(names)}")
    if restart:
        run.stopped_service = True
        run.record("stop-service", unit=unit, where=run.service.where)
        run.journal.write(service_stopped=True)
        run.service.stop(run.opts.stop_timeout)
    run.unset_names = names


def run_on_service(run: P2PProcedure, argv: list[str]) -> None:
    r = run.svc_conn.run(argv, timeout=60)
    if r.rc != 0:
        raise ProcedureError(f"{' '.join(argv)} failed (rc {r.rc}): {(r.stderr or r.stdout).strip()[:200]}")


def push_env_undo(run: P2PProcedure, path: str, previous: str | None) -> None:
    """Pending until step 9 starts the service: the drop-in's previous text back (or none), then reload."""
    run.push_undo(
        "service-env",
        f"put {path} back as it was",
        lambda: put_dropin_back(run, path, previous),
        link=run.svc_conn,
    )


def put_dropin_back(run: P2PProcedure, path: str, previous: str | None) -> None:
    """Write the drop-in's previous text (remove it when there was none) and reload systemd."""
    if previous is None:
        run_on_service(run, ["rm", "-f", "--", path])
    else:
        w = run.svc_conn.write_file(path, previous, timeout=15)
        if not w.ok:
            raise ProcedureError(f"writing {path} back failed: {w.error}")
    run_on_service(run, ["systemctl", "daemon-reload"])
    run.unset_names = []
    if run.journal.held:
        run.journal.write(service_env=None)


def env_started(run: P2PProcedure) -> None:
    """Step 9 started the service with the drop-in in force: it stays; nothing to undo."""
    if run.unset_names:
        run.resolve("service-env")
        data = run.journal.data.get("service_env")
        if isinstance(data, dict):
            run.journal.write(service_env=data | {"pending": False})


def adopt_env_journal(run: P2PProcedure) -> None:
    """An interrupted run wrote the drop-in and never started the service: keep it when asked, else put it back now."""
    data = (run.old_journal or {}).get("service_env")
    if not isinstance(data, dict) or not data.get("pending") or data.get("unit") != run.service.unit:
        return
    path = service_env.dropin_path(run.service.unit)
    if data.get("path") != path:
        return  # not the path this suite writes: never touch it
    previous = data.get("previous") if isinstance(data.get("previous"), str) else None
    names = " ".join(str(n) for n in data.get("names") or [])
    run.journal.write(service_env=data)
    if run.opts.unset_service_env:
        run.unset_names = [str(n) for n in data.get("names") or []]
        push_env_undo(run, path, previous)
        return
    run.record("put-back-service-env", unit=run.service.unit, path=path)
    put_dropin_back(run, path, previous)
    evidence.current().note(
        f"an interrupted run unset {names} in {path}; without --p2p-unset-service-env it is put back"
    )


def env_left_after_start(run: P2PProcedure) -> list[str]:
    """After step 9's start: the unset names still in the service's processes (set by a wrapper or the program)."""
    if not run.unset_names:
        return []
    try:
        env = run.read_service_env()
    except GpuhostError:
        return []
    if env is None:
        return []
    return [
        f"{s.describe()}: set by its command line or the program itself, which UnsetEnvironment= cannot remove"
        for s in env.p2p_off
        if s.kind == "process" and s.name in run.unset_names
    ]


def env_hint(run: P2PProcedure) -> str:
    """Why a running service is on SHM when it turns P2P off itself, and the option that changes it."""
    env = run.service_env
    if env is None or not env.p2p_off or run.unset_names:
        return ""
    return (
        f" ({'; '.join(s.describe() for s in env.p2p_off)}: --p2p-unset-service-env unsets it "
        "once the collective proves P2P)"
    )


def env_state(run: P2PProcedure, env: ServiceEnv | None) -> dict[str, Any]:
    """The settings found, as evidence."""
    return env.to_dict() if env is not None else {"unread": "the service's side did not answer"}

"""A run lock and a journal on the target, so that interrupted procedures are finished or undone.

Layout on the target, under the agent's state directory (`hello`'s `state_dir`:
$GPUHOST_STATE_DIR on the target, else /var/lib/gpuhost): `journal/NAME.json` (the journal,
written atomically and fsynced by the agent before each destructive step) and `lock/NAME/` (the lock:
made with mkdir, holding the owner's agent pid, its start time, the boot id and a heartbeat).
A run that finds a journal left by another run (`cut_run`) reads it before anything else and
completes what it did; a run that finds the lock held by a live run waits up to a bound, then
stops with a message naming the holder. Suites reach both through `SuiteProcedure`
(run/suite.py: `take_lock`, `old_journal`, `interrupted()`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Protocol

from pytest_gpuhost.errors import GpuhostError

__all__ = ["BASE", "Journal", "LockBusy"]

BASE = "/var/lib/gpuhost"  # when the connection does not say (a hello without state_dir)
QUICK = 10.0  # seconds to wait for the reply to a lock or journal op (small local file operations)


class _Conn(Protocol):
    name: str

    def call(self, op: str, **params: Any) -> Any: ...

    def batch(self, requests: list[dict[str, Any]]) -> list[Any]: ...


class LockBusy(GpuhostError):
    """Another run holds the target's lock for this procedure."""


class Journal:
    """The journal and lock of one procedure (`name`) on one target."""

    def __init__(self, conn: _Conn, name: str, *, run_id: str | None = None, base: str | None = None) -> None:
        self.conn = conn
        self.name = name
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._base = base
        self.held = False
        self.data: dict[str, Any] = {}

    @property
    def base(self) -> str:
        """The state directory on the target: the agent's `state_dir` unless one was given."""
        if self._base is None:
            # A procedure's link connects on first use; its hello is empty until then.
            connect = getattr(self.conn, "connection", None)
            conn = connect() if callable(connect) else self.conn
            hello = getattr(conn, "hello", None) or {}
            self._base = str(hello.get("state_dir") or BASE)
        return self._base

    @property
    def path(self) -> str:
        return f"{self.base}/journal/{self.name}.json"

    @property
    def lock_path(self) -> str:
        return f"{self.base}/lock/{self.name}"

    def read_request(self) -> dict[str, Any]:
        """Return the agent request that reads the journal (to put in a facts batch)."""
        return {"op": "gpuhost_journal", "action": "read", "path": self.path, "timeout": 5}

    def read(self) -> dict[str, Any] | None:
        """Return the journal on the target, or None when there is none."""
        return self.parse(self.conn.call(**self.read_request(), reply_timeout=QUICK))

    @staticmethod
    def parse(result: Any) -> dict[str, Any] | None:
        """Return the journal from a read reply (None for no journal; a corrupt one raises)."""
        if isinstance(result, Exception):
            raise result
        if result.get("corrupt"):
            raise GpuhostError(f"journal is corrupt: {result['corrupt']}")
        journal = result.get("journal")
        return journal if isinstance(journal, dict) else None

    def cut_run(self, data: dict[str, Any] | None) -> dict[str, Any] | None:
        """Return `data` (a journal read from the target) when another run left it, else None.

        A journal of another run means that run was cut before it finished: this run reads what
        it did and completes it (resume after a cut). This run's own journal, or none, is None.
        """
        return data if data and data.get("run_id") != self.run_id else None

    def acquire(
        self, *, wait: float, stale_s: float = 600.0, owner: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Take the lock, waiting up to `wait` seconds; return the agent's answer (took_over, holder).

        Raises LockBusy naming the holder (run id, host, pid, age) when it stays held.
        """
        deadline = time.monotonic() + wait
        while True:
            r = self.conn.call(
                "gpuhost_lock",
                path=self.lock_path,
                action="acquire",
                run_id=self.run_id,
                owner=owner or {},
                stale_s=stale_s,
            )
            if r.get("acquired"):
                self.held = True
                return dict(r)
            if time.monotonic() >= deadline:
                holder = r.get("holder") or {}
                age = time.time() - float(holder.get("acquired", time.time()))
                raise LockBusy(
                    f"{self.conn.name}: another {self.name} run holds {self.lock_path}: run {holder.get('run_id')} "
                    f"from {holder.get('controller', '?')} (agent pid {holder.get('pid')}, for {age:.0f} s); "
                    f"waited {wait:g} s. Let it finish; if it is gone, its lock expires after {stale_s:g} s "
                    f"without heartbeat or when its agent exits"
                )
            time.sleep(min(1.0, max(0.1, deadline - time.monotonic())))

    def release(self) -> None:
        """Release the lock if this run holds it."""
        if self.held:
            self.conn.call(
                "gpuhost_lock",
                path=self.lock_path,
                action="release",
                run_id=self.run_id,
                reply_timeout=QUICK,
            )
            self.held = False

    def write(self, **changes: Any) -> None:
        """Update the journal with `changes` and write it (fsynced) before the step it announces.

        Refreshes the lock's heartbeat in the same request.
        """
        self.data.update(changes)
        self.data["run_id"] = self.run_id
        self.data["updated"] = time.time()
        self.conn.call(
            "gpuhost_journal",
            action="write",
            path=self.path,
            data=self.data,
            lock={"path": self.lock_path, "run_id": self.run_id},
            reply_timeout=QUICK,
        )

    def step(self, what: str, **detail: Any) -> None:
        """Append one step ("unbind 0000:17:00.0 nvidia") to the journal and write it."""
        steps = self.data.setdefault("steps", [])
        steps.append({"t": round(time.time(), 3), "step": what, **detail})
        self.write(phase=what)

    def retire(self) -> None:
        """Move the journal aside (NAME.json.done): the procedure finished, nothing is pending."""
        self.conn.call("gpuhost_journal", action="retire", path=self.path, reply_timeout=QUICK)
        self.data = {}

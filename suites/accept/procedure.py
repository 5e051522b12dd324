"""One acceptance of one rented node: the order, what the node showed, and each item promised vs found.

`AcceptProcedure` (a `SuiteProcedure`, run/suite.py: it keeps no journal) reads the node once for the health facts (the same agent request
suites/health makes: modules/health/facts.py) and keeps every item it compared, promised vs
found, for the verdict and the evidence JSON. It changes nothing on the node but the data
volume's scratch file (suites/accept/disk.py), and that one only without --check-only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import facts as health_facts
from pytest_gpuhost.redact import printable, redact
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.suite import SuiteProcedure

from .options import AcceptOptions
from .order import Order

__all__ = ["AcceptProcedure", "Item"]


@dataclass
class Item:
    """One promise checked: what the order said, what the node showed, and whether it holds."""

    step: str
    item: str
    promised: str
    found: str
    ok: bool


class AcceptProcedure(SuiteProcedure):
    """The acceptance of one target against one order (module scope: shared by every step).

    `outcomes` and `summaries` (each step's outcome and one line) are the contract's, filled by
    `run_step` and by each step's check; the verdict reads them.
    """

    def __init__(
        self, target: Any, order: Order, opts: AcceptOptions, *, check_only: bool, root: Path = Path(".")
    ) -> None:
        super().__init__(target, check_only=check_only, journal_name=None)
        self.target = target
        self.name: str = str(target.name)
        self.conn = target.conn
        self.order = order
        self.opts = opts
        self.root = root  # where a relative --accept-evidence path starts (the invocation directory)
        self.thresholds = hm.Thresholds.from_vars(target.vars)
        self.items: list[Item] = []
        self.notes: list[str] = []  # said with the verdict, not reasons to reject
        self._facts: dict[str, Any] | None = None
        self._facts_error: Exception | None = None

    def health_facts(self) -> dict[str, Any]:
        """The node's health facts, read in one agent request on first use (as suites/health does).

        A node that cannot be read fails every step that asks with the same error, at once,
        instead of another connect timeout each.
        """
        if self._facts_error is not None:
            raise self._facts_error
        if self._facts is None:
            names = health_facts.fact_names(None)
            timeout = float(self.thresholds["probe_timeout"])
            bound = timeout * 3 + 10 + (timeout * 4 + 10) * (len(names) - 1)
            try:
                reply = self.conn.call(
                    "facts", names=names, params=hm.probe_params(self.thresholds), reply_timeout=bound
                )
            except Exception as exc:
                self._facts_error = exc
                raise
            self._facts = health_facts.merge(reply)
        return self._facts

    def promise(self, step: str, item: str, promised: Any, found: Any, ok: bool) -> Item:
        """Record one item compared (node strings are redacted and shown printable)."""
        it = Item(step, item, str(promised), printable(redact(str(found)))[:200], bool(ok))
        self.items.append(it)
        evidence.current().state(f"{item}: promised", it.promised, target=self.name)
        evidence.current().state(f"{item}: found", it.found, target=self.name)
        return it

    def failed_items(self) -> list[Item]:
        return [i for i in self.items if not i.ok]

    def evidence_path(self, root: Path) -> Path:
        """Where this target's promised-vs-found JSON goes ({host} replaced, relative to `root`)."""
        safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in self.name)
        p = Path(self.opts.evidence.replace("{host}", safe))
        return p if p.is_absolute() else root / p

    def write_evidence(self, root: Path, verdict: str) -> Path:
        """Write the JSON a renter can send the provider: the order, each item, the verdict."""
        path = self.evidence_path(root)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "node": self.name,
            "verdict": verdict,
            "check_only": self.check_only,
            "order": {f.name: _plain(getattr(self.order, f.name)) for f in fields(self.order)},
            "items": [asdict(i) for i in self.items],
            "steps": dict(self.outcomes),
            "notes": list(self.notes),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
        return path


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, int | float | str) else str(value)

"""The fleet summary: a hosts x checks table built from the run record, and the verdicts on it.

Format `pytest-gpuhost/fleet-summary/1` (docs/fleet.md): `run` (when, where, argv), `checks`
(names in order, from `record.check_name`), `hosts -> {status, checks -> {outcome, summary,
reasons, state, nodeid, duration, unreachable}, cannot_see, round_trips, conn_round_trips}`, `fleet` (judgements
no single host can make) and, with a previous summary, `comparison`. A cell `cannot see` (a check
whose input the node does not give) is neither healthy nor not: counted apart, per host in
`cannot_see`, and a host's status only with `run.cannot_see: fail` (`--cannot-see=fail`). Pure functions of dicts, so the merge
command reads and writes the same thing the controller does.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from pytest_gpuhost.run.record import BAD, CANNOT_SEE, GOOD, RunRecord, TestRecord

__all__ = [
    "BAD",
    "FORMAT",
    "GOOD",
    "build_summary",
    "cannot_see_summary",
    "compare",
    "count_line",
    "fleet_judgements",
    "host_status",
    "iter_cells",
    "name_list",
    "summary_lines",
    "unreachable_line",
]

FORMAT = "pytest-gpuhost/fleet-summary/1"
#: Bad cells listed per host in the terminal summary.
LINES_PER_HOST = 6
#: Host names listed per version in a "NOT uniform" line (the rest are counted).
NAMES_SHOWN = 8
#: Hosts not ok listed in the terminal summary (a fleet of thousands; the reports list them all).
HOSTS_LISTED = 50


def build_summary(
    record: RunRecord, finished: float | None = None, cannot_see: str = "report"
) -> dict[str, Any]:
    """Return the fleet summary of the tests that ran against a target.

    `cannot_see`: "fail" where `--cannot-see=fail` makes a blind check fail its host.
    """
    finished = time.time() if finished is None else finished
    by_target: dict[str, list[TestRecord]] = {}
    for t in record.decided():
        if t.target:  # a test against no target has no row in a fleet
            by_target.setdefault(t.target, []).append(t)
    checks = list(dict.fromkeys(t.check for tests in by_target.values() for t in tests))
    cells = record.cells()
    hosts: dict[str, Any] = {}
    for target, tests in by_target.items():
        row = {c: cells[(target, c)].as_cell() for c in checks if (target, c) in cells}
        hosts[target] = {
            "status": host_status(row, cannot_see_fails=cannot_see == "fail"),
            "checks": row,
            "cannot_see": sum(1 for cell in row.values() if cell.get("outcome") == CANNOT_SEE),
        }
        trips: dict[str, int] = {}
        for t in tests:
            for key, n in t.round_trips.items():
                trips[key] = max(trips.get(key, 0), n)
        hosts[target].update(trips)
    return {
        "format": FORMAT,
        "run": {
            "started": record.started,
            "finished": finished,
            "duration": round(finished - record.started, 3),
            "node": socket.gethostname(),
            "argv": list(sys.argv[1:]),
            "cannot_see": cannot_see,
        },
        "checks": checks,
        "hosts": hosts,
        "fleet": fleet_judgements(hosts),
    }


def host_status(cells: Mapping[str, Mapping[str, Any]], cannot_see_fails: bool = False) -> str:
    """Return a host's status: error (unreachable or broken run), failed, or ok.

    A check that cannot see leaves the host ok (it is counted apart), unless `cannot_see_fails`.
    """
    outcomes = [c.get("outcome") for c in cells.values()]
    if "error" in outcomes:
        return "error"
    if any(o in ("failed", "would fix") or (cannot_see_fails and o == CANNOT_SEE) for o in outcomes):
        return "failed"
    return "ok"


def fleet_judgements(hosts: Mapping[str, Any]) -> dict[str, Any]:
    """Judge what needs the whole fleet: are driver and CUDA versions the same everywhere."""
    out: dict[str, Any] = {}
    for check in ("driver_version", "cuda_version"):
        by_version: dict[str, list[str]] = {}
        for host, h in sorted(hosts.items()):
            state = ((h.get("checks") or {}).get(check) or {}).get("state") or {}
            version = state.get(check) if isinstance(state, Mapping) else None
            if version:
                by_version.setdefault(str(version), []).append(host)
        if by_version:
            out[check] = {"uniform": len(by_version) == 1, "versions": by_version}
    return out


def iter_cells(summary: Mapping[str, Any]) -> Iterable[tuple[str, str, Mapping[str, Any]]]:
    """Yield (host, check, cell) of a summary."""
    for host, h in (summary.get("hosts") or {}).items():
        for check, cell in (h.get("checks") or {}).items():
            yield host, check, cell


def compare(previous: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """List the cells that newly failed and those that recovered since `previous`.

    Newly failed: not healthy now, and healthy, skipped or absent before (`was` says which).
    Recovered: healthy now, not healthy before. Skipped now counts as neither.
    """
    prev = {(h, c): cell for h, c, cell in iter_cells(previous)}
    cur = {(h, c): cell for h, c, cell in iter_cells(current)}
    newly, recovered = [], []
    for (host, check), cell in sorted(cur.items()):
        before = prev.get((host, check))
        was = before.get("outcome") if before else "absent"
        summary = cell.get("summary", "")
        if cell.get("outcome") in BAD and was not in BAD:
            newly.append(
                {"host": host, "check": check, "outcome": cell.get("outcome"), "was": was, "summary": summary}
            )
        elif cell.get("outcome") in GOOD and was in BAD:
            recovered.append({"host": host, "check": check, "was": was, "summary": summary})
    return {"newly_failed": newly, "recovered": recovered}


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """Return the terminal summary of a fleet run, a few lines."""
    hosts = summary.get("hosts") or {}
    by_status: dict[str, list[str]] = {}
    for host, h in sorted(hosts.items()):
        by_status.setdefault(h.get("status", "?"), []).append(host)
    lines = ["", "=" * 20 + " gpuhost fleet " + "=" * 20]
    lines.append(count_line(summary))
    bad_hosts = by_status.get("failed", []) + by_status.get("error", [])
    for host in bad_hosts[:HOSTS_LISTED]:
        down = unreachable_line(host, hosts[host].get("checks") or {})
        if down:
            lines.append(f"  {down}")
            continue
        # one line per distinct error: the same words said once, with the checks that said them
        said: dict[tuple[str, str], list[str]] = {}
        for c, cell in hosts[host]["checks"].items():
            if cell.get("outcome") in BAD:
                said.setdefault((str(cell.get("outcome")), str(cell.get("summary", ""))), []).append(c)
        bad = list(said.items())
        for (outcome, text), checks in bad[:LINES_PER_HOST]:
            named = (
                checks[0]
                if len(checks) == 1
                else f"{', '.join(checks[:3])}"
                + (f" and {len(checks) - 3} more" if len(checks) > 3 else "")
                + f" ({len(checks)} checks)"
            )
            lines.append(f"  {host} {named}: {outcome}: {text}")
        if len(bad) > LINES_PER_HOST:
            lines.append(f"  {host}: {len(bad) - LINES_PER_HOST} more")
    if len(bad_hosts) > HOSTS_LISTED:
        lines.append(
            f"  ... and {len(bad_hosts) - HOSTS_LISTED} more hosts not ok (every one is in the report)"
        )
    lines += cannot_see_summary(summary)
    lines += _uniformity_lines(summary.get("fleet") or {})
    lines += _comparison_lines(summary.get("comparison"))
    return lines


def unreachable_line(host: str, cells: Mapping[str, Mapping[str, Any]]) -> str:
    """`gpu-07: unreachable: WHY; 27 checks not run` when every bad cell is the host not answering."""
    bad = [c for c in cells.values() if c.get("outcome") in BAD]
    if not bad or not all(c.get("unreachable") for c in bad):
        return ""
    return f"{host}: unreachable: {bad[0]['unreachable']}; {_n(len(bad), 'check')} not run"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def count_line(summary: Mapping[str, Any]) -> str:
    """Return `2 hosts x 4 checks = 8 results: 7 passed, 1 failed; hosts: 1 ok, 1 failed`.

    Results are counted as results and hosts as hosts (a host is failed when one check is).
    """
    hosts = summary.get("hosts") or {}
    results: dict[str, int] = {}
    for _, _, cell in iter_cells(summary):
        outcome = str(cell.get("outcome"))
        results[outcome] = results.get(outcome, 0) + 1
    order = [*GOOD, *BAD, CANNOT_SEE, "skipped"]
    shown = [f"{results[o]} {o}" for o in order if results.get(o)]
    shown += [f"{n} {o}" for o, n in results.items() if o not in order]
    statuses: dict[str, int] = {}
    for h in hosts.values():
        statuses[h.get("status", "?")] = statuses.get(h.get("status", "?"), 0) + 1
    host_parts = [f"{statuses.get('ok', 0)} ok"] + [
        f"{statuses[s]} {s}" for s in ("failed", "error") if statuses.get(s)
    ]
    n_checks = len(summary.get("checks") or [])
    head = f"{_n(len(hosts), 'host')} x {_n(n_checks, 'check')} = {_n(sum(results.values()), 'result')}"
    return f"{head}: {', '.join(shown) or 'none'}; hosts: {', '.join(host_parts)}"


def cannot_see_summary(summary: Mapping[str, Any]) -> list[str]:
    """Return one line per reason a check could not see, with its checks and hosts, said once.

    `xid, sxid cannot see on 12 hosts: kernel log denied ...`: a fleet of rented containers
    gives one line, not one per host and check.
    """
    by_reason: dict[str, tuple[list[str], list[str]]] = {}
    for host, check, cell in iter_cells(summary):
        if cell.get("outcome") != CANNOT_SEE:
            continue
        checks, hosts = by_reason.setdefault(str(cell.get("summary", "")), ([], []))
        if check not in checks:
            checks.append(check)
        if host not in hosts:
            hosts.append(host)
    return [
        f"{', '.join(checks)} cannot see on {name_list(sorted(hosts))}: {why}"
        for why, (checks, hosts) in by_reason.items()
    ]


def _uniformity_lines(judgements: Mapping[str, Any]) -> list[str]:
    lines = []
    for check, j in judgements.items():
        versions = j.get("versions") or {}
        if j.get("uniform"):
            ((v, names),) = versions.items()
            lines.append(f"{check}: {v} on all {len(names)} hosts")
        else:
            by_count = sorted(versions.items(), key=lambda kv: -len(kv[1]))
            shown = "; ".join(f"{v} on {name_list(n)}" for v, n in by_count)
            lines.append(f"{check}: NOT uniform across the fleet: {shown}")
    return lines


def name_list(names: list[str], limit: int = NAMES_SHOWN) -> str:
    """Return `a, b, c` or, past `limit` names, `N hosts: a, b, ... and M more` (a 1,000-node fleet)."""
    if len(names) <= limit:
        return ", ".join(names)
    return f"{len(names)} hosts: {', '.join(names[:limit])} and {len(names) - limit} more"


def _comparison_lines(comp: Mapping[str, Any] | None) -> list[str]:
    if not comp:
        return []
    if comp.get("error"):
        return [f"previous run {comp.get('previous')}: unreadable: {comp['error']}"]
    newly, recovered = comp["newly_failed"], comp["recovered"]
    lines = [f"since {comp.get('previous')}: {len(newly)} newly failed, {len(recovered)} recovered"]
    lines += [f"  newly failed: {c['host']} {c['check']} (was {c['was']}): {c['summary']}" for c in newly]
    lines += [f"  recovered: {c['host']} {c['check']} (was {c['was']})" for c in recovered]
    return lines

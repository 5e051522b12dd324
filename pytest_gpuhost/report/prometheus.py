"""The fleet summary as a Prometheus textfile, for node_exporter's textfile collector."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.modules.health.xid import ACTIONS
from pytest_gpuhost.redact import redact
from pytest_gpuhost.report.files import atomic_write
from pytest_gpuhost.run.record import BAD, CANNOT_SEE, GOOD

__all__ = ["prometheus_text", "write_prometheus"]


def _label(value: str) -> str:
    value = redact(value)
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(summary: Mapping[str, Any]) -> str:
    """Render a fleet summary in the Prometheus text exposition format.

    `gpuhost_check_ok{host,check}` is 1 when the check held (or was fixed) and 0 when it failed,
    would be fixed, or could not run; skipped checks have no sample, nor have checks that cannot
    see their input on the node: those are `gpuhost_check_cannot_see{host,check}` (1), and
    `gpuhost_host_cannot_see{host}` counts them per host (0 when none). Plus a per-host gauge, the
    Xid actions (`_xid_actions`), and the run's timestamp and duration, so an alert can also
    catch a run that stopped happening.
    """
    out = [
        "# HELP gpuhost_check_ok 1 if the health check held (or was fixed) at the last run, 0 if not.",
        "# TYPE gpuhost_check_ok gauge",
    ]
    hosts = summary.get("hosts") or {}
    for host, h in sorted(hosts.items()):
        for check, cell in (h.get("checks") or {}).items():
            outcome = cell.get("outcome")
            if outcome in GOOD or outcome in BAD:
                value = 1 if outcome in GOOD else 0
                out.append(f'gpuhost_check_ok{{host="{_label(host)}",check="{_label(check)}"}} {value}')
    out += [
        "# HELP gpuhost_host_ok 1 if every check on the host held at the last run.",
        "# TYPE gpuhost_host_ok gauge",
    ]
    for host, h in sorted(hosts.items()):
        out.append(f'gpuhost_host_ok{{host="{_label(host)}"}} {1 if h.get("status") == "ok" else 0}')
    out += [
        "# HELP gpuhost_check_cannot_see 1 if the check could not read its input on the node "
        "(kernel log denied, no systemd, a tool missing): neither held nor failed.",
        "# TYPE gpuhost_check_cannot_see gauge",
    ]
    for host, h in sorted(hosts.items()):
        for check, cell in (h.get("checks") or {}).items():
            if cell.get("outcome") == CANNOT_SEE:
                out.append(f'gpuhost_check_cannot_see{{host="{_label(host)}",check="{_label(check)}"}} 1')
    out += [
        "# HELP gpuhost_host_cannot_see Checks that could not see their input on the host at the last run.",
        "# TYPE gpuhost_host_cannot_see gauge",
    ]
    for host, h in sorted(hosts.items()):
        n = sum(1 for cell in (h.get("checks") or {}).values() if cell.get("outcome") == CANNOT_SEE)
        out.append(f'gpuhost_host_cannot_see{{host="{_label(host)}"}} {n}')
    out += _xid_actions(hosts)
    run = summary.get("run") or {}
    out += [
        "# HELP gpuhost_last_run_timestamp_seconds When the last health run finished, Unix time.",
        "# TYPE gpuhost_last_run_timestamp_seconds gauge",
        f"gpuhost_last_run_timestamp_seconds {float(run.get('finished') or time.time()):.3f}",
        "# HELP gpuhost_last_run_duration_seconds How long the last health run took.",
        "# TYPE gpuhost_last_run_duration_seconds gauge",
        f"gpuhost_last_run_duration_seconds {float(run.get('duration') or 0):.3f}",
    ]
    return "\n".join(out) + "\n"


def _xid_actions(hosts: Mapping[str, Any]) -> list[str]:
    """`gpuhost_xid_action{host,action}`: the Xids asking each action of NVIDIA's catalogue.

    Counted from the xid check's state: this run's Xids by their action, plus the resets and
    reboots still owed from earlier nights (modules/health/xid.settle). Every action has a sample per
    host that ran the check (0 when none), so an alert on `action="reset_gpu"` or `"reboot"`
    sees a series that exists, and `gpuhost_xid_action_owed{host}` names the strongest action
    the host owes or was asked for (`none` when nothing), as a label with value 1.
    """
    out = [
        "# HELP gpuhost_xid_action Xids asking this action (NVIDIA's catalogue) at the last run, "
        "this run's plus the resets and reboots still owed.",
        "# TYPE gpuhost_xid_action gauge",
    ]
    worst = []
    for host, h in sorted(hosts.items()):
        cell = (h.get("checks") or {}).get("xid") or {}
        state = cell.get("state")
        if not isinstance(state, Mapping) or "action" not in state:
            continue
        counts = dict.fromkeys(ACTIONS, 0)
        for e in list(state.get("events") or []) + list(state.get("owed") or []):
            action = e.get("action") if isinstance(e, Mapping) else None
            if action in counts:
                counts[action] += 1
        for action, n in counts.items():
            out.append(f'gpuhost_xid_action{{host="{_label(host)}",action="{action}"}} {n}')
        strongest = str(state.get("action"))
        worst.append(f'gpuhost_xid_action_owed{{host="{_label(host)}",action="{_label(strongest)}"}} 1')
    out += [
        "# HELP gpuhost_xid_action_owed The strongest action the host's Xids ask (none, restart_app, "
        "check_fabric, unknown, reset_gpu, reboot), as the label; value 1.",
        "# TYPE gpuhost_xid_action_owed gauge",
        *worst,
    ]
    return out


def write_prometheus(summary: Mapping[str, Any], path: str) -> None:
    """Write the Prometheus textfile atomically (temp file in the same directory, rename)."""
    atomic_write(path, prometheus_text(summary))

"""The fleet summary as a Prometheus textfile, for node_exporter's textfile collector."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.redact import redact
from pytest_gpuhost.report.files import atomic_write
from pytest_gpuhost.run.record import BAD, GOOD

__all__ = ["prometheus_text", "write_prometheus"]


def _label(value: str) -> str:
    value = redact(value)
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(summary: Mapping[str, Any]) -> str:
    """Render a fleet summary in the Prometheus text exposition format.

    `gpuhost_check_ok{host,check}` is 1 when the check held (or was fixed) and 0 when it failed,
    would be fixed, or could not run; skipped checks have no sample. Plus a per-host gauge and
    the run's timestamp and duration, so an alert can also catch a run that stopped happening.
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


def write_prometheus(summary: Mapping[str, Any], path: str) -> None:
    """Write the Prometheus textfile atomically (temp file in the same directory, rename)."""
    atomic_write(path, prometheus_text(summary))

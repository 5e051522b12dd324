"""Health checks of the host around the GPUs: Xid/SXid in the kernel log, free disk, the service.

Pure logic, no I/O (facts in, verdicts out). Free disk is judged with a noise band like the
temperature: a reading within `disk_free_noise_pct` of the limit asks for re-reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_gpuhost.modules.health.thresholds import Thresholds, mount_specs
from pytest_gpuhost.modules.health.verdict import (
    Facts,
    Verdict,
    blind_reason,
    cannot_see,
    facts_part,
    failed,
    median,
    skipped,
)
from pytest_gpuhost.modules.health.xid import (
    FAILING,
    event_action,
    is_ignored,
    recovery_owed,
    reset_signals,
    settle,
    worst,
)

#: What lets a check read the kernel log where this node denies it.
KERNEL_LOG_WOULD_LET = (
    "run the check on the host, give the container CAP_SYSLOG, or read the host's journal "
    "(journalctl -k --directory PATH) where it is mounted"
)


def kernel_log_blind(check: str, facts: Facts) -> Verdict | None:
    """Return the `cannot see` verdict of a check whose kernel log this node denies or lacks, else None."""
    why = blind_reason(facts.get("kernel_log"))
    if why is None:
        return None
    return cannot_see(check, f"cannot read the kernel log: {why}", KERNEL_LOG_WOULD_LET)


def _kernel_errors(check: str, facts: Facts, key: str, ignore: Sequence[int], label: str) -> Verdict:
    blind = kernel_log_blind(check, facts)
    if blind is not None:
        return blind
    part, err = facts_part(facts, "kernel_log")
    if part is None:
        return failed(check, f"kernel log unreadable: {err}", [str(err)])
    events = list(part.get(key) or [])
    counted = [e for e in events if int(e.get("code", -1)) not in set(ignore)]
    ignored = [e for e in events if e not in counted]
    window = "since boot (first run; baseline recorded)" if part.get("first_run") else "since the last run"
    ignored_codes = sorted({int(e["code"]) for e in ignored})
    state = {
        "window": window,
        "since": part.get("since"),
        "events": [{k: e.get(k) for k in ("ts", "bdf", "code", "msg")} for e in events],
        "ignored_codes": ignored_codes,
    }
    note = f"; {len(ignored)} ignored ({', '.join(str(c) for c in ignored_codes)})" if ignored else ""
    if counted:
        codes = sorted({int(e["code"]) for e in counted})
        reasons = [f"{label} {e.get('code')} on {e.get('bdf')}: {e.get('msg')}" for e in counted]
        return failed(
            check,
            f"{len(counted)} {label} error(s) {window}: code {', '.join(map(str, codes))}{note}",
            reasons,
            state=state,
        )
    return Verdict(check, True, f"no {label} errors {window}{note}", state=state)


def check_xid(facts: Facts, t: Thresholds) -> Verdict:
    """Judge the Xids since the last run by NVIDIA's catalogue, and the resets/reboots still owed.

    An Xid whose action is a GPU reset or a reboot fails this run and every later one until the
    host shows the action happened (modules/health/xid.settle: a new boot id, or for a reset the GPU's
    reset signals cleared); one that asks only to restart the application passes, reported.
    """
    blind = kernel_log_blind("xid", facts)
    if blind is not None:
        return blind
    part, err = facts_part(facts, "kernel_log")
    if part is None:
        return failed("xid", f"kernel log unreadable: {err}", [str(err)])
    ignore = set(t["xid_ignore"])
    events = list(part.get("xid") or [])
    window = "since boot (first run; baseline recorded)" if part.get("first_run") else "since the last run"
    rows = []
    for e in events:
        action, name = event_action(e)
        row = {k: e.get(k) for k in ("ts", "bdf", "code", "msg")}
        row.update({k: e[k] for k in ("cause", "record") if k in e})
        rows.append({**row, "action": action, "name": name})
    counted = [r for r in rows if r["action"] in FAILING and not is_ignored(r, ignore)]
    passed = [r for r in rows if r not in counted]
    fresh_keys = {(r["code"], r["bdf"], r["ts"]) for r in counted}
    owed_all, done = settle(part, sorted(ignore), reset_signals(facts))
    owed = [p for p in owed_all if (p.get("code"), p.get("bdf"), p.get("ts")) not in fresh_keys]
    asked = recovery_owed(facts)
    action = worst(
        [r["action"] for r in counted] + [str(p.get("action")) for p in owed] + [a["action"] for a in asked]
    )
    state: dict[str, Any] = {
        "window": window,
        "since": part.get("since"),
        "events": rows,
        "action": action,
        "owed": owed,
        "done": done,
        "recovery_actions": asked,
        "ignored_codes": sorted({int(r["code"]) for r in passed}),
    }
    notes = []
    if passed:
        notes.append(
            f"{len(passed)} not failing (" + ", ".join(f"{r['code']}: {r['action']}" for r in passed) + ")"
        )
    for by, what in (("reboot", "reboot"), ("gpu_reset", "GPU reset")):
        seen = [f"Xid {p.get('code')} on {p.get('bdf')}" for p in done if p.get("by") == by]
        if seen:
            notes.append(f"{what} seen since " + ", ".join(seen))
    note = "; " + "; ".join(notes) if notes else ""
    reasons = [f"Xid {r['code']} on {r['bdf']}: {r['msg']}" for r in counted]
    reasons += [
        f"Xid {p.get('code')} on {p.get('bdf')} still needs {_ACTION_TEXT[str(p.get('action'))]}: "
        f"{_NOT_SEEN[str(p.get('action'))]} ({p.get('msg')})"
        for p in owed
    ]
    reasons += [
        f"{a['bdf']}: the driver's recovery action is {a['value']!r}: the GPU needs "
        f"{_ACTION_TEXT.get(str(a['action']), 'an action the driver names')}"
        for a in asked
    ]
    if reasons:
        parts = []
        if counted:
            codes = sorted({int(r["code"]) for r in counted})
            parts.append(f"{len(counted)} Xid error(s) {window}: code {', '.join(map(str, codes))}")
        if owed:
            parts.append(f"{len(owed)} earlier Xid(s) still owed")
        if asked:
            parts.append(f"{len(asked)} GPU(s) with a recovery action")
        return failed("xid", f"{'; '.join(parts)} (action: {action}){note}", reasons, state=state)
    return Verdict("xid", True, f"no Xid errors {window}{note}", state=state)


_ACTION_TEXT = {
    "drain_p2p": "its P2P traffic drained",
    "reset_gpu": "a GPU reset",
    "reboot": "a reboot",
}
_NOT_SEEN = {
    "drain_p2p": "its recovery action has not read None since, and no reboot seen since",
    "reset_gpu": "no reset of that GPU and no reboot seen since",
    "reboot": "the host has not rebooted since",
}


def check_sxid(facts: Facts, t: Thresholds) -> Verdict:
    return _kernel_errors("sxid", facts, "sxid", t["sxid_ignore"], "SXid")


def check_disk_free(facts: Facts, t: Thresholds, samples: Sequence[Facts] | None = None) -> Verdict:
    part, err = facts_part(facts, "disk")
    if part is None:
        return failed("disk_free", f"disk facts missing: {err}", [str(err)])
    min_pct, band = float(t["disk_free_min_pct"]), float(t["disk_free_noise_pct"])
    min_gib = t["disk_free_min_gib"]
    reasons = []
    near = False
    state: dict[str, Any] = {"paths": {}}

    def pct_of(entry: Mapping[str, Any]) -> float:
        return 100.0 * entry["avail"] / entry["total"] if entry.get("total") else 0.0

    paths = part.get("paths") or {}
    named = {path for path, _ in mount_specs(t)}
    mounts = facts.get("mounts")
    held = (mounts.get("paths") or {}) if isinstance(mounts, Mapping) else {}
    for path, entry in paths.items():
        mp = (held.get(path) or {}).get("mount_point")
        if path in named and mp not in (None, path):
            # a missing mount: statvfs measured the file system under it (check `mounts`)
            reasons.append(f"{path}: not mounted; free space not measured (it would be {mp}'s)")
            continue
        if "error" in entry:
            reasons.append(str(entry["error"]))
            continue
        pcts = [pct_of(entry)]
        for s in samples or []:
            sp, _ = facts_part(s, "disk")
            se = ((sp or {}).get("paths") or {}).get(path)
            if se and "error" not in se:
                pcts.append(pct_of(se))
        pct = median(pcts) if samples else pcts[0]
        gib = entry["avail"] / 2**30
        state["paths"][path] = {
            "free_pct": round(pct, 2),
            "free_gib": round(gib, 2),
            "readings_pct": [round(p, 2) for p in pcts],
        }
        if abs(pcts[0] - min_pct) <= band:
            near = True
        if pct < min_pct:
            how = f" (median of {len(pcts)} readings)" if samples else ""
            reasons.append(f"{path}: {pct:.1f}% free < {min_pct:g}%{how}")
        if min_gib is not None and gib < float(min_gib):
            reasons.append(f"{path}: {gib:.1f} GiB free < {float(min_gib):g} GiB")
    if reasons:
        v = failed("disk_free", reasons[0], reasons, state=state)
    else:
        shown = ", ".join(f"{p} {e['free_pct']:.1f}%" for p, e in state["paths"].items())
        v = Verdict("disk_free", True, f"free space: {shown} (min {min_pct:g}%)", state=state)
    if near and not samples and t["reread_count"] > 0:
        v.reread = "disk"
    return v


def _service_entries(facts: Facts, t: Thresholds) -> tuple[list[Mapping[str, Any]], str | None]:
    part, err = facts_part(facts, "services")
    if part is None:
        return [], err
    found = part.get("services") or {}
    return [found.get(u) or {"unit": u, "error": "not gathered", "show": {}} for u in t.services], None


def _no_systemd(check: str, entries: list[Mapping[str, Any]]) -> Verdict | None:
    """Return `cannot see` where the node has no systemd to ask about the unit (a container)."""
    missing = sorted({str(e["missing"]) for e in entries if e.get("missing")})
    if not missing:
        return None
    what = "no systemctl on this node" if "systemctl" in missing else "PID 1 is not systemd on this node"
    units = ", ".join(str(e.get("unit")) for e in entries if e.get("missing"))
    return cannot_see(
        check,
        f"cannot read the state of {units}: {what}",
        "run the check where systemd manages the service, or name no `service` for this host "
        "(a process started by hand has no unit)",
    )


def check_service(facts: Facts, t: Thresholds) -> Verdict:
    if not t.services:
        return skipped("service", "no inference service configured (inventory variable `service`)")
    entries, err = _service_entries(facts, t)
    if err:
        return failed("service", f"service state unavailable: {err}", [str(err)])
    blind = _no_systemd("service", entries)
    if blind is not None:
        return blind
    reasons = []
    state = {}
    for e in entries:
        show = e.get("show") or {}
        state[e["unit"]] = {
            k: show.get(k) for k in ("LoadState", "ActiveState", "SubState", "MainPID", "Result")
        }
        if e.get("error") and not show:
            reasons.append(f"{e['unit']}: {e['error']}")
        elif show.get("LoadState") != "loaded":
            reasons.append(f"{e['unit']}: unit {show.get('LoadState') or 'unknown'}")
        elif show.get("ActiveState") != "active":
            reasons.append(
                f"{e['unit']}: {show.get('ActiveState')} ({show.get('SubState')}, result {show.get('Result')})"
            )
    fixable = any(
        (s.get("ActiveState") in ("failed", "inactive")) and s.get("LoadState") == "loaded"
        for s in state.values()
    )
    if reasons:
        return failed("service", reasons[0], reasons, state=state, fix="service" if fixable else None)
    shown = ", ".join(f"{u} active ({s['SubState']}, pid {s['MainPID']})" for u, s in state.items())
    return Verdict("service", True, shown, state=state)


def check_service_health(facts: Facts, t: Thresholds) -> Verdict:
    if not t.services or t["service_port"] is None:
        return skipped(
            "service_health", "no health endpoint configured (inventory variables `service`, `service_port`)"
        )
    entries, err = _service_entries(facts, t)
    if err:
        return failed("service_health", f"service state unavailable: {err}", [str(err)])
    h = entries[0].get("health") or {}
    state = {
        "url": h.get("url"),
        "status": h.get("status"),
        "error": h.get("error"),
        "duration": h.get("duration"),
    }
    if h.get("status") == 200:
        return Verdict(
            "service_health",
            True,
            f"{h.get('url')} answered 200 in {h.get('duration', 0):.3f} s",
            state=state,
        )
    why = h.get("error") or f"HTTP {h.get('status')}"
    return failed("service_health", f"{h.get('url') or 'health endpoint'}: {why}", [why], state=state)

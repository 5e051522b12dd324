"""Steps 5, 6, 8 and 9 of suites/p2p: drivers bound, P2P bandwidth, persisted, service restored."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pytest_gpuhost.modules import nccl, p2p, pci
from pytest_gpuhost.modules import p2p_boot as persist
from pytest_gpuhost.modules.service import check_health
from pytest_gpuhost.run import evidence
from pytest_gpuhost.run.procedure import ProcedureError, Step
from pytest_gpuhost.run.remediation import Action, Check

from . import actions
from .procedure import P2PProcedure
from .service_env import env_hint, env_left_after_start, env_started

__all__ = [
    "health_url",
    "log_text",
    "step_drivers_bound",
    "step_p2p_bandwidth",
    "step_persisted",
    "step_service_restored",
    "wait_for_firmware",
]


def wait_for_firmware(run: P2PProcedure) -> bool:
    """Poll nvidia-smi until it lists every in-scope GPU, up to gsp_wait seconds after a rebind; True if it polled.

    The first open after a bind starts the GPU's firmware (nv_open_device -> rm_init_adapter
    boots GSP-RM, open-gpu-kernel-modules kernel-open/nvidia/nv.c); with several GPUs one
    nvidia-smi can outlast its own time limit, or list a GPU only once it is up.
    """
    assert run.plan is not None
    t0 = time.monotonic()
    while True:
        smi = run.facts.get("nvidia_smi_gpus")
        missing = [b for b in run.plan.gpus if smi is None or b not in smi]
        waited = time.monotonic() - t0
        if not missing:
            if waited > 0.5:
                evidence.current().note(
                    f"nvidia-smi listed every GPU {waited:.1f} s after the first try (firmware start on first open)"
                )
            return waited > 0
        if waited >= run.opts.gsp_wait:
            evidence.current().note(
                f"nvidia-smi still misses {', '.join(missing)} after {waited:.0f} s (the bound for the firmware start)"
            )
            return True
        time.sleep(2.0)
        run.read_facts(("nvidia_smi_gpus",))


def step_drivers_bound(run: P2PProcedure) -> Step:
    """Step 5: every in-scope function is on its original driver, /dev/nvidiaN unchanged, nvidia-smi sees all."""

    def check() -> Check:
        assert run.plan is not None
        plan = run.plan
        if run.check_only and plan.groups_to_fix:
            return Check(
                False,
                f"step 4 would unbind {sum(len(g.functions) for g in plan.groups_to_fix)} functions; they are rebound here",
            )
        run.read_facts(("gpus", "nvidia_smi_gpus"))
        now = {m.bdf: m.driver for g in run.gpus() if g.group for m in g.group.members}
        if run.changed and all(now.get(f.bdf) == f.driver for f in plan.rebind_order):
            if wait_for_firmware(run):  # the minors in `gpus` come from the same nvidia-smi: read again
                run.read_facts(("gpus", "nvidia_smi_gpus"))
        minors = {g.bdf: g.minor for g in run.gpus()}
        for f in (f for g in plan.groups for f in g.functions):
            f.current = now.get(f.bdf)
        wrong = [
            f"{f.bdf} on {f.current or 'no driver'} (was {f.driver})"
            for g in plan.groups
            for f in g.functions
            if f.current != f.driver
        ]
        renumbered = [
            f"{b}: {'no ' if minors.get(b) is None else ''}/dev/nvidia{'N' if minors.get(b) is None else minors[b]} (was /dev/nvidia{m})"
            for b, m in plan.minors.items()
            if minors.get(b) != m and not (minors.get(b) is None and now.get(b) is None)
        ]
        smi = run.facts.get("nvidia_smi_gpus")
        unseen = [b for b in plan.gpus if smi is not None and b not in smi]
        state = {"drivers": now, "minors": minors, "nvidia_smi": sorted(smi or {})}
        problems = wrong + renumbered + [f"nvidia-smi does not list {b}" for b in unseen]
        if smi is None:
            problems.append("nvidia-smi did not run")
        ok_line = f"{len(plan.gpus)} GPUs on nvidia as /dev/nvidia{','.join(str(plan.minors[b]) for b in plan.gpus if b in plan.minors)}; nvidia-smi sees all"
        return Check(not problems, "; ".join(problems) or ok_line, state)

    def fix(actions: list[Action], before: Check) -> None:
        assert run.plan is not None
        run.changed = True
        run.push_rebind_undo()
        for f in run.plan.rebind_order:
            if run.driver_now(f.bdf):
                continue
            run.record("bind", bdf=f.bdf, driver=f.driver)
            pci.bind(run.conn, f.bdf, f.driver, timeout=run.opts.unbind_timeout)
        run.journal.write(phase="rebound")

    return run.step(
        "drivers bound",
        check,
        lambda before: actions.bind_actions(run, all_functions=run.check_only),
        fix,
    )


def step_p2p_bandwidth(run: P2PProcedure) -> Step:
    """Step 6: every in-scope GPU pair reaches its threshold peer to peer."""

    def check() -> Check:
        assert run.plan is not None
        if len(run.plan.gpus) < 2:
            return Check(
                True,
                "fewer than two GPUs in scope",
                skip="fewer than two GPUs in scope: no pair to measure",
            )
        if run.before is not None and not run.changed:
            matrix = run.before
        else:
            run.read_facts(("nvidia_smi_gpus",))
            matrix = p2p.measure_anywhere(run.measure_conns(), run.plan.gpus, index=run.smi_index())
            run.record_matrix("P2P bandwidth after", matrix)
            run.after = matrix
        run.no_tool = matrix.note if matrix.no_tool else ""
        state: dict[str, Any] = {"matrix": matrix.to_dict()}
        if matrix.no_tool:  # nothing was measured: say what to install where, not what to fix
            return Check(False, matrix.note, state)
        verdicts = run.judge(matrix)
        low = [v for v in verdicts if not v.ok]
        for v in verdicts:
            evidence.current().note(v.describe())
        measured = [v.gbps for v in verdicts if v.gbps is not None]
        line = (
            f"{len(verdicts)} pairs via {matrix.source}: min {min(measured):g} GB/s"
            if measured
            else f"no pair measured ({matrix.note})"
        )
        state["low"] = [v.describe() for v in low]
        if low:
            why = run.redirect_note(low)
            return Check(
                False,
                f"{len(low)} of {len(verdicts)} pairs below threshold, e.g. {low[0].describe()}{why}",
                state,
            )
        return Check(True, line, state)

    def plan(before: Check) -> list[Action]:
        assert run.plan is not None
        if run.check_only and run.plan.needs_repair:
            return [
                Action(
                    "measure again after steps 2-5 set the groups to identity",
                    f"nvbandwidth -t {p2p.NVBANDWIDTH_TEST}",
                    run.conn.name,
                    False,
                )
            ]
        return []

    def fix(actions: list[Action], before: Check) -> None:
        if run.no_tool:
            raise ProcedureError(run.no_tool)
        why = run.redirect_note(None)
        raise ProcedureError(
            "P2P stays below threshold with every in-scope group in identity mode"
            + (
                why
                or ": look for PCIe ACS on the path (lspci -vvv | grep ACSCtl), a link trained down, or BIOS settings"
            )
        )

    return run.step("p2p bandwidth", check, plan, fix)


def step_persisted(run: P2PProcedure) -> Step:
    """Step 8: a boot-time unit sets exactly the in-scope groups to identity before the GPUs' users start."""

    def check() -> Check:
        assert run.plan is not None
        if not run.plan.groups:
            return Check(True, "no group in scope", skip="no IOMMU group in scope")
        boot = persist.boot_identity((run.facts.get("host_info") or {}).get("cmdline") or "")
        if boot and not run.plan.needs_repair and not run.changed:
            return Check(True, f"identity at every boot by the kernel command line ({boot}): no unit needed")
        want_script, want_unit = persist.script_text(run.plan), persist.unit_text()
        files = run.conn.read_files([persist.SCRIPT, persist.UNIT])
        r = run.conn.run(["systemctl", "is-enabled", persist.UNIT_NAME], timeout=15)
        enabled = r.stdout.strip()
        problems = []
        if files[persist.SCRIPT] != want_script:
            problems.append(
                f"{persist.SCRIPT} "
                + ("missing" if isinstance(files[persist.SCRIPT], OSError) else "differs from the plan")
            )
        if files[persist.UNIT] != want_unit:
            problems.append(
                f"{persist.UNIT} " + ("missing" if isinstance(files[persist.UNIT], OSError) else "differs")
            )
        if enabled != "enabled":
            problems.append(f"{persist.UNIT_NAME} is {enabled or 'unknown'}, not enabled")
        groups = ", ".join(str(g.number) for g in run.plan.groups)
        state = {
            "enabled": enabled,
            "groups": [g.number for g in run.plan.groups],
            "script": want_script,
        }
        return Check(
            not problems, "; ".join(problems) or f"{persist.UNIT_NAME} enabled for groups {groups}", state
        )

    def fix(actions: list[Action], before: Check) -> None:
        assert run.plan is not None
        for path, text in (
            (persist.SCRIPT, persist.script_text(run.plan)),
            (persist.UNIT, persist.unit_text()),
        ):
            w = run.conn.write_file(path, text, timeout=15)
            if not w.ok:
                raise ProcedureError(f"writing {path} failed: {w.error}")
        for argv in (
            ["chmod", "0755", persist.SCRIPT],
            ["systemctl", "daemon-reload"],
            ["systemctl", "reenable", persist.UNIT_NAME],  # drops links of an older [Install]
        ):
            r = run.conn.run(argv, timeout=60)
            if r.rc != 0:
                raise ProcedureError(
                    f"{' '.join(argv)} failed (rc {r.rc}): {(r.stderr or r.stdout).strip()[:200]}"
                )

    return run.step("persisted", check, lambda before: actions.persist_actions(run), fix)


def health_url(run: P2PProcedure) -> str:
    """The URL polled for /health (from the service's own side)."""
    return run.opts.health_url or f"http://127.0.0.1:{run.opts.health_port}/health"


def log_text(run: P2PProcedure) -> str:
    """The service's log files and its last journal lines, read where it runs."""
    stem = run.service.unit.removesuffix(".service")
    paths = list(run.opts.log_paths) or [f"/var/log/sglang/{stem}.log"]
    files = run.svc_conn.read_files(paths)
    text = "\n".join(v for v in files.values() if isinstance(v, str))
    r = run.svc_conn.run(
        ["journalctl", "-u", run.service.unit, "--no-pager", "-n", "2000", "-o", "cat"], timeout=20
    )
    if r.rc == 0:
        text += "\n" + r.stdout
    return text


def step_service_restored(run: P2PProcedure) -> Step:
    """Step 9: the service this run stopped runs again, /health answers, NCCL uses P2P not SHM."""

    def check() -> Check:
        assert run.plan is not None
        if not run.has_service:
            why = f"no service to restore: {run.service_origin}"
            return Check(True, why, skip=why)
        if run.check_only and run.plan.needs_repair:
            return Check(False, f"{run.service.unit} would be stopped in step 2 and started again here")
        state = run.service.state()
        if not state.exists:
            return Check(
                True,
                f"no unit {run.service.unit}",
                skip=f"no unit {run.service.unit} on {run.service.where}",
            )
        if not state.running:
            if not run.stopped_service:
                return Check(
                    True,
                    f"{state.summary()}: not started by this run (it did not stop it)",
                    dataclasses.asdict(state),
                )
            return Check(False, f"{state.summary()}: stopped by this run", dataclasses.asdict(state))
        healthy, answer, waited = check_health(run.svc_conn, health_url(run), bound=run.opts.health_timeout)
        # NCCL's own line forms (modules/nccl.py): SHM lines have no "/conn" after the channel
        channels = nccl.parse_channels(log_text(run))
        last = channels[-1].transport if channels else None
        s = dataclasses.asdict(state) | {"health": answer, "health_wait_s": waited, "nccl": last}
        problems = []
        if not healthy:
            problems.append(f"{health_url(run)} answered {answer}")
        if channels and channels[-1].kind != "P2P":
            problems.append(f"NCCL transport is {last}, not P2P" + env_hint(run))
        problems += env_left_after_start(run)
        summary = f"{state.summary()}; /health {answer} after {waited:g} s" + (
            f"; NCCL via {last}" if last else ""
        )
        return Check(not problems, "; ".join(problems) or summary, s)

    def fix(actions: list[Action], before: Check) -> None:
        if not run.stopped_service:
            if (before.state or {}).get("active_state") in ("active", "activating", "reloading"):
                raise ProcedureError(f"{run.service.unit} runs, but: {before.summary}")
            raise ProcedureError(
                f"{run.service.unit} is not running and this run did not stop it: not starting it"
            )
        run.refuse_start_while_blocked(run.service.unit)
        # the undos, run now in order: nvidia-persistenced, then the service
        if run.stopped_persistenced:
            run.persistenced.start()
            run.stopped_persistenced = False
            run.journal.write(persistenced_stopped=False)
        run.resolve("start-persistenced")
        run.service.start()
        run.stopped_service = False
        run.journal.write(service_stopped=False, phase="service-started")
        run.resolve("start-service")
        env_started(run)

    return run.step(
        "service restored",
        check,
        lambda before: [actions.start_action(run, False)] if run.has_service else [],
        fix,
        on=run.svc_conn,
    )

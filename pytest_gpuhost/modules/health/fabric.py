"""Health checks of the paths between GPUs: PCIe link, NVLink, IOMMU group types, ACS, P2P.

Pure logic, no I/O (facts in, verdicts out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_gpuhost.modules.health.nvlink import judge_nvlink_errors
from pytest_gpuhost.modules.health.thresholds import (
    Thresholds,
    model_name,
    model_spec,
    unknown_note,
)
from pytest_gpuhost.modules.health.thresholds import unknown_models as unknown_models_of
from pytest_gpuhost.modules.health.verdict import (
    Facts,
    Verdict,
    cannot_see,
    facts_gpus,
    facts_part,
    failed,
    gpu_label,
    int_or_none,
    skipped,
)
from pytest_gpuhost.modules.parsers import P2P_STATUS_LEGEND

_GEN_BY_SPEED = {
    "2.5": 1,
    "5.0": 2,
    "5": 2,
    "8.0": 3,
    "8": 3,
    "16.0": 4,
    "16": 4,
    "32.0": 5,
    "32": 5,
    "64.0": 6,
    "64": 6,
}


def _sysfs_gen(speed: Any) -> int | None:
    if not isinstance(speed, str):
        return None
    return _GEN_BY_SPEED.get(speed.split(" ")[0])


#: Performance states in which a GPU is at work: its link runs at the generation it trained to.
#: P0 is the maximum performance state, P12 the minimum (nvidia-smi --help-query-gpu, "pstate").
LOADED_PSTATES = ("P0", "P1", "P2")


def gpu_at_work(g: Mapping[str, Any]) -> bool | None:
    """Say whether a GPU is at work now (P0..P2, or busy), False when idle, None when unknown.

    Only at work does the current PCIe generation say what the link can do: nvidia-smi
    --help-query-gpu says of pcie.link.gen.current "may be reduced when the GPU is not in use",
    and an idle GPU (P8) trains its link down (Gen1 of Gen4/Gen5) with its width untouched
    (docs/FACTS.md, "PCIe link of an idle GPU").
    """
    util = g.get("utilization.gpu")
    if isinstance(util, (int, float)) and util > 0:
        return True
    pstate = g.get("pstate")
    if not isinstance(pstate, str) or not pstate.startswith("P"):
        return None
    return pstate in LOADED_PSTATES


def check_pcie_link(facts: Facts, t: Thresholds) -> Verdict:
    """Judge each GPU's link as the hardware means it: width always, generation only at work.

    A lower width is a fault whatever the GPU does. The current generation is judged only where
    the GPU is at work (P0..P2 or busy): an idle GPU's link runs at a lower generation by design
    (power management), so it passes, and says it was not judged. The maximum generation
    (`pcie.link.gen.max`: what this GPU and slot can train to) does not move with the power
    state: the inventory's `pcie_gen_min` is held against it on idle GPUs too. DCGM's PCIe test
    (`dcgmi diag -r pcie`) measures the link under its own load: the `diag` check runs it when
    the inventory asks (docs/FACTS.md).
    """
    gpus, err = facts_gpus(facts)
    if err:
        return failed("pcie_link", f"nvidia-smi failed: {err}", [err])
    pci, _ = facts_part(facts, "pci")
    devices = (pci or {}).get("devices") or {}
    reasons = []
    below: list[str] = []
    idle: list[str] = []
    unknown_state: list[str] = []
    links: dict[str, dict[str, Any]] = {}
    for g in gpus:
        gen, gen_max = g.get("pcie.link.gen.current"), g.get("pcie.link.gen.max")
        width, width_max = g.get("pcie.link.width.current"), g.get("pcie.link.width.max")
        # sysfs where the driver does not report the link (older facts kept it with the PCI part)
        sys_link = g.get("sysfs_link") or (devices.get(str(g.get("bdf"))) or {}).get("link") or {}
        if not isinstance(gen, int):
            gen, gen_max = _sysfs_gen(sys_link.get("speed")), _sysfs_gen(sys_link.get("max_speed"))
        if not isinstance(width, int):
            width, width_max = int_or_none(sys_link.get("width")), int_or_none(sys_link.get("max_width"))
        at_work = gpu_at_work(g)
        links[str(g.get("bdf"))] = {
            "gen": gen,
            "gen_max": gen_max,
            "width": width,
            "width_max": width_max,
            "pstate": g.get("pstate"),
            "gen_judged": bool(at_work),
        }
        # the model's own link (MODELS): reported beside the GPU's maximum, never failing it
        model = model_name(str(g.get("name") or ""))
        spec = model_spec(str(g.get("name") or "")) or {}
        model_gen, model_width = spec.get("pcie_gen"), spec.get("pcie_width")
        if isinstance(model_gen, int):
            links[str(g.get("bdf"))].update({"model_gen": model_gen, "model_width": model_width})
        if isinstance(gen_max, int) and isinstance(model_gen, int) and gen_max < model_gen:
            below.append(
                f"{gpu_label(g)} max Gen{gen_max}, the {model} has Gen{model_gen} (the host limits it)"
            )
        want_gen = t["pcie_gen_min"] if t["pcie_gen_min"] is not None else gen_max
        want_width = t["pcie_width_min"] if t["pcie_width_min"] is not None else width_max
        if at_work:
            if isinstance(gen, int) and isinstance(want_gen, int) and gen < want_gen:
                reasons.append(
                    f"{gpu_label(g)}: PCIe Gen{gen}, below Gen{want_gen} (max Gen{gen_max}) "
                    f"at work ({g.get('pstate') or 'busy'})"
                )
        else:
            (idle if at_work is False else unknown_state).append(gpu_label(g))
            floor = t["pcie_gen_min"]
            if isinstance(gen_max, int) and isinstance(floor, int) and gen_max < floor:
                reasons.append(f"{gpu_label(g)}: PCIe max Gen{gen_max}, below Gen{floor} (this GPU and slot)")
        if isinstance(width, int) and isinstance(want_width, int) and width < want_width:
            reasons.append(f"{gpu_label(g)}: PCIe x{width}, below x{want_width} (max x{width_max})")
    state = {"links": links}
    if not links:
        return skipped("pcie_link", "no GPU on nvidia to check")
    if reasons:
        return failed("pcie_link", f"degraded PCIe link: {reasons[0]}", reasons, state=state)
    notes = []
    if idle:
        notes.append(
            f"generation not judged on {len(idle)} idle GPU(s) (their links train down to save power; "
            "width checked)"
        )
    if unknown_state:
        notes.append(
            f"generation not judged on {len(unknown_state)} GPU(s) whose performance state is unknown"
        )
    if below:
        notes.append(below[0] + (f" (and {len(below) - 1} more)" if len(below) > 1 else ""))
    note = "".join(f"; {n}" for n in notes)
    judged = [v for v in links.values() if v["gen_judged"]]
    shapes = sorted(
        {f"Gen{v['gen']} x{v['width']}" for v in judged}
        | {f"x{v['width']}" for v in links.values() if not v["gen_judged"]}
    )
    head = (
        f"all {len(links)} links at their maximum ({', '.join(shapes)})"
        if len(judged) == len(links)
        else f"all {len(links)} links at full width ({', '.join(shapes)})"
    )
    return Verdict("pcie_link", True, head + note, state=state)


def _expected_links(facts: Facts, t: Thresholds) -> dict[str, tuple[int, str]]:
    """Return {nvidia-smi index: (active links expected, GPU label)} for GPUs that must have NVLinks."""
    smi_gpus, _ = facts_gpus(facts)
    out = {}
    for g in smi_gpus:
        want = t["nvlink_active_min"]
        if want is None:
            spec = model_spec(str(g.get("name") or ""))
            want = spec["nvlinks"] if spec else None
        if want:
            out[str(g.get("index"))] = (int(want), gpu_label(g))
    return out


def check_nvlink(facts: Facts, t: Thresholds) -> Verdict:
    """Judge every GPU's NVLinks: each reported link up, and as many active as the model has.

    A GPU whose links are all down may print no link lines at all (or not appear in
    `nvidia-smi nvlink -s`): the count expected from the model (thresholds MODELS, or
    `nvlink_active_min`) catches it. A GPU of no known model has no expected count: the verdict
    names it ("unknown model: NAME (GPU N): NVLink count not judged"), skipping where no link is
    printed rather than reading it as a PCIe card. A GPU in MIG mode answers no NVLink query
    (nvidia-smi: "Nvlink queries are not supported for Devices in MIG mode"; the probe keeps that
    line as `mig`, of one GPU or of all): it is not checked, and says so, rather than read as a GPU
    with no active link.
    """
    part, err = facts_part(facts, "nvlink")
    required = t["nvlink_required"]
    gpus = (part or {}).get("gpus") or {}
    total = sum(len(g.get("links") or {}) for g in gpus.values())
    expected = _expected_links(facts, t)
    mig_all = (part or {}).get("mig")
    mig = {i for i, g in gpus.items() if g.get("mig")}
    if mig_all:  # said once for the host: every GPU that printed no link line
        mig |= {i for i in set(gpus) | set(expected) if not (gpus.get(i) or {}).get("links")}
    expected = {i: w for i, w in expected.items() if i not in mig}
    mig_note = ""
    if mig or mig_all:
        which = f"GPU {', '.join(sorted(mig, key=int))}: " if mig else ""
        mig_note = f"{which}not checked: MIG mode (NVLink queries unsupported)"
    smi_gpus, _ = facts_gpus(facts)
    # a GPU of no known model has no expected count: said in the verdict, never taken as a PCIe card
    unknown = unknown_note(smi_gpus, "NVLink count not judged") if t["nvlink_active_min"] is None else ""
    # error counters since the last run (health_nvlink), read where `nvlink -s` printed links
    counted, counters, note = judge_nvlink_errors(facts, t)
    if expected:
        short = []
        for idx, (want, label) in sorted(expected.items(), key=lambda kv: int(kv[0])):
            links = (gpus.get(idx) or {}).get("links") or {}
            active = sum(1 for st in links.values() if st.get("up"))
            if active < want:
                seen = f"{len(links)} link lines" if links else "no link lines"
                short.append(f"{label}: {active} of {want} NVLinks active ({seen})")
        if short or part is None:
            reasons = (short or [str(err)]) + counted
            summary = (
                f"{len(short)} GPU(s) with fewer active NVLinks than the model has" if short else str(err)
            )
            return failed(
                "nvlink",
                "; ".join(x for x in (summary, unknown, mig_note) if x),
                reasons,
                state={
                    "expected": {i: w for i, (w, _) in expected.items()},
                    "errors": counters,
                    "source": (part or {}).get("source"),
                },
            )
    if part is not None and total == 0 and mig_note:
        return skipped("nvlink", mig_note, mig=sorted(mig, key=int))
    if part is None or total == 0:
        if required:
            return failed(
                "nvlink", "no NVLink reported, but nvlink_required is set", [str(err or "no links")]
            )
        if unknown:
            return skipped("nvlink", f"no NVLink reported; {unknown} (set nvlink_active_min)")
        return skipped("nvlink", "no NVLink on this host" + (f" ({err})" if err else ""))
    reasons = []
    up = 0
    for idx, g in sorted(gpus.items(), key=lambda kv: int(kv[0])):
        for link, st in sorted((g.get("links") or {}).items(), key=lambda kv: int(kv[0])):
            if st.get("up"):
                up += 1
            else:
                reasons.append(f"GPU {idx} link {link}: {st.get('text') or 'down'}")
    state: dict[str, Any] = {
        "links_up": up,
        "links_total": total,
        "errors": counters,
        "source": part.get("source"),
    }
    if unknown:
        state["unknown_models"] = sorted(unknown_models_of(smi_gpus))
    if mig:
        state["mig"] = sorted(mig, key=int)
    if reasons or counted:
        down = f"{len(reasons)} of {total} NVLinks down" if reasons else ""
        grew = f"{len(counted)} NVLink error counter(s) past the limit since the last run" if counted else ""
        grew = counted[0] if "error" in counters else grew  # unreadable: say so, not "past the limit"
        summary = "; ".join(x for x in (down, grew, unknown, mig_note) if x)
        return failed("nvlink", summary, reasons + counted, state=state)
    summary = "; ".join(x for x in (f"all {total} NVLinks up", note, unknown, mig_note) if x)
    return Verdict("nvlink", True, summary, state=state)


def check_fabric(facts: Facts, t: Thresholds) -> Verdict:
    """On NVSwitch GPU models: every GPU's fabric trained (State Completed, Status Success), FM running.

    Until Fabric Manager has trained the fabric, CUDA fails on those GPUs (error 802, "system
    not yet initialized"); the probe reads the fabric only for models in thresholds MODELS
    with `fabric` (B300, B200, H100/H200/H800 SXM, H20), and only their GPUs are judged; a GPU of
    no known model is named in the skip ("unknown model: NAME").
    """
    smi_gpus, _ = facts_gpus(facts)
    # only GPUs of a fabric model are judged: the probe picks models by a substring of the name, so it
    # may read `-q` for a name no model matches (GH200 contains "H200")
    labels = {
        str(g.get("bdf")): gpu_label(g)
        for g in smi_gpus
        if (model_spec(str(g.get("name") or "")) or {}).get("fabric")
    }
    part = facts.get("fabric")
    if part is None or smi_gpus and not labels:
        unknown = unknown_note(smi_gpus, "whether it sits on NVSwitches is not known")
        why = "no NVSwitch GPU model on this host (thresholds MODELS: fabric)"
        return skipped("fabric", why + (f"; {unknown}" if unknown else ""))
    got, err = facts_part(facts, "fabric")
    if got is None:
        return failed("fabric", f"fabric state unreadable: {err}", [str(err)])
    fab = got.get("gpus") or {}
    others = {str(g.get("bdf")) for g in smi_gpus} - set(labels)
    reasons = []
    for bdf in sorted(set(labels) | (set(fab) - others)):
        label = labels.get(bdf, f"GPU ? ({bdf})")
        st = fab.get(bdf)
        if st is None:
            said = (
                "NVML gave no fabric state"
                if got.get("source") == "nvml"
                else "nvidia-smi -q shows no Fabric section"
            )
            reasons.append(f"{label}: {said}")
        elif st.get("state") != "Completed":
            reasons.append(f"{label}: fabric state {st.get('state')} (not trained: CUDA fails until it is)")
        elif st.get("status") != "Success":
            reasons.append(f"{label}: fabric training finished with status {st.get('status')}")
    unit = str(got.get("unit") or "nvidia-fabricmanager.service")
    svc = got.get("service") or {}
    active = svc.get("ActiveState")
    blind = svc.get("missing")
    if blind:
        pass  # the daemon runs on the host: a container cannot ask systemd about it (below)
    elif active != "active":
        what = (
            "not installed"
            if svc.get("LoadState") == "not-found"
            else (svc.get("error") or f"{active} ({svc.get('SubState')})")
        )
        reasons.append(f"{unit}: {what}")
    trained = {b: st for b, st in fab.items() if b not in others}
    state = {"gpus": trained, "service": svc, "source": got.get("source")}
    if reasons:
        return failed("fabric", reasons[0], reasons, state=state)
    if blind:
        what = "no systemctl on this node" if blind == "systemctl" else "PID 1 is not systemd on this node"
        return cannot_see(
            "fabric",
            f"fabric trained on {len(trained)} GPUs, but {unit}'s state cannot be read: {what}",
            "Fabric Manager runs on the host: run the check there",
            **state,
        )
    return Verdict("fabric", True, f"fabric trained on {len(trained)} GPUs; {unit} active", state=state)


def _nvidia_devices(facts: Facts) -> tuple[dict[str, Any], str | None]:
    pci, err = facts_part(facts, "pci")
    if pci is None:
        return {}, err
    return {b: d for b, d in (pci.get("devices") or {}).items() if d.get("driver") == "nvidia"}, None


def check_iommu_group_type(facts: Facts, t: Thresholds) -> Verdict:
    devs, err = _nvidia_devices(facts)
    if err:
        return failed("iommu_group_type", f"sysfs unreadable: {err}", [str(err)])
    if not devs:
        return skipped("iommu_group_type", "no GPU on nvidia (GPUs on vfio-pci belong to VMs)")
    allowed = list(t["iommu_group_types"])
    reasons = []
    types = {}
    for b, d in sorted(devs.items()):
        typ = d.get("iommu_type")
        types[b] = typ
        if d.get("iommu_group") is None:
            continue  # IOMMU off: no translation on the path
        if typ not in allowed:
            reasons.append(
                f"{b}: IOMMU group {d.get('iommu_group')} is {typ}, expected {' or '.join(allowed)}"
            )
    state = {"types": types}
    if reasons:
        return failed(
            "iommu_group_type",
            f"{len(reasons)} GPU IOMMU group(s) not {'/'.join(allowed)}",
            reasons,
            state=state,
        )
    shown = sorted({str(v) for v in types.values()})
    return Verdict("iommu_group_type", True, f"GPU IOMMU groups: {', '.join(shown)}", state=state)


def check_acs(facts: Facts, t: Thresholds) -> Verdict:
    devs, err = _nvidia_devices(facts)
    if err:
        return failed("acs", f"sysfs unreadable: {err}", [str(err)])
    bridges: dict[str, Mapping[str, Any]] = {}
    for d in devs.values():
        for br in d.get("bridges") or []:
            bridges[br["bdf"]] = br.get("acs") or {}
    if not bridges:
        return skipped("acs", "no upstream bridge found for the GPUs")
    unknown = sorted(b for b, a in bridges.items() if a.get("source") == "unknown")
    if len(unknown) == len(bridges):
        return skipped(
            "acs", f"ACS state unknown on {len(unknown)} bridge(s): config space unreadable and no lspci"
        )
    reasons = []
    for b, a in sorted(bridges.items()):
        ctl = a.get("ctl") or {}
        on = [k for k in ("ReqRedir", "CmpltRedir") if ctl.get(k)]
        if on and not t["acs_redirect_allowed"]:
            reasons.append(
                f"bridge {b}: ACS {'+ '.join(on)}+ redirects peer traffic through the root complex"
            )
    state = {"bridges": {b: dict(a) for b, a in bridges.items()}, "unknown": unknown}
    note = f"; unknown on {', '.join(unknown)}" if unknown else ""
    if reasons:
        return failed("acs", f"ACS redirect on {len(reasons)} GPU bridge(s){note}", reasons, state=state)
    return Verdict(
        "acs", True, f"no ACS redirect on {len(bridges) - len(unknown)} GPU bridge(s){note}", state=state
    )


def check_p2p(facts: Facts, t: Thresholds) -> Verdict:
    if not t["p2p_required"]:
        return skipped("p2p", "not required (p2p_required: false)")
    part, err = facts_part(facts, "p2p")
    if part is None:
        return failed("p2p", f"P2P matrix unavailable: {err}", [str(err)])
    labels = list(part.get("labels") or [])
    matrix = [list(r) for r in part.get("matrix") or []]
    if len(labels) < 2:
        return skipped("p2p", f"{len(labels)} GPU: no pair to check")
    reasons = []
    for i, row in enumerate(matrix):
        for j, cell in enumerate(row):
            if j <= i or cell in ("X", "OK"):
                continue
            reasons.append(
                f"{labels[i]} <-> {labels[j]}: {cell} ({P2P_STATUS_LEGEND.get(cell, 'unknown code')})"
            )
    pairs = len(labels) * (len(labels) - 1) // 2
    state = {"labels": labels, "matrix": matrix}
    if reasons:
        return failed(
            "p2p", f"P2P not available for {len(reasons)} of {pairs} GPU pairs", reasons, state=state
        )
    return Verdict("p2p", True, f"P2P OK for all {pairs} GPU pairs", state=state)

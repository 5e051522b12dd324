"""Decide what suites/p2p will do on a host, from one round trip of facts (pure: no I/O here).

In scope: GPUs on nvidia, or those named with --gpus. Never in scope: a GPU on vfio-pci, or any
GPU whose IOMMU group holds a vfio-pci function (the group belongs to a VM; the refusal names the
ports whose missing ACS made the kernel group them, modules/acs.py). From 6.4 a member on a
driver that manages its own DMA (pcieport, pci-stub) does not block the type write and is left
bound. Pairs whose peer traffic ACS redirect sends to the root complex are listed with what the
operator can do. A journal left by an
interrupted run says what the host looked like before that run touched it; its record of drivers,
minors and the service wins over what the host shows now (a GPU it unbound shows no driver).
"""

from __future__ import annotations

from typing import Any

from pytest_gpuhost.modules import acs, iommu, pci
from pytest_gpuhost.modules.gpu import GpuInfo
from pytest_gpuhost.modules.p2p_plan import FunctionPlan, GroupPlan, P2PPlan

__all__ = ["FunctionPlan", "GroupPlan", "P2PPlan", "make_plan", "parse_gpus_option"]


def parse_gpus_option(text: str | None) -> list[str] | None:
    """Parse --gpus: comma-separated PCI addresses (0000:17:00.0) or /dev/nvidiaN minors (0,1)."""
    if text is None or not str(text).strip():
        return None
    items = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    for item in items:
        if not (item.isdigit() or pci.BDF_RE.match(item)):
            raise ValueError(
                f"--gpus: {item!r} is neither a PCI address like 0000:17:00.0 nor a GPU minor like 0"
            )
    return items


def _journal_functions(journal: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for g in (journal or {}).get("plan", {}).get("groups", []):
        for f in g.get("functions", []):
            out[f["bdf"]] = f
    return out


def _journal_types(journal: dict[str, Any] | None) -> dict[int, str | None]:
    return {
        int(g["number"]): g.get("original_type") for g in (journal or {}).get("plan", {}).get("groups", [])
    }


def _wanted(
    gpus: list[GpuInfo], selected: list[str], recorded: dict[str, dict[str, Any]], errors: list[str]
) -> set[str]:
    """The PCI addresses --gpus names (a minor found in a journal too); what it cannot name, in `errors`."""
    by_minor = {g.minor: g for g in gpus if g.minor is not None}
    wanted: set[str] = set()
    for item in selected:
        if item.isdigit():
            g = by_minor.get(int(item)) or next(
                (x for x in gpus if recorded.get(x.bdf, {}).get("minor") == int(item)), None
            )
            if g is None:
                errors.append(f"--gpus names minor {item}, but no GPU on nvidia has /dev/nvidia{item}")
                continue
            wanted.add(g.bdf)
        elif not any(g.bdf == item for g in gpus):
            errors.append(f"--gpus names {item}, which is not an NVIDIA GPU on this host")
        else:
            wanted.add(item)
    return wanted


def make_plan(
    gpus: list[GpuInfo],
    *,
    kernel: str,
    selected: list[str] | None = None,
    journal: dict[str, Any] | None = None,
    paths: dict[str, acs.GpuPath] | None = None,
) -> P2PPlan:
    """Return the plan for these GPUs (from the `gpus` fact), honouring --gpus and a left-over journal.

    `paths` (the `pci_paths` fact, modules/acs.py) explains shared groups and finds ACS redirects.
    """
    recorded = _journal_functions(journal)
    recorded_types = _journal_types(journal)
    excluded: dict[str, str] = {}
    errors: list[str] = []
    shared: dict[int, str] = {}
    chosen: list[GpuInfo] = []
    wanted = _wanted(gpus, selected or [], recorded, errors)
    for g in gpus:
        original = recorded.get(g.bdf, {}).get("driver") or g.driver
        if g.on_vfio or original == "vfio-pci":
            if g.driver == "vfio-pci" or original == "vfio-pci":
                why = "on vfio-pci (belongs to a VM)"
            else:
                why = _shared_group(g, paths or {}, shared)
            excluded[g.bdf] = f"{why}: never touched"
            if g.bdf in wanted:
                errors.append(f"--gpus names {g.bdf}, which is {why}: refusing to touch it")
            continue
        if selected is not None and g.bdf not in wanted:
            excluded[g.bdf] = "not listed in --gpus"
            continue
        if original != "nvidia":
            excluded[g.bdf] = f"on {original or 'no driver'}, not nvidia"
            if g.bdf in wanted:
                errors.append(f"--gpus names {g.bdf}, which is {excluded[g.bdf]}")
            continue
        if g.group is None or g.group_type is None:
            excluded[g.bdf] = "no IOMMU group type (IOMMU off, or kernel older than 5.2)"
            continue
        chosen.append(g)

    groups: dict[int, GroupPlan] = {}
    for g in chosen:
        assert g.group is not None
        number = g.group.number
        if number in groups:
            continue
        gp = GroupPlan(number, g.group.type, recorded_types.get(number, g.group.type))
        gp.members = [m.bdf for m in g.group.members]
        for m in g.group.members:
            rec = recorded.get(m.bdf, {})
            original = rec.get("driver") or m.driver
            if original is None:
                # a function without a driver that no journal accounts for: leave it as it is
                original = ""
            is_gpu = bool(rec.get("is_gpu", m.is_gpu))
            minor = rec.get("minor") if rec else None
            if minor is None and m.bdf == g.bdf:
                minor = g.minor
            gp.functions.append(FunctionPlan(m.bdf, original, m.driver, is_gpu, minor))
        gp.functions = [f for f in gp.functions if f.driver]
        # 6.4+: a member whose driver manages its own DMA does not count as bound: leave it bound
        keep = [f for f in gp.functions if f.current and not iommu.blocks_type_change(f.driver, kernel)]
        gp.kept = [f"{f.bdf} ({f.driver})" for f in keep]
        gp.functions = [f for f in gp.functions if f not in keep]
        groups[number] = gp

    ordered = sorted(groups.values(), key=lambda gp: gp.number)
    plan = P2PPlan(
        gpus=[],
        groups=ordered,
        excluded=excluded,
        errors=errors,
        kernel=kernel,
        resumed_from=(journal or {}).get("run_id") if journal else None,
        links={g.bdf: dict(g.function.link) for g in chosen},
        shared=shared,
    )
    plan.gpus = [f.bdf for f in plan.rebind_order if f.is_gpu]
    for i, a in enumerate(plan.gpus):
        for b in plan.gpus[i + 1 :]:
            r = acs.redirect(paths or {}, a, b)
            if r is not None:
                plan.redirects.append(r)
    plan.errors.extend(_era_errors(plan))
    return plan


def _era_errors(plan: P2PPlan) -> list[str]:
    """Refuse up front what the kernel will refuse anyway, before anything is stopped or unbound."""
    if not plan.groups_to_fix or not plan.kernel:
        return []
    try:
        era = iommu.kernel_version(plan.kernel)
    except ValueError:
        return []
    if era < (5, 2):
        return [
            f"kernel {plan.kernel} has no /sys/kernel/iommu_groups/N/type (5.2+, writable from 5.11): "
            "boot with iommu=pt instead"
        ]
    if era < (5, 11):
        return [
            f"kernel {plan.kernel} (5.2-5.10) shows /sys/kernel/iommu_groups/N/type read-only: the file is 0444 "
            "with no store, so writing it fails with EACCES even as root (fs/kernfs/file.c kernfs_fop_open()); "
            "it is writable from 5.11 (commit 08a27c1c3ecf). Nothing was changed: boot with iommu=pt (every group "
            "identity at boot), or run kernel 6.4 or later (5.11-6.3 cannot retype a GPU with its audio function)"
        ]
    multi = [g for g in plan.groups_to_fix if len(g.members) > 1 and not g.identity]
    if era < (6, 4) and multi:
        groups = ", ".join(str(g.number) for g in multi)
        what = (
            "GPU and audio function"
            if all(len(g.members) == 2 for g in multi)
            else "; ".join(f"group {g.number}: {', '.join(g.members)}" for g in multi)
        )
        return [
            f"kernel {plan.kernel} (before 6.4) cannot change the type of a group with more than one device "
            f"(groups {groups}: {what}): boot with iommu=pt, or run kernel 6.4 or later"
        ]
    return []


def _shared_group(g: GpuInfo, paths: dict[str, acs.GpuPath], shared: dict[int, str]) -> str:
    """Why a GPU on nvidia is out of scope: its group also holds a VM's (vfio-pci) device.

    The type of a group is one setting for all its members: changing it means unbinding the VM's
    device, so the group is refused. The kernel groups devices that ACS does not isolate
    (drivers/iommu/iommu.c pci_device_group()): the ports that lack it are named.
    """
    assert g.group is not None
    vm = [m.bdf for m in g.group.members if m.driver == "vfio-pci"]
    path = paths.get(g.bdf)
    gaps = acs.isolation_gaps(path)
    unknown = [p for p in path.ports if p.isolates() is None] if path else []
    if gaps:
        cause = "ACS missing on " + "; ".join(p.describe() for p in gaps)
    elif unknown:
        cause = "of the ports above it; their ACS state could not be read: " + "; ".join(
            p.describe() for p in unknown
        )
    elif path is not None:
        cause = "the two are functions of one device, or a quirk or DMA alias joins them (no port above lacks ACS)"
    else:
        cause = "of the ports above it, which were not read (no pci_paths fact)"
    why = (
        f"group {g.group.number} holds {g.bdf} (nvidia) and {', '.join(vm)} (vfio-pci, a VM's): the kernel "
        f"grouped them because {cause} (drivers/iommu/iommu.c pci_device_group()); changing the group's type "
        f"would unbind the VM's device, so group {g.group.number} is refused and {', '.join(vm)} is never "
        "touched. Options: (1) enable ACS for that port in the BIOS if it offers it, or move one of the two "
        "to a slot whose ports implement ACS (the kernel turns ACS on at boot wherever the port has it: "
        "drivers/pci/pci.c pci_std_enable_acs()): a reboot, or a power-off to move a card; (2) give the whole "
        "group to one side (the VM takes the GPU too, or gives its device back): one GPU fewer for the other "
        "side. Not an option: the out-of-tree pcie_acs_override patch only pretends the port isolates, and the "
        "VM's device could then reach this GPU peer-to-peer without the IOMMU seeing it"
    )
    shared.setdefault(g.group.number, why)
    return why


def redirect_advice(redirects: list[acs.Redirect]) -> str:
    """What ACS redirect means for these pairs once their groups are identity, and the operator's options."""
    if not redirects:
        return ""
    ports = sorted({p for r in redirects for p in r.ports})
    pairs = ", ".join(f"{r.a} <-> {r.b} (switch {r.switch})" for r in redirects)
    return (
        f"identity domains alone do not restore direct P2P for {pairs}: ACS P2P Request/Completion Redirect is "
        f"on at {', '.join(ports)} (the kernel sets it at boot on every port that implements it while the IOMMU "
        "is on: drivers/pci/pci.c pci_std_enable_acs()), so their peer requests go up to the root complex and "
        "back instead of turning in the switch (PCIe Base Spec 'Access Control Services'; NCCL troubleshooting "
        "'PCI Access Control Services'). Options: (1) accept P2P through the root complex (lower bandwidth; none "
        "where the root complex does not forward peer traffic); (2) boot with "
        f"pci=disable_acs_redir={';'.join(ports)} (commit aaca43fda742, kernel-parameters.txt): those ports then "
        "no longer isolate what is below them, so the kernel puts the devices below each of these switches in "
        "one IOMMU group (they can only be given to a VM, or retyped, together): only where no VM's device sits "
        "below them"
    )

"""The plan of a P2P repair: the IOMMU groups it sets to identity, and each function's drivers.

Pure data, made by suites/p2p (its plan step decides it from the host's facts) and read by the
boot unit (`p2p_boot`) and the lab's real-kernel check of that unit, which builds one for a guest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.modules import acs, iommu, pci

__all__ = ["FunctionPlan", "GroupPlan", "P2PPlan"]


@dataclass
class FunctionPlan:
    """One PCI function of an in-scope group: the driver it must end up on, as it is now."""

    bdf: str
    driver: str  # the original driver: what it is rebound to
    current: str | None  # what it is bound to now
    is_gpu: bool
    minor: int | None = None  # original /dev/nvidiaN of a GPU

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict (journal, evidence)."""
        return {
            "bdf": self.bdf,
            "driver": self.driver,
            "current": self.current,
            "is_gpu": self.is_gpu,
            "minor": self.minor,
        }


@dataclass
class GroupPlan:
    """One in-scope IOMMU group."""

    number: int
    type: str | None
    original_type: str | None
    functions: list[FunctionPlan] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # members left bound (6.4+: pcieport, pci-stub)
    # every device of the group, with a driver or not: 5.11-6.3 refuse a group of more than one
    # whatever its members' drivers (iommu_group_store_type(): iommu_group_device_count() != 1)
    members: list[str] = field(default_factory=list)

    @property
    def identity(self) -> bool:
        """True when the group is already in identity mode."""
        return self.type == "identity"

    @property
    def unbind_order(self) -> list[FunctionPlan]:
        """GPU first (if its unbind blocks, nothing else of the group was touched), then the rest."""
        return sorted(self.functions, key=lambda f: (not f.is_gpu, f.bdf))

    def to_group(self) -> iommu.IommuGroup:
        """Return the IommuGroup (members with their current drivers) for error messages."""
        return iommu.IommuGroup(
            self.number, self.type, [pci.PciFunction(bdf=f.bdf, driver=f.current) for f in self.functions]
        )

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict (journal, evidence)."""
        return {
            "number": self.number,
            "type": self.type,
            "original_type": self.original_type,
            "functions": [f.to_dict() for f in self.functions],
            "kept": list(self.kept),
        }


@dataclass
class P2PPlan:
    """What the procedure will do on one host."""

    gpus: list[str]  # in-scope GPU BDFs, in original minor order
    groups: list[GroupPlan]
    excluded: dict[str, str]  # BDF -> why it is not in scope
    errors: list[str]  # reasons to refuse to act at all
    kernel: str
    resumed_from: str | None = None  # run id of the interrupted run this one completes
    links: dict[str, dict[str, Any]] = field(default_factory=dict)
    model: str = ""
    shared: dict[int, str] = field(default_factory=dict)  # group -> why it is refused (a VM's device in it)
    redirects: list[acs.Redirect] = field(default_factory=list)  # in-scope pairs sent up by ACS

    @property
    def groups_to_fix(self) -> list[GroupPlan]:
        """Groups that are not identity yet, or have a function off its original driver."""
        return [g for g in self.groups if not g.identity or any(f.current != f.driver for f in g.functions)]

    @property
    def needs_identity(self) -> list[int]:
        """Numbers of in-scope groups that are not identity."""
        return [g.number for g in self.groups if not g.identity]

    @property
    def unbound(self) -> list[FunctionPlan]:
        """In-scope functions that are not on their original driver (an interrupted run's leftovers)."""
        return [f for g in self.groups for f in g.functions if f.current != f.driver]

    @property
    def needs_repair(self) -> bool:
        """True when the disruptive part (stop, unbind, retype, rebind) has to run."""
        return bool(self.groups_to_fix) or self.resumed_from is not None

    @property
    def rebind_order(self) -> list[FunctionPlan]:
        """GPUs in their original minor order (so /dev/nvidiaN comes back the same), then the rest."""
        fns = [f for g in self.groups for f in g.functions]
        gpus = sorted(
            (f for f in fns if f.is_gpu), key=lambda f: (f.minor if f.minor is not None else 1 << 20, f.bdf)
        )
        return gpus + sorted((f for f in fns if not f.is_gpu), key=lambda f: f.bdf)

    @property
    def minors(self) -> dict[str, int]:
        """Original minor of each in-scope GPU."""
        return {f.bdf: f.minor for g in self.groups for f in g.functions if f.is_gpu and f.minor is not None}

    def summary(self) -> str:
        """Return one line: scope, groups to change, exclusions."""
        scope = ", ".join(self.gpus) or "none"
        todo = ", ".join(str(n) for n in self.needs_identity) or "none"
        excl = f"; excluded: {len(self.excluded)}" if self.excluded else ""
        resumed = f"; completes interrupted run {self.resumed_from}" if self.resumed_from else ""
        shared = "".join(f"; refused: {why}" for why in self.shared.values())
        redir = (
            f"; ACS redirect: {len(self.redirects)} pair(s) through the root complex even in identity"
            if self.redirects
            else ""
        )
        return f"in scope: {scope}; groups to set identity: {todo}{excl}{shared}{redir}{resumed}"

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict (journal, evidence)."""
        return {
            "gpus": self.gpus,
            "groups": [g.to_dict() for g in self.groups],
            "excluded": self.excluded,
            "errors": self.errors,
            "kernel": self.kernel,
            "resumed_from": self.resumed_from,
            "shared": {str(k): v for k, v in self.shared.items()},
            "redirects": [r.describe() for r in self.redirects],
        }

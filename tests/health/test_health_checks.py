"""Each health check is declared once (health.checks.DECLARED), and what is made from it agrees.

The declaration names the verdict function, the facts parts and inventory variables it reads,
its fix, whether the node check runs it and the lab test that fails it. These tests hold the
declaration to the code: a variable a verdict reads but its declaration does not name, a lab
test that does not exist, a suite test or node-check subset that is not the declaration's.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuhost.modules.health import checks as hm
from pytest_gpuhost.modules.health import facts as health_facts
from pytest_gpuhost.modules.health import fast
from tests.health.test_health_verdicts import SERVICE_VARS, gpu, healthy

ROOT = Path(__file__).resolve().parents[2]
#: Variables no verdict reads: they bound the probe itself (thresholds.probe_params).
PROBE_WIDE = {"probe_timeout"}


class Recording(hm.Thresholds):
    """Thresholds that remember every variable a verdict asks for."""

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__(values)
        self.seen: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self.seen.add(name)
        return super().__getitem__(name)


def failing() -> dict[str, Any]:
    """Facts on which most GPU checks fail: hot, erroring, throttled, slow links."""
    facts = healthy()
    bad = {
        "temperature.gpu": 99,
        "ecc.errors.uncorrected.volatile.total": 3,
        "ecc.errors.corrected.volatile.total": 9,
        "clocks_throttle_reasons.active": 0x40,
        "pcie.link.gen.current": 3,
        "pcie.link.width.current": 8,
        "persistence_mode": 0,
    }
    facts["gpus"]["gpus"] = [gpu(i, **bad) for i in range(4)]
    return facts


@pytest.mark.parametrize("check", hm.CHECKS)
def test_a_verdict_reads_only_the_variables_its_declaration_names(check: str) -> None:
    c = hm.declared(check)
    for facts in (healthy(), failing()):
        t = Recording(dict(hm.Thresholds.from_vars(SERVICE_VARS).values))
        hm.evaluate(check, facts, t)
        assert t.seen <= set(c.thresholds), (check, sorted(t.seen - set(c.thresholds)))


def test_every_variable_is_declared_by_a_check_and_every_declared_one_exists() -> None:
    known = {t.name for t in hm.THRESHOLDS}
    declared = {v for c in hm.DECLARED for v in c.thresholds}
    assert declared <= known, sorted(declared - known)
    assert known - declared == PROBE_WIDE, sorted(known - declared)


def test_declared_parts_are_facts_parts_and_names_are_unique() -> None:
    assert len(set(hm.CHECKS)) == len(hm.CHECKS)
    for c in hm.DECLARED:
        assert c.reads and set(c.reads + c.also_reads) <= set(health_facts.PARTS), c.name
        assert c.holds.endswith(".") and c.fails_when and "\n" not in c.holds + c.fails_when, c.name
        assert bool(c.fix) == bool(c.fix_runs), c.name


def test_each_lab_test_named_exists() -> None:
    """A declaration's `lab` is a test that fails the check on a lab host; it must be there."""
    named = [c for c in hm.DECLARED if c.lab]
    assert len(named) >= 18, [c.name for c in hm.DECLARED if not c.lab]
    for c in named:
        path, _, func = c.lab.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert func in tests, (c.name, c.lab)
        assert c.name in (ROOT / path).read_text(), (c.name, c.lab)  # the test reads that check


def test_the_suite_has_one_test_per_declared_check_in_order_with_its_line() -> None:
    spec = importlib.util.spec_from_file_location("suite_health", ROOT / "suites/health/test_health.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tests = [n for n in vars(mod) if n.startswith("test_")]
    assert tests == [f"test_{c}" for c in hm.CHECKS]
    for c in hm.DECLARED:
        assert getattr(mod, f"test_{c.name}").__doc__ == c.holds


def test_the_node_check_subset_and_fixes_come_from_the_declaration() -> None:
    assert fast.NIGHTLY_ONLY == {
        "cuda_version",
        "iommu_group_type",
        "acs",
        "p2p",
        "service",
        "service_health",
        "diag",
    }
    assert fast.KERNEL_LOG_CHECKS == {"xid", "sxid", "clock_events", "pcie_aer", "infiniband", "nvlink"}
    assert fast.default_checks() == [c.name for c in hm.DECLARED if not c.nightly_only]
    assert dict(hm.FIXES) == {"persistence": "persistence_mode", "service": "service"}
    assert fast.parts_for(["temperature"]) == [p for p in fast.parts_for(["xid"]) if p != "kernel_log"]


def test_an_unknown_check_is_named_with_the_known_ones() -> None:
    with pytest.raises(KeyError, match="unknown health check 'gpu_cuont'; known: gpu_count, driver_version"):
        hm.evaluate("gpu_cuont", healthy(), hm.Thresholds.from_vars({}))

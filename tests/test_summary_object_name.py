"""The object a per-node run writes under a shared s3:// prefix is named after its node, safely."""

from __future__ import annotations

import pytest

from pytest_gpuhost.report.files import object_name


def test_one_host_run_is_named_after_that_host() -> None:
    assert object_name({"hosts": {"gpu-07": {}}}) == "gpu-07"


@pytest.mark.parametrize("raw", ["../etc", "a/b", "<img src=x>", "..", "x" * 300, "n\u00e9ud"])
def test_hostile_names_become_one_safe_component(raw: str) -> None:
    name = object_name({"hosts": {raw: {}}})
    assert "/" not in name and name not in (".", "..") and "<" not in name and len(name) < 256
    assert object_name({"hosts": {raw + "!": {}}}) != name  # two different names never share a key


def test_fleet_run_uses_this_machines_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUHOST_NODE_NAME", "ctl-1")
    assert object_name({"hosts": {"a": {}, "b": {}}}) == "ctl-1"
    assert object_name({"hosts": {}}) == "ctl-1"

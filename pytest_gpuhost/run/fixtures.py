"""The plugin's fixtures; plugin.py registers this module in pytest_configure.

Registered after every entry-point plugin (testinfra included) so that `host` is ours whichever
order pytest loaded the plugins in. Not an entry point and not in `pytest_plugins` for that reason.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.run import evidence as evidence_mod
from pytest_gpuhost.run import remediation, settings
from pytest_gpuhost.run.targets_stash import NO_TARGET_REASON, get_target


class _CurrentEvidence:
    """The `evidence` fixture: forwards to the Evidence of the phase running when it is used."""

    def __getattr__(self, name: str) -> Any:
        return getattr(evidence_mod.current(), name)

    def __repr__(self) -> str:
        return f"<evidence of phase {evidence_mod.current().phase}>"


@pytest.fixture(scope="module")
def _gpuhost_target(request: pytest.FixtureRequest) -> Any:
    name = getattr(request, "param", None)
    if name is None:
        pytest.skip(NO_TARGET_REASON)
    return get_target(request.config, name)


@pytest.fixture(scope="module")
def target(_gpuhost_target: Any) -> Any:
    """The current target (`.spec`, `.conn`, `.container_conn`, `.vars`); one test per target."""
    return _gpuhost_target


@pytest.fixture(scope="module")
def host(_gpuhost_target: Any) -> Any:
    """A testinfra Host for the current target, running every command through its agent."""
    return _host_for(_gpuhost_target, container=False)


@pytest.fixture(scope="module")
def container(_gpuhost_target: Any) -> Any:
    """A testinfra Host for the target's container (--container or inventory); skips without one."""
    if getattr(_gpuhost_target, "container_conn", None) is None:
        pytest.skip(f"{_gpuhost_target.name}: no container: pass --container=pct:ID|lxc:NAME|docker:NAME")
    return _host_for(_gpuhost_target, container=True)


@pytest.fixture
def gpus(_gpuhost_target: Any) -> Any:
    """The target's NVIDIA GPUs (BDF, driver, IOMMU group, holders), read when the test starts."""
    from pytest_gpuhost.modules.gpu import inventory

    return inventory(_gpuhost_target)


@pytest.fixture(scope="session")
def check_only(pytestconfig: pytest.Config) -> bool:
    """True under --check-only: nothing may change a target."""
    return settings.read(pytestconfig).check_only


@pytest.fixture
def remediate(request: pytest.FixtureRequest, check_only: bool) -> remediation.Remediator:
    """Run a remediation (check, fix, re-check) for this test and its target."""
    target = None
    if remediation.TARGET_PARAM in request.fixturenames:
        target = request.getfixturevalue("target")
    fails = settings.read(request.config).cannot_see == "fail"
    return remediation.Remediator(request.node, target, check_only, cannot_see_fails=fails)


@pytest.fixture
def evidence() -> Any:
    """Record states, measurements, matrices and notes into this test's report."""
    return _CurrentEvidence()


def _host_for(target: Any, *, container: bool) -> Any:
    from pytest_gpuhost.exec.backend import make_host

    attr = "_gpuhost_container_host" if container else "_gpuhost_host"
    host = getattr(target, attr, None)
    if host is None:
        host = make_host(target.container_conn if container else target.conn)
        try:
            host.target = target
        except AttributeError:
            pass
        setattr(target, attr, host)
    return host

"""pytest fixture ``slurm``: real Slurm clusters over lab hosts, started once per test session.

Loaded by ``tests/conftest.py`` (``pytest_plugins``). Use::

    def test_drain(slurm):
        c = slurm.cluster(["health-ok", "health-ok", "health-pcie-degraded"], tag="drn")
        c.node_names()                    # ['gpu-node-01', 'gpu-node-02', 'gpu-node-03']
        c.run(["srun", "-N", "3", "hostname"])           # client commands as the controller
        c.node_states()                   # {'gpu-node-01': 'idle', ...} from sinfo
        c.nodes["gpu-node-03"]            # the LabHost behind a node (ssh, exec, reboot)
        c.node_exec(c.nodes["gpu-node-03"], ["scontrol", "show", "node", "gpu-node-03"])

``cluster(profiles, tag, extra_conf=())`` boots one lab host per profile, host names
``gpu-node-01``... in order (the Slurm node names), and starts slurmctld here and slurmd in each;
the same arguments give the same cluster for the rest of the session (``release(c)`` stops one
earlier, say at the end of a module). Every cluster is stopped before the lab hosts go down. Tests that use ``slurm`` are skipped, with the reason, when Slurm
is not installed (``scripts/setup.sh`` installs it) or the lab cannot run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from gpulab.host.lab import LabHost
from gpulab.profiles.load import load_profile
from gpulab.slurm.cluster import SlurmCluster, slurm_unavailable

__all__ = ["SlurmSession", "slurm"]


class SlurmSession:
    """Slurm clusters started for one test session, keyed by (tag, profiles, extra_conf)."""

    def __init__(self, lab: Any) -> None:
        self.lab = lab
        self._clusters: dict[tuple[str, tuple[str, ...], tuple[str, ...]], SlurmCluster] = {}

    def cluster(self, profiles: Sequence[str], tag: str, extra_conf: Sequence[str] = ()) -> SlurmCluster:
        """Return the session's cluster for these profiles, booting hosts and starting Slurm on first use."""
        key = (tag, tuple(profiles), tuple(extra_conf))
        c = self._clusters.get(key)
        if c is not None:
            return c
        hosts: list[LabHost] = []
        for i, prof in enumerate(profiles, 1):
            p = load_profile(prof, overrides={"hostname": f"gpu-node-{i:02d}"})
            hosts.append(self.lab.host(p, name=f"{tag}{os.getpid() % 100000}-{i:02d}"))
        c = SlurmCluster(hosts, extra_conf=extra_conf).start()
        self._clusters[key] = c
        return c

    def release(self, cluster: SlurmCluster) -> None:
        """Stop a cluster before the session ends (a module done with it); its lab hosts stay up."""
        for key, c in list(self._clusters.items()):
            if c is cluster:
                del self._clusters[key]
        cluster.stop()

    def close(self) -> None:
        """Stop every cluster (idempotent); the lab fixture takes the hosts down afterwards."""
        for c in self._clusters.values():
            with contextlib.suppress(Exception):
                c.stop()
        self._clusters.clear()


@pytest.fixture(scope="session")
def slurm(lab: Any) -> Iterator[SlurmSession]:
    """Hand out Slurm clusters over lab hosts; stop them at the end of the session."""
    why = slurm_unavailable()
    if why:
        pytest.skip(why)
    session = SlurmSession(lab)
    atexit.register(session.close)  # a safety net, as the lab's own fixture has
    try:
        yield session
    finally:
        session.close()

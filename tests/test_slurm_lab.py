"""A real Slurm over lab hosts: slurmctld here, slurmd and munged in four lab hosts (gpulab/slurm.py).

srun runs suites/health on every node against ``local://``, each node writes its summary to S3
(moto, bound to the controller's lab-side address), and ``python -m pytest_gpuhost.merge`` reads
them back as one fleet report.
"""

from __future__ import annotations

from typing import Any

import pytest

PROFILES = ["health-ok", "health-ok", "health-ok", "health-pcie-degraded"]


@pytest.fixture(scope="module")
def cluster(slurm: Any) -> Any:
    return slurm.cluster(PROFILES, tag="slm")


def test_srun_runs_one_task_per_node(cluster: Any) -> None:
    assert cluster.node_states() == {name: "idle" for name in cluster.node_names()}
    r = cluster.run(["srun", "-N", "4", "--ntasks-per-node=1", "hostname"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]

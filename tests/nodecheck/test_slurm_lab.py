"""A real Slurm over lab hosts: slurmctld here, slurmd and munged in four lab hosts (gpulab/slurm/cluster.py).

srun runs suites/health on every node against ``local://`` (each node names itself after its
host name, which is its Slurm node name), each node writes its summary to S3 (moto, bound to the
controller's lab-side address, which every lab host reaches), and ``python -m pytest_gpuhost.merge``
reads them back as one fleet report. Nodes: two healthy, one with an Xid 79 in its kernel log,
one with degraded PCIe links (fixtures/profiles/health-pcie-degraded.yaml).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulab.profiles.load import load_profile
from tests.helpers.s3server import FAKE_ENV, start_moto, stop_moto

REPO = Path(__file__).resolve().parents[2]
PROFILES = ["health-ok", "health-ok", "health-ok", "health-pcie-degraded"]
XID_NODE, PCIE_NODE = "gpu-node-03", "gpu-node-04"
XID_MSG = "NVRM: Xid (PCI:0000:13:00): 79, pid=2231, name=python3, GPU has fallen off the bus."


@pytest.fixture(scope="module")
def cluster(slurm: Any) -> Iterator[Any]:
    c = slurm.cluster(PROFILES, tag="slm")
    yield c
    slurm.release(c)  # the health checks it may run stop with it; the lab hosts stay for the session


@pytest.fixture(scope="module")
def healing(slurm: Any) -> Iterator[Any]:
    """A cluster of its own for the test that drains, heals and reboots nodes and leaves a person's
    drain and a HealthCheckProgram behind, so the other tests hold in any order."""
    c = slurm.cluster(PROFILES, tag="slh")
    yield c
    slurm.release(c)


@pytest.fixture(scope="module")
def s3(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """moto on the controller's lab-side address (lab hosts reach nothing else here); yields (url, bucket)."""
    log = tmp_path_factory.mktemp("moto-slurm") / "moto.log"
    proc, url = start_moto(log, host=cluster.ctl_address)
    try:
        import boto3

        bucket = f"slurm-{uuid.uuid4().hex[:10]}"
        boto3.client(
            "s3", endpoint_url=url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        ).create_bucket(Bucket=bucket)  # fmt: skip
        yield url, bucket
    finally:
        stop_moto(proc)


def srun_health(cluster: Any, url: str, dest: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``srun -N <all>``: suites/health on every node against local://, summary to ``dest`` (s3://.../)."""
    n = len(cluster.node_names())
    argv = [
        "srun", f"--nodes={n}", "--ntasks-per-node=1", f"--chdir={REPO}", "--time=5",
        "--input=none", f"--output={cluster.dir}/job-%j-%N.out",  # kept on each node, not streamed
        str(REPO / ".venv/bin/python"), "-m", "pytest", "suites/health", "--host=local://", "--check-only",
        "-p", "no:cacheprovider", "-o", "addopts=", "-q", "--report-dir=/tmp/gpuhost", f"--fleet-json={dest}",
        *extra,
    ]  # fmt: skip
    return cluster.run(argv, timeout=240, env={**FAKE_ENV, "AWS_ENDPOINT_URL": url})


def merge(url: str, source: str, out: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    argv = [sys.executable, "-m", "pytest_gpuhost.merge", source, "--endpoint-url", url, "-o", str(out)]
    p = subprocess.run(
        argv,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **FAKE_ENV},
    )
    data = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    return p, data


def inject_xid(host: Any) -> None:
    """Append an Xid 79 line to the host's kernel log (the lab's dmesg reads /var/lib/gpulab/kmsg).

    Stamped a second after the profile's last boot line, as tests/health/test_health_lab.py does.
    """
    after_boot = max(k.t for k in host.profile.kernel_log) + 1.0
    line = json.dumps({"t": after_boot, "msg": XID_MSG})
    r = host.ssh(["sh", "-c", "cat >> /var/lib/gpulab/kmsg"], input=line + "\n")
    assert r.returncode == 0, r.stderr


def test_srun_runs_one_task_per_node(cluster: Any) -> None:
    assert cluster.node_states() == {name: "idle" for name in cluster.node_names()}
    r = cluster.run(["srun", "-N", "4", "--ntasks-per-node=1", "hostname"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == ["gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04"]


def test_health_per_node_through_slurm_merged_from_s3(cluster: Any, s3: Any, tmp_path: Path) -> None:
    url, bucket = s3
    inject_xid(cluster.nodes[XID_NODE])
    dest = f"s3://{bucket}/nightly/"
    r = srun_health(cluster, url, dest)
    # Two nodes fail their checks, so their pytest exits 1 and srun reports it.
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])
    p, merged = merge(url, dest, tmp_path / "fleet.html")
    assert p.returncode == 1, p.stdout + p.stderr  # 1: some host failed
    hosts = merged["hosts"]
    assert sorted(hosts) == cluster.node_names(), sorted(hosts)
    failed = {name for name, h in hosts.items() if h["status"] != "ok"}
    assert failed == {XID_NODE, PCIE_NODE}, {n: h["status"] for n, h in hosts.items()}
    xid = hosts[XID_NODE]["checks"]["xid"]
    assert xid["outcome"] == "failed" and "code 79" in xid["summary"], xid
    assert any(XID_MSG in reason for reason in xid["reasons"]), xid
    pcie = hosts[PCIE_NODE]["checks"]["pcie_link"]
    assert pcie["outcome"] == "failed", pcie
    assert pcie["reasons"] == [
        "GPU 2 (0000:23:00.0): PCIe x8, below x16 (max x16)",
        "GPU 3 (0000:24:00.0): PCIe Gen4, below Gen5 (max Gen5) at work (P0)",
    ]
    for name in cluster.node_names():
        if name not in failed:
            assert hosts[name]["checks"]["xid"]["outcome"] == "passed", hosts[name]["checks"]["xid"]
    html = (tmp_path / "fleet.html").read_text()
    assert all(name in html for name in cluster.node_names())
    cluster.wait_idle()  # every step ended: the nodes are free for the next job


HEALTHCHECK = """#!/bin/sh
# slurm.conf HealthCheckProgram: slurmd runs it as root with no arguments (slurm.conf(5)), so
# the options come from the environment (docs/nodecheck.md); the lab's slurm.conf is not at
# /etc/slurm, so scontrol is told where it is. Each run is logged for the test.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin SLURM_CONF={conf}
export GPUHOST_NODECHECK_SLURM_DRAIN=1
echo "start $(date +%s.%N) $SLURMD_NODENAME" >> {log}
{python} -m pytest_gpuhost.nodecheck >> {log} 2>&1
rc=$?
echo "exit $rc $(date +%s.%N)" >> {log}
exit $rc
"""


def wait_for(cluster: Any, want: dict[str, str], timeout: float = 120) -> dict[str, str]:
    """Wait until sinfo shows each node in ``want`` in that state; return the last states."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = cluster.node_states()
        if all(states.get(n) == s for n, s in want.items()):
            return states
        time.sleep(0.5)
    raise AssertionError(
        f"nodes not {want} within {timeout:.0f} s: {states}, reasons {cluster.node_reasons()}"
    )


def test_nodecheck_drains_the_failed_nodes_and_resumes_them_when_healed(healing: Any) -> None:
    """srun runs gpuhost-nodecheck --slurm-drain on every node: the Xid and PCIe nodes drain with
    gpuhost reasons; a node a person drained stays drained while Slurm's HealthCheckProgram runs the
    same check on every node; the two faults healed (a reboot, a reseated link), they resume."""
    cluster = healing
    xid_host, pcie_host = cluster.nodes[XID_NODE], cluster.nodes[PCIE_NODE]
    inject_xid(xid_host)
    cluster.wait_idle()
    n = len(cluster.node_names())
    r = cluster.run(
        ["srun", f"--nodes={n}", "--ntasks-per-node=1", "--input=none", f"--output={cluster.dir}/nc-%j-%N.out",
         str(REPO / ".venv/bin/python"), "-m", "pytest_gpuhost.nodecheck", "--slurm-drain"],
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, (r.stdout, r.stderr)  # two nodes unhealthy
    ok1, ok2 = "gpu-node-01", "gpu-node-02"
    wait_for(cluster, {XID_NODE: "drained", PCIE_NODE: "drained", ok1: "idle", ok2: "idle"})
    reasons = cluster.node_reasons()
    assert sorted(reasons) == [XID_NODE, PCIE_NODE], reasons
    assert reasons[XID_NODE].startswith("gpuhost: xid") and "79" in reasons[XID_NODE], reasons
    assert reasons[PCIE_NODE].startswith("gpuhost: pcie_link"), reasons

    # A person drains a healthy node for maintenance; then Slurm runs the check on every node.
    r = cluster.run(["scontrol", "update", f"nodename={ok1}", "state=drain", "reason=maintenance"])
    assert r.returncode == 0, r.stderr
    log = f"{cluster.dir}/healthcheck.log"
    cluster.reconfigure(
        extra_conf=[
            f"HealthCheckProgram={cluster.dir}/bin/gpuhost-healthcheck",
            "HealthCheckInterval=10",
            "HealthCheckNodeState=ANY",
        ],
        files={"bin/gpuhost-healthcheck": HEALTHCHECK.format(
            conf=cluster.conf, log=log, python=REPO / ".venv/bin/python")},
    )  # fmt: skip

    # Heal: the Xid node is rebooted (Xid 79 owes a reboot); the PCIe node's GPUs are reseated
    # (its links train at full width and speed again) and it is rebooted. slurmd starts with the
    # node (here by hand) and runs the health check before it registers.
    pcie_host.set_profile(load_profile("health-ok", overrides={"hostname": PCIE_NODE}))
    for h in (xid_host, pcie_host):
        h.reboot()
        cluster.restart_node(h)
    states = wait_for(cluster, {XID_NODE: "idle", PCIE_NODE: "idle"}, timeout=120)
    # The person's drain: untouched, though the check ran there and passed after it was set.
    assert states[ok1] == "drained" and cluster.node_reasons() == {ok1: "maintenance"}, cluster.node_reasons()
    # slurmd runs the program every HealthCheckInterval (10 s) from the reconfigure on; the heal
    # can be quicker than that, so wait up to three intervals for the drained node's first run.
    deadline, runs = time.monotonic() + 30, ""
    while "exit " not in runs and time.monotonic() < deadline:
        time.sleep(0.5)
        runs = cluster.node_exec(cluster.nodes[ok1], ["sh", "-c", f"cat {log} 2>/dev/null"]).stdout
    assert "exit 0" in runs, runs
    assert cluster.node_states()[ok1] == "drained" and cluster.node_reasons() == {ok1: "maintenance"}
    assert states[ok2] == "idle"


# ---- without the lab: what the cluster would be given --------------------------------------


def _fake_host(name: str, index: int) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(profile=SimpleNamespace(hostname=name), index=index, address=f"198.18.{index}.2")


def test_missing_packages_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import gpulab.slurm.cluster as gs

    monkeypatch.setattr(gs, "PATH", str(tmp_path))  # nothing installed there
    why = gs.slurm_unavailable()
    assert why is not None
    assert "munge, slurm-client, slurmctld, slurmd" in why and "scripts/setup.sh" in why, why


def test_node_names_must_differ_and_conf_names_every_node() -> None:
    import shutil

    from gpulab.slurm.cluster import SlurmCluster, SlurmError

    with pytest.raises(SlurmError, match=r"share the host name\(s\) gpu-node.*overrides=\{'hostname'"):
        SlurmCluster([_fake_host("gpu-node", 5), _fake_host("gpu-node", 6)])
    c = SlurmCluster(
        [_fake_host("gpu-node-01", 5), _fake_host("gpu-node-02", 6)], extra_conf=["HealthCheckInterval=10"]
    )
    try:
        conf = c.conf_text()
        assert "SlurmctldHost=gpuhost-slurmctld(198.18.5.1)" in conf
        assert "NodeName=gpu-node-02 NodeAddr=198.18.6.2 CPUs=1" in conf
        assert f"AuthInfo=socket={c.dir}/munge/munge.socket" in conf
        assert "HealthCheckInterval=10" in conf and "ProctrackType=proctrack/linuxproc" in conf
        assert "/etc/" not in conf.replace("/etc/hosts", "")  # nothing of this machine's /etc
        assert c.hosts_text().splitlines()[1:] == [
            "198.18.5.1\tgpuhost-slurmctld",
            "198.18.5.2\tgpu-node-01",
            "198.18.6.2\tgpu-node-02",
        ]
    finally:
        shutil.rmtree(c.dir)

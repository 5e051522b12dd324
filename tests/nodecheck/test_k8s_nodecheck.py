"""gpuhost-nodecheck --k8s-label / --k8s-cordon, the program as the DaemonSet runs it.

The program runs for real (on this machine, and inside a lab host over SSH, where the lab's
nvidia-smi answers); the Kubernetes side is tests/helpers/kubeapi.py, the model of the API
server's node subset, reached with a kubeconfig as a pod's service account would be (the RBAC
rules of deploy/k8s/rbac.yaml). Not a cluster: docs/fleet.md says what that leaves unproven.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from pytest_gpuhost.modules.kube_node import ANN_CORDONED, ANN_REASON, LABEL  # noqa: E402
from tests.helpers.kubeapi import KubeAPIServer, serving  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PY = str(REPO / ".venv" / "bin" / "python")
NODE = "gpu-node-07"


@pytest.fixture
def server() -> Iterator[KubeAPIServer]:
    with serving(NODE) as srv:
        yield srv


def _failures(out: str) -> list[str]:
    """The program's failure lines (`CHECK: VALUE`), as it printed them."""
    skip = ("k8s:", "slurm:", "gpuhost-nodecheck:")
    return [line for line in out.splitlines() if line and not line.startswith(skip)]


def test_nodecheck_labels_this_machine_as_its_verdict_says(server: KubeAPIServer, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KUBECONFIG": str(server.kubeconfig(tmp_path / "kubeconfig")),
        "GPUHOST_STATE_DIR": str(tmp_path / "state"),
    }
    env.pop("KUBERNETES_SERVICE_HOST", None)
    # A budget this shared machine keeps (the budget itself is tests/nodecheck/test_nodecheck.py's).
    argv = [
        sys.executable,
        "-m",
        "pytest_gpuhost.nodecheck",
        f"--node-name={NODE}",
        "--k8s-label",
        "--budget=30",
    ]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    node = server.api.nodes[NODE]
    failures = _failures(r.stdout)
    if r.returncode == 1:  # this machine has no GPU: nvidia-smi is missing, gpu_count fails
        assert failures and node["metadata"]["labels"].get(LABEL) == "failed", r.stdout
        assert node["metadata"]["annotations"][ANN_REASON] == "; ".join(failures)[:1024]
        assert f"k8s: label {LABEL}=failed; annotate {ANN_REASON}: " in r.stdout
    else:
        assert node["metadata"]["labels"][LABEL] == "ok" and ANN_REASON not in node["metadata"]["annotations"]
    assert "unschedulable" not in node["spec"]  # --k8s-label alone never cordons
    assert {e["verb"] for e in server.api.log} <= {"get", "patch"}


def test_without_a_configuration_the_check_still_reports_and_says_why(tmp_path: Path) -> None:
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "missing"), "GPUHOST_STATE_DIR": str(tmp_path / "s")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    r = subprocess.run(
        [sys.executable, "-m", "pytest_gpuhost.nodecheck", f"--node-name={NODE}", "--k8s-cordon"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("k8s:")]
    assert line.startswith("k8s: no Kubernetes configuration (") and "set KUBECONFIG" in line


def _run(h: Any, *args: str) -> subprocess.CompletedProcess[str]:
    argv = ["env", "KUBECONFIG=/root/kubeconfig", PY, "-m", "pytest_gpuhost.nodecheck", "--budget=30", *args]
    return h.ssh(argv, timeout=60)


@pytest.mark.lab
def test_nodecheck_in_a_lab_node_cordons_a_failure_uncordons_its_own_and_leaves_a_persons(lab: Any) -> None:
    h = lab.host("health-ok", name=f"k8s-{os.getpid()}")
    srv = KubeAPIServer(host=h.address.rsplit(".", 1)[0] + ".1")  # the link's root side: the host reaches it
    try:
        srv.api.add_node(NODE)
        r = h.ssh("cat > /root/kubeconfig", input=srv.kubeconfig_text())
        assert r.returncode == 0, r.stderr
        node = srv.api.nodes

        ok = _run(h, f"--node-name={NODE}", "--k8s-cordon")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert node[NODE]["metadata"]["labels"][LABEL] == "ok" and "unschedulable" not in node[NODE]["spec"]
        assert f"k8s: label {LABEL}=ok" in ok.stdout

        # A fault: persistence mode off on every GPU (the daemon that holds it on, stopped).
        assert h.ssh("systemctl stop nvidia-persistenced && nvidia-smi -pm 0").returncode == 0
        bad = _run(h, f"--node-name={NODE}", "--k8s-cordon")
        assert bad.returncode == 1, bad.stdout + bad.stderr
        meta = node[NODE]["metadata"]
        assert meta["labels"][LABEL] == "failed" and "persistence_mode" in meta["annotations"][ANN_REASON]
        assert node[NODE]["spec"]["unschedulable"] is True and ANN_CORDONED in meta["annotations"]

        # Healed: gpuhost's own cordon goes.
        assert h.ssh("nvidia-smi -pm 1").returncode == 0
        healed = _run(h, f"--node-name={NODE}", "--k8s-cordon")
        assert healed.returncode == 0, healed.stdout + healed.stderr
        assert "uncordon (gpuhost cordoned it)" in healed.stdout and "unschedulable" not in node[NODE]["spec"]

        # A person cordons the node: a failure and a recovery later, it is still cordoned.
        srv.api.as_person(NODE, {"spec": {"unschedulable": True}})
        assert h.ssh("nvidia-smi -pm 0").returncode == 0
        again = _run(h, f"--node-name={NODE}", "--k8s-cordon")
        assert again.returncode == 1 and "left alone: already cordoned by someone else" in again.stdout
        assert h.ssh("nvidia-smi -pm 1").returncode == 0
        fine = _run(h, f"--node-name={NODE}", "--k8s-cordon")
        assert fine.returncode == 0 and "left alone: cordoned by someone else" in fine.stdout, fine.stdout
        assert (
            node[NODE]["spec"]["unschedulable"] is True
            and ANN_CORDONED not in node[NODE]["metadata"]["annotations"]
        )
        assert node[NODE]["metadata"]["labels"][LABEL] == "ok"
    finally:
        h.ssh("nvidia-smi -pm 1; systemctl start nvidia-persistenced")
        srv.close()

"""deploy/k8s: every manifest is valid Kubernetes, offline, and asks for what the checks need only.

Schema: kubernetes-validate (a dev dependency, Apache-2.0) bundles the JSON schemas generated from
the Kubernetes OpenAPI document of each release; `strict` refuses fields the schema does not know
(a misspelt field is otherwise dropped by the API server with a warning at most). Checked against the oldest
release the manifests are meant for (1.30; Indexed Jobs and runtime classes are GA well before it)
and the newest the package bundles.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OLDEST = "1.30"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if doc is not None:
                out.append((f"{path.name}#{i}:{doc.get('kind')}", doc))
    return out


DOCS = _docs()


def _kind(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for _, d in DOCS
        if d["kind"] in ("DaemonSet", "Job")
    ]


def test_the_manifests_are_there() -> None:
    kinds = sorted(d["kind"] for _, d in DOCS)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Job",
        "Job",
        "Namespace",
        "ServiceAccount",
    ]


@pytest.mark.parametrize("version", [OLDEST, kubernetes_validate.utils.latest_version()])
@pytest.mark.parametrize(("where", "doc"), DOCS, ids=[w for w, _ in DOCS])
def test_manifest_is_valid_against_the_openapi_schema(where: str, doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(
    ("path", "bad", "expect"),
    [
        # a misspelt field: strict validation refuses what the API server would drop unseen
        (("spec", "template", "spec", "containers", 0), {"imagePullPolicyy": "Always"}, "imagePullPolicyy"),
        # hostPID belongs to the pod spec, not the container
        (("spec", "template", "spec", "containers", 0), {"hostPID": True}, "hostPID"),
        # a wrong type: privileged is a boolean
        (("spec", "template", "spec", "containers", 0, "securityContext"), {"privileged": "yes"}, "yes"),
        # a port is a number
        (("spec", "template", "spec", "containers", 0), {"ports": [{"containerPort": "http"}]}, "http"),
        # a toleration's field misspelt at its own level
        (("spec", "template", "spec", "tolerations", 0), {"effects": "NoSchedule"}, "effects"),
    ],
)
def test_a_broken_manifest_fails_validation(path: tuple[Any, ...], bad: dict[str, Any], expect: str) -> None:
    doc = copy.deepcopy(_kind("DaemonSet"))
    node: Any = doc
    for step in path:
        node = node[step]
    node.update(bad)
    with pytest.raises(kubernetes_validate.ValidationError) as exc:
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)
    assert expect in str(exc.value), str(exc.value)
    kubernetes_validate.validate(_kind("DaemonSet"), kubernetes_validate.utils.latest_version(), strict=True)


def test_rbac_is_get_and_patch_on_nodes_only_for_our_service_account() -> None:
    role = _kind("ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    binding = _kind("ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    sa = _kind("ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}
    ]
    for name, spec in _pod_specs():
        if name == "gpuhost-fleet-merge":  # S3 only: no token at all
            assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
        else:
            assert spec["serviceAccountName"] == sa["metadata"]["name"], name


def test_node_pods_have_what_the_checks_need_and_no_more() -> None:
    for name, spec in _pod_specs():
        (c,) = spec["containers"]
        if name == "gpuhost-fleet-merge":
            assert "hostNetwork" not in spec and not c["securityContext"].get("privileged")
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            continue
        assert spec["runtimeClassName"] == "nvidia", name  # nvidia-smi from the container toolkit
        assert c["securityContext"] == {"privileged": True}, name  # dmesg, PCI config space
        assert spec["hostNetwork"] is True and "hostPID" not in spec, name
        env = {e["name"]: e for e in c["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}, name
        assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all", name
        assert "nvidia.com/gpu" not in str(c.get("resources")), name  # takes no GPU from workloads
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        state = volumes[mounts["/var/lib/gpuhost"]["name"]]
        assert state["hostPath"]["path"] == "/var/lib/gpuhost", name  # the Xid cursor outlives the pod
        assert env["GPUHOST_STATE_DIR"]["value"] == "/var/lib/gpuhost", name
        for p in ("/run/systemd", "/run/dbus"):
            assert mounts[p]["readOnly"] is True and volumes[mounts[p]["name"]]["hostPath"]["path"] == p


def _scripts() -> list[tuple[str, str]]:
    return [(name, spec["containers"][0]["args"][0]) for name, spec in _pod_specs()]


@pytest.mark.parametrize(("name", "script"), _scripts(), ids=[n for n, _ in _scripts()])
def test_container_scripts_parse_as_posix_sh(name: str, script: str) -> None:
    sh = shutil.which("dash") or shutil.which("sh")
    assert sh
    proc = subprocess.run([sh, "-n", "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _flags(script: str, program: str) -> set[str]:
    """The --flags a script passes to one program (its command may span continued lines)."""
    joined = script.replace("\\\n", " ")
    out: set[str] = set()
    for line in joined.splitlines():
        words = line.split()
        if program in words:
            out |= {re.sub(r"=.*", "", w) for w in words[words.index(program) + 1 :] if w.startswith("--")}
    return out


def _pytest_help(*where: str) -> subprocess.CompletedProcess[str]:
    """`pytest WHERE -p no:cacheprovider --help`, run from the checkout."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", *where, "-p", "no:cacheprovider", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_the_options_the_manifests_pass_exist() -> None:
    """Every option the pods give pytest, gpuhost-nodecheck or the merge is one the programs know."""
    scripts = "\n".join(s for _, s in _scripts())
    pytest_flags = _flags(scripts, "pytest") - {"--pyargs"}
    assert {"--host", "--node-name", "--check-only", "--fleet-json"} <= pytest_flags
    helptext = _pytest_help("--pyargs", "gpuhost_suites.health")
    if "gpuhost_suites" in helptext.stderr and "not found" in helptext.stderr:  # not installed as a package
        helptext = _pytest_help(str(ROOT / "suites" / "health"))
    for flag in sorted(pytest_flags):
        assert re.search(rf"(^|\s){re.escape(flag)}[=\s,]", helptext.stdout, re.M), (
            flag,
            helptext.stderr[-500:],
        )
    nodecheck_flags = _flags(scripts, "gpuhost-nodecheck")
    assert {"--node-name", "--k8s-label"} <= nodecheck_flags
    nodecheck_help = subprocess.run(
        [sys.executable, "-m", "pytest_gpuhost.nodecheck", "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    for flag in nodecheck_flags:
        assert flag in nodecheck_help, flag
    merge_flags = _flags(scripts.replace("python -m pytest_gpuhost.merge", "MERGE"), "MERGE") | {"-o"}
    merge_help = subprocess.run(
        [sys.executable, "-m", "pytest_gpuhost.merge", "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    for flag in merge_flags:
        assert flag in merge_help, flag

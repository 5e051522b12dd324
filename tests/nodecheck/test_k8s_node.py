"""modules/kube_node: node label, reason annotation, cordon and uncordon through the official client.

Run against tests/helpers/kubeapi.py, an HTTP model of the API server's node subset (no real API
server can be installed here; docs/fleet.md says what that leaves unproven). The client is the
real `kubernetes` package with a kubeconfig and a bearer token; the model enforces the RBAC rules
of deploy/k8s/rbac.yaml, the patch types and the resourceVersion precondition of the API server.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from pytest_gpuhost.errors import GpuhostError  # noqa: E402
from pytest_gpuhost.modules import kube_node  # noqa: E402
from pytest_gpuhost.modules.kube_node import (  # noqa: E402
    ANN_CORDONED,
    ANN_REASON,
    ANN_SINCE,
    LABEL,
    REASON_MAX,
    KubeNode,
    KubeNodeError,
    load_api,
)
from tests.helpers.kubeapi import ADMIN, SA, KubeAPIServer, serving  # noqa: E402

NODE = "gpu-node-07"
REASON = "xid: 1 Xid error(s) since the last run: code 79 (action: reboot)"


@pytest.fixture
def server() -> Iterator[KubeAPIServer]:
    with serving(NODE) as srv:
        yield srv


@pytest.fixture
def node(server: KubeAPIServer, tmp_path: Path) -> KubeNode:
    return KubeNode(NODE, load_api(str(server.kubeconfig(tmp_path / "kubeconfig"))), now=lambda: 1796083200.0)


def _node(server: KubeAPIServer) -> dict[str, Any]:
    return server.api.nodes[NODE]


def _patches(server: KubeAPIServer) -> list[dict[str, Any]]:
    return [e for e in server.api.log if e["verb"] == "patch"]


def test_a_failed_node_is_labelled_with_the_reason_and_not_cordoned_unless_asked(
    server: KubeAPIServer, node: KubeNode
) -> None:
    out = node.mark_failed(REASON)
    meta = _node(server)["metadata"]
    assert meta["labels"][LABEL] == "failed" and meta["labels"]["kubernetes.io/hostname"] == NODE
    assert meta["annotations"][ANN_REASON] == REASON
    assert meta["annotations"][ANN_SINCE] == "2026-12-01T00:00:00Z"
    assert meta["annotations"]["node.alpha.kubernetes.io/ttl"] == "0"  # others' annotations kept
    assert "unschedulable" not in _node(server)["spec"] and ANN_CORDONED not in meta["annotations"]
    assert out.actions == [f"label {LABEL}=failed", f"annotate {ANN_REASON}: {REASON}"]
    (patch,) = _patches(server)
    # A merge patch, with the resourceVersion the decision was made on, by the service account.
    assert patch["content_type"] == "application/merge-patch+json" and patch["token"] == SA
    assert json.loads(patch["body"])["metadata"]["resourceVersion"] == "1001"
    # The same failure again changes nothing: one read, no write.
    before = len(server.api.log)
    assert node.mark_failed(REASON).actions == []
    assert [e["verb"] for e in server.api.log[before:]] == ["get"]


def test_cordon_when_asked_and_uncordon_only_what_gpuhost_cordoned(
    server: KubeAPIServer, node: KubeNode
) -> None:
    out = node.mark_failed(REASON, cordon=True)
    assert _node(server)["spec"]["unschedulable"] is True
    assert _node(server)["metadata"]["annotations"][ANN_CORDONED] == "gpuhost-nodecheck"
    assert "cordon (spec.unschedulable=true, marked gpuhost.io/cordoned)" in out.actions
    # Still failing: no second cordon, nothing written.
    assert node.mark_failed(REASON, cordon=True).actions == []
    # Healthy, but not asked to uncordon: labelled ok, the reason goes, the cordon stays.
    node.mark_ok()
    assert (
        _node(server)["spec"]["unschedulable"] is True and _node(server)["metadata"]["labels"][LABEL] == "ok"
    )
    assert ANN_REASON not in _node(server)["metadata"]["annotations"]
    out = node.mark_ok(uncordon=True)
    assert out.actions == ["uncordon (gpuhost cordoned it)"]
    assert "unschedulable" not in _node(server)["spec"]
    ann = _node(server)["metadata"]["annotations"]
    assert ANN_CORDONED not in ann and ANN_SINCE not in ann and ann["node.alpha.kubernetes.io/ttl"] == "0"


def test_a_node_cordoned_by_a_person_is_never_uncordoned_nor_marked_ours(
    server: KubeAPIServer, node: KubeNode
) -> None:
    server.api.as_person(NODE, {"spec": {"unschedulable": True}})  # kubectl cordon
    out = node.mark_failed(REASON, cordon=True)
    assert out.left == ["already cordoned by someone else: left as it is, not marked as ours"]
    assert ANN_CORDONED not in _node(server)["metadata"]["annotations"]
    out = node.mark_ok(uncordon=True)
    assert out.left == ["cordoned by someone else (no gpuhost.io/cordoned mark): left cordoned"]
    assert (
        _node(server)["spec"]["unschedulable"] is True and _node(server)["metadata"]["labels"][LABEL] == "ok"
    )


def test_a_person_uncordoning_our_cordon_leaves_a_stale_mark_that_goes(
    server: KubeAPIServer, node: KubeNode
) -> None:
    node.mark_failed(REASON, cordon=True)
    server.api.as_person(NODE, {"spec": {"unschedulable": None}})  # kubectl uncordon
    out = node.mark_ok(uncordon=True)
    assert "remove the stale gpuhost.io/cordoned mark (uncordoned by someone else)" in out.actions
    assert ANN_CORDONED not in _node(server)["metadata"]["annotations"]
    # Failing again later: gpuhost cordons anew (the node is not cordoned by anyone).
    node.mark_failed(REASON, cordon=True)
    assert _node(server)["spec"]["unschedulable"] is True


def test_a_person_cordoning_between_our_read_and_patch_wins(server: KubeAPIServer, node: KubeNode) -> None:
    """The patch carries the resourceVersion it was decided on: the server refuses it (409), the
    node is read again, and the new decision sees a person's cordon."""
    raced: list[str] = []

    def person_cordons(name: str) -> None:
        if not raced:
            raced.append(name)
            server.api.as_person(name, {"spec": {"unschedulable": True}})

    server.api.before_patch = person_cordons
    out = node.mark_failed(REASON, cordon=True)
    codes = [e["verb"] for e in server.api.log]
    assert codes == ["get", "patch", "get", "patch"], codes
    assert out.left == ["already cordoned by someone else: left as it is, not marked as ours"]
    assert ANN_CORDONED not in _node(server)["metadata"]["annotations"]
    assert _node(server)["metadata"]["labels"][LABEL] == "failed"


def test_a_node_that_changes_under_every_patch_is_left_alone(server: KubeAPIServer, node: KubeNode) -> None:
    server.api.before_patch = lambda name: server.api.as_person(name, {"metadata": {"labels": {"x": "y"}}})
    with pytest.raises(
        KubeNodeError, match=r"changed under every one of 3 patches \(HTTP 409\); nothing written"
    ):
        node.mark_failed(REASON)
    assert LABEL not in _node(server)["metadata"]["labels"]


def test_a_hostile_reason_is_redacted_printable_and_bounded(server: KubeAPIServer, node: KubeNode) -> None:
    reason = "xid on \x1b[2Jgpu\r\n3: password=hunter2 " + "A" * 5000
    node.mark_failed(reason)
    text = _node(server)["metadata"]["annotations"][ANN_REASON]
    assert "hunter2" not in text and "\x1b" not in text and "\r" not in text and "\n" not in text
    assert text.startswith("xid on \\x1b[2Jgpu 3: password=***") and text.endswith(" ... (truncated)")
    assert len(text) == REASON_MAX


@pytest.mark.parametrize("name", ["GPU_Node", "node/../x", "a" * 254, "", "-lead", "x\n"])
def test_a_node_name_kubernetes_would_refuse_is_a_one_line_error(name: str) -> None:
    with pytest.raises(KubeNodeError) as exc:
        KubeNode(name, api=object())
    msg = str(exc.value)
    assert "\n" not in msg and "is not a Kubernetes node name" in msg and "--node-name" in msg
    assert isinstance(exc.value, GpuhostError)


def test_without_patch_rights_the_error_names_the_rule(server: KubeAPIServer, node: KubeNode) -> None:
    server.api.rules[SA] = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    with pytest.raises(KubeNodeError) as exc:
        node.mark_failed(REASON)
    assert str(exc.value) == (
        f"patch of node {NODE}: HTTP 403 Forbidden; the service account needs get and patch on nodes "
        "(deploy/k8s/rbac.yaml)"
    )


def test_an_unknown_node_and_an_unreachable_server_are_one_line_errors(
    server: KubeAPIServer, tmp_path: Path
) -> None:
    api = load_api(str(server.kubeconfig(tmp_path / "kc")))
    with pytest.raises(KubeNodeError, match=r"^read of node gpu-node-99: HTTP 404 Not Found; is the name"):
        KubeNode("gpu-node-99", api).mark_ok()
    cfg = server.kubeconfig(tmp_path / "kc2")
    server.close()
    gone = load_api(str(cfg))
    gone.api_client.configuration.retries = 0
    with pytest.raises(KubeNodeError, match=rf"^read of node {NODE}: "):
        KubeNode(NODE, gone).mark_ok()


def test_no_configuration_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeNodeError, match=r"^no Kubernetes configuration \(.*missing.*set KUBECONFIG$"):
        load_api(str(tmp_path / "missing"))


def test_the_model_refuses_what_an_api_server_refuses(server: KubeAPIServer, tmp_path: Path) -> None:
    """The model's refusals are those the module's choices avoid: a dict sent as a JSON patch, an
    invalid label value, a stale resourceVersion, a token the role does not cover."""
    from kubernetes.client.exceptions import ApiException

    api = load_api(str(server.kubeconfig(tmp_path / "kc", token=ADMIN)))
    body = {"metadata": {"labels": {"a": "b"}}}
    # The client turns a dict it is told to send as a JSON patch into a strategic merge patch
    # (kubernetes/client/rest.py), so this one goes over plain HTTP.
    req = urllib.request.Request(
        f"{server.api.url}/api/v1/nodes/{NODE}",
        data=json.dumps(body).encode(),
        method="PATCH",
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json-patch+json"},
    )
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(req, timeout=10)
    assert http.value.code == 400 and "[]handlers.jsonPatchOp" in http.value.read().decode()
    cases: list[tuple[dict[str, Any], str, int]] = [
        ({"metadata": {"labels": {LABEL: "not ok!"}}}, kube_node.MERGE_PATCH, 422),
        ({"metadata": {"resourceVersion": "1"}}, kube_node.MERGE_PATCH, 409),
        (body, "application/apply-patch+yaml", 415),
    ]
    for patch, ctype, code in cases:
        with pytest.raises(ApiException) as exc:
            api.patch_node(NODE, patch, _content_type=ctype)
        assert exc.value.status == code, (ctype, exc.value.body)
    nobody = load_api(str(server.kubeconfig(tmp_path / "kc3", token="stolen")))
    with pytest.raises(ApiException) as exc:
        nobody.read_node(NODE)
    assert exc.value.status == 401
    # The service account may not list nodes (deploy/k8s/rbac.yaml grants get and patch only).
    sa = load_api(str(server.kubeconfig(tmp_path / "kc4")))
    with pytest.raises(ApiException) as exc:
        sa.list_node()
    assert exc.value.status == 403 and "cannot list resource" in str(exc.value.body)


def test_apply_health_marks_failed_then_ok_and_cordons_only_with_cordon(
    server: KubeAPIServer, tmp_path: Path
) -> None:
    api = load_api(str(server.kubeconfig(tmp_path / "kc")))
    out = kube_node.apply_health(NODE, ["xid 79 on GPU 3", "pcie_link GPU 2 x8 of x16"], api=api)
    assert (
        _node(server)["metadata"]["annotations"][ANN_REASON] == "xid 79 on GPU 3; pcie_link GPU 2 x8 of x16"
    )
    assert "unschedulable" not in _node(server)["spec"] and out.left == []
    kube_node.apply_health(NODE, ["xid 79 on GPU 3"], cordon=True, api=api)
    assert _node(server)["spec"]["unschedulable"] is True
    out = kube_node.apply_health(NODE, [], cordon=True, api=api)
    assert "uncordon (gpuhost cordoned it)" in out.actions and "unschedulable" not in _node(server)["spec"]
    assert _node(server)["metadata"]["labels"][LABEL] == "ok"


def test_a_slow_api_server_is_cut_at_the_deadline(server: KubeAPIServer, tmp_path: Path) -> None:
    """gpuhost-nodecheck has a time budget: no request outlives the deadline, none is retried."""
    api = load_api(str(server.kubeconfig(tmp_path / "kc")))
    server.api.delay = 4.0
    t0 = time.monotonic()
    with pytest.raises(KubeNodeError, match=rf"^read of node {NODE}: .*[Tt]imeout"):
        kube_node.apply_health(NODE, ["xid 79"], api=api, deadline=t0 + 1.0)
    assert time.monotonic() - t0 < server.api.delay - 0.5  # cut, not waited out (4 s)
    assert [e["verb"] for e in server.api.log] == ["get"]  # one attempt, no retry
    with pytest.raises(KubeNodeError, match="no time left in the budget; nothing more sent"):
        kube_node.apply_health(NODE, ["xid 79"], api=api, deadline=time.monotonic() - 1)
    assert len(server.api.log) == 1


def test_a_person_takes_over_our_cordon_by_removing_the_mark(server: KubeAPIServer, node: KubeNode) -> None:
    node.mark_failed(REASON, cordon=True)
    server.api.as_person(NODE, {"metadata": {"annotations": {ANN_CORDONED: None}}})  # kubectl annotate ...-
    out = node.mark_ok(uncordon=True)
    assert out.left == ["cordoned by someone else (no gpuhost.io/cordoned mark): left cordoned"]
    assert _node(server)["spec"]["unschedulable"] is True

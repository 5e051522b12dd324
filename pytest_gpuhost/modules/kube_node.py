"""A Kubernetes node's health marks: label, reason annotation, cordon and uncordon, opt-in.

What `gpuhost-nodecheck --k8s-label` / `--k8s-cordon` does to the node it runs on, through the
official Kubernetes Python client (`pip install 'pytest-gpuhost[k8s]'`), with the drain rules of
Slurm (docs/fleet.md):

* a failed check labels the node `gpuhost.io/health=failed` and puts the reason (redacted,
  control characters shown, at most REASON_MAX characters) in the annotation
  `gpuhost.io/health-reason`, with the time in `gpuhost.io/health-since`; a node that passes
  is labelled `gpuhost.io/health=ok` and loses both annotations;
* cordon (`spec.unschedulable: true`, what `kubectl cordon` sets) only when asked; gpuhost marks
  a cordon it made with the annotation `gpuhost.io/cordoned`;
* uncordon only a node that carries that mark: a node a person cordoned (unschedulable, no mark)
  is never uncordoned, and never marked as ours, whatever the checks say.

Every write is a JSON merge patch (RFC 7386, `application/merge-patch+json`) that carries the
`resourceVersion` the decision was made on, so the API server refuses it (409) when a person or
controller changed the node in between; the node is then read again and the decision made
again, at most CONFLICT_TRIES times. The patch type is named on each call, not left to the
client, whose choice for a dict body has changed between versions (JSON patch, which an API
server refuses for an object, then strategic merge).

The service account needs `get` and `patch` on `nodes` and nothing else (deploy/k8s/rbac.yaml).
Configuration: in a pod, the service account (`KUBERNETES_SERVICE_HOST`); elsewhere the usual
kubeconfig (`KUBECONFIG`, `~/.kube/config`). No pytest here: the node health program and the
plugin both call it.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from pytest_gpuhost.errors import GpuhostError
from pytest_gpuhost.redact import printable, redact

__all__ = [
    "ANN_CORDONED",
    "ANN_REASON",
    "ANN_SINCE",
    "LABEL",
    "KubeNode",
    "KubeNodeError",
    "NodeState",
    "Outcome",
    "apply_health",
    "check_node_name",
    "clean_reason",
    "load_api",
]

LABEL = "gpuhost.io/health"
ANN_REASON = "gpuhost.io/health-reason"
ANN_SINCE = "gpuhost.io/health-since"
ANN_CORDONED = "gpuhost.io/cordoned"
#: Longest reason kept in the annotation (a node's annotations share 256 KiB in all).
REASON_MAX = 1024
#: Reads and patches tried when the node changes under us (HTTP 409).
CONFLICT_TRIES = 3
#: Seconds for each request to the API server (connect, read).
REQUEST_TIMEOUT = (5.0, 15.0)
MERGE_PATCH = "application/merge-patch+json"
# RFC 1123 subdomain, at most 253 characters: what a Node's name must be (Kubernetes'
# apimachinery validation IsDNS1123Subdomain).
_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class KubeNodeError(GpuhostError):
    """The API server could not be reached or refused a request, or a node name is not valid."""


def check_node_name(name: str, where: str = "node name") -> str:
    """Return `name` if it can be a Kubernetes Node's name; raise KubeNodeError naming it if not."""
    if len(name) > 253 or not _DNS1123.fullmatch(name):
        raise KubeNodeError(
            f"{where} {printable(name)!r} is not a Kubernetes node name (lower-case RFC 1123 subdomain, "
            "at most 253 characters); pass the pod's spec.nodeName (downward API) or --node-name"
        )
    return name


def clean_reason(reason: str, limit: int = REASON_MAX) -> str:
    """Return a node's reason fit for an annotation: redacted, one line, printable, bounded."""
    text = printable(redact(" ".join(reason.split())))
    cut = " ... (truncated)"
    return text if len(text) <= limit else text[: limit - len(cut)] + cut


@dataclass(frozen=True)
class NodeState:
    """What gpuhost reads of a node: its labels, annotations, cordon and version."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    unschedulable: bool
    resource_version: str

    @property
    def cordoned_by_us(self) -> bool:
        """True when the node is cordoned and the cordon carries gpuhost's mark."""
        return self.unschedulable and ANN_CORDONED in self.annotations


@dataclass
class Outcome:
    """What was done to a node (each action one line), and what was left alone and why."""

    node: str
    actions: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def load_api(kubeconfig: str | None = None) -> Any:
    """Return a CoreV1Api: the pod's service account inside a cluster, else the kubeconfig."""
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError as exc:
        raise KubeNodeError(
            f"Kubernetes node marks need the kubernetes package: pip install 'pytest-gpuhost[k8s]' ({exc})"
        ) from None
    cfg = client.Configuration()
    # One attempt per request: urllib3's default retries would repeat a timed-out read three
    # times past a node check's budget. A conflict (409) is read and decided again by KubeNode;
    # anything else waits for the next run.
    cfg.retries = 0
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
    except (ConfigException, OSError, ValueError, TypeError) as exc:
        raise KubeNodeError(
            f"no Kubernetes configuration ({kubeconfig or 'service account, KUBECONFIG, ~/.kube/config'}): "
            f"{printable(str(exc))}; run in a pod with a service account or set KUBECONFIG"
        ) from None
    return client.CoreV1Api(client.ApiClient(cfg))


def _api_error(exc: Exception, what: str) -> KubeNodeError:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or type(exc).__name__
    hint = {
        403: "; the service account needs get and patch on nodes (deploy/k8s/rbac.yaml)",
        404: "; is the name the node's spec.nodeName?",
    }.get(status or 0, "")
    detail = f"HTTP {status} {reason}" if status else f"{type(exc).__name__}: {exc}"
    return KubeNodeError(printable(f"{what}: {detail}{hint}"))


class _Conflict(Exception):
    """The node changed between our read and our patch (HTTP 409)."""


class KubeNode:
    """One node's gpuhost marks, read and written through a CoreV1Api."""

    def __init__(
        self, name: str, api: Any = None, *, now: Any = time.time, deadline: float | None = None
    ) -> None:
        self.name = check_node_name(name)
        self._api = api
        self._now = now
        self.deadline = deadline  # time.monotonic() by which every request must be over

    def _timeout(self, what: str) -> tuple[float, float]:
        """Each request's (connect, read) timeout: REQUEST_TIMEOUT, cut to what the deadline leaves."""
        if self.deadline is None:
            return REQUEST_TIMEOUT
        left = self.deadline - time.monotonic()
        if left < 0.05:
            raise KubeNodeError(f"{what}: no time left in the budget; nothing more sent")
        return (min(REQUEST_TIMEOUT[0], left), min(REQUEST_TIMEOUT[1], left))

    @property
    def api(self) -> Any:
        """The CoreV1Api (from the configuration on first use)."""
        if self._api is None:
            self._api = load_api()
        return self._api

    def _errors(self) -> tuple[type[Exception], ...]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        return (ApiException, HTTPError, OSError)

    def read(self) -> NodeState:
        """Read the node's labels, annotations, cordon and resourceVersion."""
        try:
            node = self.api.read_node(self.name, _request_timeout=self._timeout(f"read of node {self.name}"))
        except self._errors() as exc:
            raise _api_error(exc, f"read of node {self.name}") from None
        meta, spec = node.metadata, node.spec
        return NodeState(
            name=self.name,
            labels=dict(meta.labels or {}),
            annotations=dict(meta.annotations or {}),
            unschedulable=bool(spec is not None and spec.unschedulable),
            resource_version=str(meta.resource_version or ""),
        )

    def _patch(self, state: NodeState, body: dict[str, Any]) -> None:
        body.setdefault("metadata", {})["resourceVersion"] = state.resource_version
        try:
            self.api.patch_node(
                self.name,
                body,
                _content_type=MERGE_PATCH,
                _request_timeout=self._timeout(f"patch of node {self.name}"),
            )
        except self._errors() as exc:
            if getattr(exc, "status", None) == 409:
                raise _Conflict() from None
            raise _api_error(exc, f"patch of node {self.name}") from None

    def _retry(self, decide: Any) -> Outcome:
        for _ in range(CONFLICT_TRIES):
            state = self.read()
            out = Outcome(self.name)
            body = decide(state, out)
            if not body:
                return out
            try:
                self._patch(state, body)
            except _Conflict:
                continue
            return out
        raise KubeNodeError(
            f"node {self.name} changed under every one of {CONFLICT_TRIES} patches (HTTP 409); nothing written"
        )

    def mark_failed(self, reason: str, *, cordon: bool = False) -> Outcome:
        """Label the node failed with the reason; cordon it when asked and nobody else has."""
        text = clean_reason(reason)

        def decide(state: NodeState, out: Outcome) -> dict[str, Any]:
            labels: dict[str, Any] = {}
            ann: dict[str, Any] = {}
            spec: dict[str, Any] = {}
            if state.labels.get(LABEL) != "failed":
                labels[LABEL] = "failed"
                out.actions.append(f"label {LABEL}=failed")
            if state.annotations.get(ANN_REASON) != text:
                ann[ANN_REASON] = text
                if ANN_SINCE not in state.annotations or state.labels.get(LABEL) != "failed":
                    ann[ANN_SINCE] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._now()))
                out.actions.append(f"annotate {ANN_REASON}: {text}")
            if cordon:
                if not state.unschedulable:
                    spec["unschedulable"] = True
                    ann[ANN_CORDONED] = "gpuhost-nodecheck"
                    out.actions.append("cordon (spec.unschedulable=true, marked gpuhost.io/cordoned)")
                elif not state.cordoned_by_us:
                    out.left.append("already cordoned by someone else: left as it is, not marked as ours")
            return _body(labels, ann, spec)

        return self._retry(decide)

    def mark_ok(self, *, uncordon: bool = False) -> Outcome:
        """Label the node ok, drop the reason; uncordon it when asked and only if gpuhost cordoned it."""

        def decide(state: NodeState, out: Outcome) -> dict[str, Any]:
            labels: dict[str, Any] = {}
            ann: dict[str, Any] = {}
            spec: dict[str, Any] = {}
            if state.labels.get(LABEL) != "ok":
                labels[LABEL] = "ok"
                out.actions.append(f"label {LABEL}=ok")
            for key in (ANN_REASON, ANN_SINCE):
                if key in state.annotations:
                    ann[key] = None  # null deletes a key in a merge patch (RFC 7386)
            if ANN_REASON in state.annotations:
                out.actions.append(f"remove {ANN_REASON}")
            if uncordon:
                if state.cordoned_by_us:
                    spec["unschedulable"] = None
                    ann[ANN_CORDONED] = None
                    out.actions.append("uncordon (gpuhost cordoned it)")
                elif state.unschedulable:
                    out.left.append("cordoned by someone else (no gpuhost.io/cordoned mark): left cordoned")
                elif ANN_CORDONED in state.annotations:  # someone uncordoned it: the mark is stale
                    ann[ANN_CORDONED] = None
                    out.actions.append(
                        "remove the stale gpuhost.io/cordoned mark (uncordoned by someone else)"
                    )
            return _body(labels, ann, spec)

        return self._retry(decide)


def _body(labels: dict[str, Any], ann: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Return the merge patch for the changes (empty when there are none)."""
    meta: dict[str, Any] = {}
    if labels:
        meta["labels"] = labels
    if ann:
        meta["annotations"] = ann
    body: dict[str, Any] = {}
    if meta:
        body["metadata"] = meta
    if spec:
        body["spec"] = spec
    return body


def apply_health(
    node: str, failures: list[str], *, cordon: bool = False, api: Any = None, deadline: float | None = None
) -> Outcome:
    """Mark a node after a check: failed with the failures as the reason, or ok.

    `cordon` (the program's `--k8s-cordon`) cordons a failed node and uncordons a recovered one,
    each only under the rules above; without it the cordon is never touched. `deadline`
    (time.monotonic()) bounds every request: a node check has a time budget.
    """
    kn = KubeNode(node, api, deadline=deadline)
    if failures:
        return kn.mark_failed("; ".join(failures), cordon=cordon)
    return kn.mark_ok(uncordon=cordon)

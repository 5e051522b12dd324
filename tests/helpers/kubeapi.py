"""A minimal Kubernetes API server for the node subset gpuhost uses: a model, not a cluster.

No kube-apiserver can be installed here (Debian ships etcd and kubectl, not the API server; no
PyPI package ships one), so the tests of `modules/kube_node.py` run the official Python client
against this HTTP server on loopback. What it models, each from the API server's behaviour:

* `GET /api/v1/nodes/NAME`, `PATCH /api/v1/nodes/NAME`; anything else is 404 or 405.
* Authentication by bearer token (401 without one); authorization by RBAC rules, those of the
  ClusterRole in deploy/k8s/rbac.yaml for the service account's token, so a request the role
  does not grant is refused as a cluster refuses it: 403 with the message of
  k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go (forbiddenMessage).
* Patch types as k8s.io/apiserver/pkg/endpoints/handlers/patch.go applies them:
  `application/merge-patch+json` (RFC 7386: objects merge, null deletes a key, anything else
  replaces); `application/strategic-merge-patch+json`, which for the fields modelled here (maps
  of strings, scalars) is the same as a merge patch (strategic merge differs on lists only, and
  a patch with a list is refused here as not modelled); `application/json-patch+json` with an
  object body is 400 "error decoding patch: json: cannot unmarshal object into Go value of type
  []handlers.jsonPatchOp" (the message of recent API servers); another type is 415.
* Optimistic concurrency: a patch that carries `metadata.resourceVersion` different from the
  stored one is 409 Conflict, "the object has been modified; please apply your changes to the
  latest version and try again" (OptimisticLockErrorMsg, k8s.io/apiserver/pkg/registry/generic/
  registry/store.go); every write bumps resourceVersion.
* Validation of what gpuhost writes (k8s.io/apimachinery/pkg/api/validation/objectmeta.go and
  pkg/util/validation): label values at most 63 characters of `[A-Za-z0-9_.-]` starting and
  ending alphanumeric; annotations at most 256 KiB in all; `spec.unschedulable` a boolean: 422
  Invalid otherwise.
* Errors are `Status` objects (kind Status, status Failure, message, reason, code).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "deploy" / "k8s" / "rbac.yaml"
ADMIN = "admin-token"  # a person with kubectl: every verb
SA = "gpuhost-sa-token"  # the service account of deploy/k8s/rbac.yaml
SA_USER = "system:serviceaccount:gpuhost:gpuhost"
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
ANNOTATIONS_MAX = 256 * 1024


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 MergePatch(Target, Patch)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _has_list(obj: Any) -> bool:
    if isinstance(obj, list):
        return True
    return isinstance(obj, dict) and any(_has_list(v) for v in obj.values())


def service_account_rules(path: Path = RBAC) -> list[dict[str, Any]]:
    """The rules of the ClusterRole the manifests bind to gpuhost's service account."""
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == binding["roleRef"]["name"]
    ]
    return list(role["rules"])


@dataclass
class KubeAPI:
    """The server's state: nodes by name, tokens' rules, a log of requests, a hook before patches."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    rules: dict[str, list[dict[str, Any]] | None] = field(default_factory=dict)
    users: dict[str, str] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)
    before_patch: Callable[[str], None] | None = None
    delay: float = 0.0  # seconds each answer is held back (a slow or overloaded API server)
    version: int = 1000
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def add_node(
        self, name: str, *, labels: dict[str, str] | None = None, unschedulable: bool = False
    ) -> None:
        self.version += 1
        spec: dict[str, Any] = {"podCIDR": "10.244.1.0/24"}
        if unschedulable:
            spec["unschedulable"] = True
        self.nodes[name] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": f"00000000-0000-4000-8000-{len(self.nodes):012d}",
                "resourceVersion": str(self.version),
                "creationTimestamp": "2026-11-01T00:00:00Z",
                "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": spec,
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }

    def as_person(self, name: str, patch: dict[str, Any]) -> None:
        """Change a node as `kubectl` would (a merge patch without a resourceVersion)."""
        with self.lock:
            self._apply(name, patch)

    def _apply(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        node = merge_patch(self.nodes[name], patch)
        self.version += 1
        node["metadata"]["resourceVersion"] = str(self.version)
        node["metadata"]["name"] = name
        self.nodes[name] = node
        return node

    def allowed(self, token: str, verb: str, resource: str) -> bool:
        rules = self.rules.get(token)
        if rules is None:  # admin
            return True
        return any(
            "" in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r.get("verbs", [])
            for r in rules
        )


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _invalid(node: dict[str, Any]) -> str | None:
    meta = node.get("metadata") or {}
    for v in (meta.get("labels") or {}).values():
        if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.fullmatch(v):
            return f"metadata.labels: Invalid value: {v!r}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
    ann = meta.get("annotations") or {}
    if any(not isinstance(v, str) for v in ann.values()):
        return "metadata.annotations: Invalid value: annotation values must be strings"
    if sum(len(k) + len(v) for k, v in ann.items()) > ANNOTATIONS_MAX:
        return "metadata.annotations: Too long: must have at most 262144 bytes"
    uns = (node.get("spec") or {}).get("unschedulable")
    if uns is not None and not isinstance(uns, bool):
        return f"spec.unschedulable: Invalid value: {uns!r}: must be a boolean"
    return None


def _handler(api: KubeAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                self.close_connection = True

        def _route(self, verb: str) -> tuple[str, str] | None:
            auth = self.headers.get("Authorization", "")
            token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            api.log.append(
                {
                    "verb": verb,
                    "path": self.path,
                    "content_type": self.headers.get("Content-Type"),
                    "body": body.decode("utf-8", "replace"),
                    "token": token,
                }
            )
            self._body = body
            if token not in api.rules:
                self._send(401, _status(401, "Unauthorized", "Unauthorized"))
                return None
            m = re.fullmatch(r"/api/v1/nodes(?:/([^/?]+))?(?:\?.*)?", self.path)
            if not m:
                self._send(404, _status(404, "NotFound", "the server could not find the requested resource"))
                return None
            name = m.group(1) or ""
            if not name:
                verb = {"get": "list"}.get(verb, verb)
            if not api.allowed(token, verb, "nodes"):
                user = api.users.get(token, "admin")
                what = f'nodes "{name}" is forbidden' if name else "nodes is forbidden"
                self._send(
                    403,
                    _status(
                        403,
                        "Forbidden",
                        f'{what}: User "{user}" cannot {verb} resource "nodes" '
                        'in API group "" at the cluster scope',
                    ),
                )
                return None
            if not name:
                self._send(405, _status(405, "MethodNotAllowed", "not modelled: list"))
                return None
            if name not in api.nodes:
                self._send(404, _status(404, "NotFound", f'nodes "{name}" not found'))
                return None
            return token, name

        def do_GET(self) -> None:
            r = self._route("get")
            time.sleep(api.delay)
            if r:
                with api.lock:
                    self._send(200, copy.deepcopy(api.nodes[r[1]]))

        def do_PATCH(self) -> None:
            r = self._route("patch")
            if not r:
                return
            name = r[1]
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            try:
                patch = json.loads(self._body or b"null")
            except ValueError as exc:
                self._send(400, _status(400, "BadRequest", f"error decoding patch: {exc}"))
                return
            if ctype == "application/json-patch+json":
                if not isinstance(patch, list):
                    self._send(
                        400,
                        _status(
                            400,
                            "BadRequest",
                            "error decoding patch: json: cannot unmarshal "
                            "object into Go value of type []handlers.jsonPatchOp",
                        ),
                    )
                else:
                    self._send(415, _status(415, "UnsupportedMediaType", "not modelled: JSON patch"))
                return
            if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                self._send(
                    415,
                    _status(
                        415,
                        "UnsupportedMediaType",
                        f"the body of the request was in an unknown format: {ctype}",
                    ),
                )
                return
            if not isinstance(patch, dict) or (
                ctype.startswith("application/strategic") and _has_list(patch)
            ):
                self._send(415, _status(415, "UnsupportedMediaType", "not modelled: a patch with lists"))
                return
            if api.before_patch is not None:
                api.before_patch(name)
            with api.lock:
                current = api.nodes[name]
                want = (patch.get("metadata") or {}).get("resourceVersion")
                if want is not None and want != current["metadata"]["resourceVersion"]:
                    self._send(
                        409,
                        _status(
                            409,
                            "Conflict",
                            f'Operation cannot be fulfilled on nodes "{name}": the object '
                            "has been modified; please apply your changes to the latest version and try again",
                        ),
                    )
                    return
                bad = _invalid(merge_patch(current, patch))
                if bad:
                    self._send(422, _status(422, "Invalid", f'Node "{name}" is invalid: {bad}'))
                    return
                self._send(200, copy.deepcopy(api._apply(name, patch)))

    return Handler


class KubeAPIServer:
    """Run a KubeAPI on 127.0.0.1 in a thread; write kubeconfigs for its users."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        """Listen on `host`: loopback, or a lab link's root-side address for a lab host to reach."""
        self.api = KubeAPI(rules={ADMIN: None, SA: service_account_rules()}, users={SA: SA_USER})
        self.httpd = ThreadingHTTPServer((host, 0), _handler(self.api))
        self.httpd.daemon_threads = True
        self.api.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def kubeconfig_text(self, token: str = SA) -> str:
        """A kubeconfig for this server and a user with `token`."""
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "model", "cluster": {"server": self.api.url}}],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "model", "user": "u"}}],
                "current-context": "c",
            }
        )

    def kubeconfig(self, path: Path, token: str = SA) -> Path:
        path.write_text(self.kubeconfig_text(token), encoding="utf-8")
        return path

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@contextmanager
def serving(*nodes: str, host: str = "127.0.0.1") -> Iterator[KubeAPIServer]:
    """A KubeAPIServer holding `nodes`, closed at the end (the tests' `server` fixtures)."""
    srv = KubeAPIServer(host)
    for name in nodes:
        srv.api.add_node(name)
    try:
        yield srv
    finally:
        srv.close()

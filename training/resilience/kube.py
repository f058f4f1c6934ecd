"""The Kubernetes calls the training makes, from inside the pod with the pod's service account (no
client library: the image need not have one): taint the node a worker's pod runs on; read a node's
conditions; and, when a replacement node does not come, what Karpenter's NodeClaims say about it.

The service account may ``get`` and ``patch`` nodes and ``list`` NodeClaims (a ClusterRole of the workload), and a
ValidatingAdmissionPolicy lets it change nothing of a node but this one taint
(ray_train_eks.workload.node_marker ``node_marker_objects``).

``RAY_TRAIN_EKS_KUBE_API`` (tests: an http:// URL) replaces the in-cluster API address and its CA.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
API_ENV = "RAY_TRAIN_EKS_KUBE_API"


def _api() -> tuple[str, ssl.SSLContext | None, dict]:
    """The API server's base URL, its TLS context and the request headers (the pod's token)."""
    headers = {"Accept": "application/json"}
    token_file = os.path.join(SERVICE_ACCOUNT_DIR, "token")
    if os.path.exists(token_file):
        with open(token_file) as handle:
            headers["Authorization"] = f"Bearer {handle.read().strip()}"
    override = os.environ.get(API_ENV)
    if override:
        return override.rstrip("/"), None, headers
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise RuntimeError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST)")
    context = ssl.create_default_context(cafile=os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt"))
    return f"https://{host}:{port}", context, headers


class KubeError(RuntimeError):
    """The API server refused a call: its HTTP status and what it said."""

    def __init__(self, method: str, path: str, code: int, said: bytes) -> None:
        super().__init__(f"{method} {path}: HTTP {code} {said[:300]!r}")
        self.code = code


def _call(method: str, path: str, body: object | None = None, content_type: str = "application/json") -> dict:
    base, context, headers = _api()
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers = {**headers, "Content-Type": content_type}
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=15, context=context) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        raise KubeError(method, path, error.code, error.read()) from None


#: The last answer about each node in this process: its labels do not change while a pod runs on it, so what
#: reads them (training/telemetry/cost.py) takes them from the preflight's read, adding no call.
_LAST_READ: dict[str, dict] = {}


def get_node(name: str) -> dict:
    """The node object (the service account may get nodes)."""
    _LAST_READ[name] = _call("GET", f"/api/v1/nodes/{name}")
    return _LAST_READ[name]


def node_labels(name: str) -> dict:
    """The node's labels: from the last read of it in this process, else read now."""
    return known_node(name).get("metadata", {}).get("labels") or {}


def known_node(name: str) -> dict:
    """The node object: from the last read of it in this process, else read now."""
    return _LAST_READ.get(name) or get_node(name)


def taint_node(name: str, *, key: str, value: str, effect: str = "NoSchedule", attempts: int = 3) -> str:
    """Add the taint ``key=value:effect`` to node ``name`` (replacing one of the same key), as a
    JSON patch guarded by the node's resourceVersion (the kubelet and Karpenter write nodes too).
    Returns what was done; raises on the last failed attempt."""
    taint = {"key": key, "value": value, "effect": effect}
    for attempt in range(attempts):
        node = get_node(name)
        taints = node.get("spec", {}).get("taints") or []
        if taint in taints:
            return f"node {name} already has taint {key}={value}:{effect}"
        patch = [{"op": "test", "path": "/metadata/resourceVersion", "value": node["metadata"]["resourceVersion"]},
                 {"op": "add", "path": "/spec/taints", "value": [t for t in taints if t.get("key") != key] + [taint]}]
        try:
            _call("PATCH", f"/api/v1/nodes/{name}", patch, content_type="application/json-patch+json")
            return f"node {name} tainted {key}={value}:{effect}: no new pod lands on it"
        except KubeError as error:
            if error.code not in (409, 422) or attempt == attempts - 1:  # 409/422: the node changed meanwhile
                raise
    raise AssertionError("unreachable")


#: How far back a NodeClaim's events are read (the replacement bound is 25 minutes).
EVENTS_WINDOW_S = 3600


def capacity_trouble() -> list[str] | None:
    """Why Karpenter has not brought a node up: its warning events about NodeClaims (a launch that
    EC2 refused deletes the NodeClaim and leaves only its event: kubernetes-sigs/karpenter v1.14.1
    ``pkg/controllers/nodeclaim/lifecycle/launch.go``, ``InsufficientCapacityErrorEvent``, for
    ``InsufficientInstanceCapacity``, ``VcpuLimitExceeded``, ``ReservationCapacityExceeded`` and the
    like: aws/karpenter-provider-aws ``pkg/errors/errors.go``), then each NodeClaim that is not
    ``Launched`` or not ``Registered``, with its condition's reason (``pkg/apis/v1``). None where the
    cluster has no Karpenter (the managed node group)."""
    try:
        claims = _call("GET", "/apis/karpenter.sh/v1/nodeclaims").get("items") or []
    except KubeError as error:
        if error.code == 404:
            return None
        raise
    found = _claim_events()
    for claim in claims:
        conditions = {c.get("type"): c for c in (claim.get("status") or {}).get("conditions") or []}
        for kind in ("Launched", "Registered"):
            condition = conditions.get(kind)
            if condition is None or condition.get("status") != "True":
                why = f"{condition.get('reason', '')}: {condition.get('message', '')}".strip(": ") if condition else "not yet"
                found.append(f"NodeClaim {claim['metadata']['name']} not {kind.lower()} ({why})")
                break
    return found


def _claim_events() -> list[str]:
    """Karpenter's recent warning events about NodeClaims (those of a cluster-scoped object are in
    the ``default`` namespace), newest last; [] where they cannot be read."""
    import datetime

    try:
        events = _call("GET", "/api/v1/events?fieldSelector=involvedObject.kind%3DNodeClaim").get("items") or []
    except KubeError:
        return []
    since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=EVENTS_WINDOW_S)
    said = []
    for event in events:
        when = event.get("lastTimestamp") or event.get("eventTime") or ""
        try:
            recent = datetime.datetime.fromisoformat(when.replace("Z", "+00:00")) >= since
        except ValueError:
            recent = True
        if event.get("type") == "Warning" and recent:
            said.append(f"NodeClaim {event.get('involvedObject', {}).get('name', '?')}: {event.get('reason', '')}: "
                        f"{event.get('message', '')[:300]}")
    return said[-5:]

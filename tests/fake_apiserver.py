"""A stand-in for the Kubernetes API server, for ``ray-train-eks`` (ray_train_eks/cli.py): the
calls it makes (a ConfigMap read; RayJobs created, listed, deleted; NetworkPolicies created),
refused as the real server refuses them:

- no token: 401; a token without the permission: 403 with the server's ``Status`` message;
- a namespace that does not exist: 404; a name that is not a DNS-1123 subdomain, or an object its
  schema rejects (RayJobs against the KubeRay v1.7.0 CRD as a structural schema is checked:
  unknown fields refused, tests/crd_schema.py; NetworkPolicies against Kubernetes' own schema): 422;
  an object that exists: 409.

What it does not do: run anything (no KubeRay here: a created RayJob stays as created, its status
set by the test), admission webhooks, field defaulting beyond the CRD's.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
COLLECTIONS = {
    ("api/v1", "configmaps"): ("ConfigMap", "v1"),
    ("api/v1", "pods"): ("Pod", "v1"),
    ("apis/ray.io/v1", "rayjobs"): ("RayJob", "ray.io/v1"),
    ("apis/networking.k8s.io/v1", "networkpolicies"): ("NetworkPolicy", "networking.k8s.io/v1"),
}
PATH = re.compile(r"^/(api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?(/log)?$")


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message, "code": code}


class FakeApiServer:
    """The API server on 127.0.0.1 (``url``), with ``namespaces``, ``objects`` by (resource,
    namespace, name), and ``tokens``: token -> the user's name and the resources it may use
    (``"*"``: all). ``accept``: a function that may take a token no entry names (EKS: an IAM one)."""

    def __init__(self, *, namespaces=("ray-train",), tokens=None, accept=None) -> None:
        from crd_schema import kuberay_schemas

        self.namespaces = set(namespaces)
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.tokens = dict(tokens or {"admin-token": ("admin", "*")})
        self.accept = accept
        self.requests: list[tuple[str, str]] = []
        self.schemas = kuberay_schemas()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, code: int, body: dict) -> None:
                text = set(body) == {"text"}  # a log: plain text, as the server sends it
                data = body["text"].encode() if text else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                code, reply = server.handle(method, self.path, self.headers.get("Authorization"), body)
                self._reply(code, reply)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_DELETE(self):
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ the API
    def put(self, obj: dict) -> None:
        """An object that exists already (the stack's ConfigMaps)."""
        resource = {"ConfigMap": "configmaps", "Pod": "pods", "RayJob": "rayjobs", "NetworkPolicy": "networkpolicies"}[obj["kind"]]
        self.objects[(resource, obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj

    def user(self, authorization: str | None):
        if not authorization or not authorization.startswith("Bearer "):
            return None
        token = authorization.removeprefix("Bearer ")
        if token in self.tokens:
            return self.tokens[token]
        return self.accept(token) if self.accept else None

    def handle(self, method: str, raw_path: str, authorization: str | None, body: dict | None) -> tuple[int, dict]:
        url = urlparse(raw_path)
        self.requests.append((method, url.path))
        who = self.user(authorization)
        if who is None:
            return 401, status(401, "Unauthorized", "Unauthorized")
        match = PATH.match(url.path)
        if not match or (match.group(1), match.group(3)) not in COLLECTIONS:
            return 404, status(404, "NotFound", f"the server could not find the requested resource ({url.path})")
        group, namespace, resource, name, log = match.groups()
        user, allowed = who
        if allowed != "*" and resource not in allowed:
            verb = {"GET": "get" if name else "list", "POST": "create", "DELETE": "delete"}[method]
            return 403, status(403, "Forbidden", f'{resource} is forbidden: User "{user}" cannot {verb} resource '
                                                 f'"{resource}" in the namespace "{namespace}"')
        if namespace not in self.namespaces:
            return 404, status(404, "NotFound", f'namespaces "{namespace}" not found')
        key = (resource, namespace, name)
        if log:  # a pod's log: its ``log`` text (the test's), whole, followed or not
            return (200, {"text": self.objects[key].get("log", "")}) if key in self.objects else \
                (404, status(404, "NotFound", f'pods "{name}" not found'))
        if method == "GET" and name:
            return (200, self.objects[key]) if key in self.objects else (404, status(404, "NotFound", f'{resource} "{name}" not found'))
        if method == "GET":
            return 200, {"kind": "List", "items": [obj for (r, n, _), obj in sorted(self.objects.items())
                                                   if r == resource and n == namespace
                                                   and self._selected(obj, parse_qs(url.query).get("labelSelector", [""])[0])]}
        if method == "DELETE":
            if key not in self.objects:
                return 404, status(404, "NotFound", f'{resource} "{name}" not found')
            return 200, self.objects.pop(key)
        return self._create(group, namespace, resource, body)

    @staticmethod
    def _selected(obj: dict, selector: str) -> bool:
        labels = obj["metadata"].get("labels") or {}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if key not in labels or (value and labels[key] != value):
                return False
        return True

    def _create(self, group: str, namespace: str, resource: str, body: dict) -> tuple[int, dict]:
        kind, api_version = COLLECTIONS[(group, resource)]
        metadata = body.get("metadata") or {}
        name = metadata.get("name", "")
        if body.get("kind") != kind or body.get("apiVersion") != api_version:
            return 400, status(400, "BadRequest", f"the body is a {body.get('kind')} {body.get('apiVersion')}, not {kind}")
        if metadata.get("namespace", namespace) != namespace:
            return 400, status(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                                  "sent on the request")
        if not DNS_SUBDOMAIN.match(name) or len(name) > 253:
            return 422, status(422, "Invalid", f'{kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": a '
                                               "lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters")
        if (resource, namespace, name) in self.objects:
            return 409, status(409, "AlreadyExists", f'{resource} "{name}" already exists')
        try:
            if kind == "RayJob":
                from crd_schema import validate

                body = validate(body, self.schemas)
            elif kind == "NetworkPolicy":
                from crd_schema import validate_builtin

                validate_builtin(body)
        except Exception as error:  # noqa: BLE001 - the server's 422
            return 422, status(422, "Invalid", f'{kind} "{name}" is invalid: {str(error).splitlines()[0][:500]}')
        stored = json.loads(json.dumps(body))
        stored["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()), resourceVersion="1",
                                  creationTimestamp=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        self.objects[(resource, namespace, name)] = stored
        return 201, stored

"""A stand-in for the Kubernetes API server, for ``ray-train-eks`` (ray_train_eks/cli/, through
the ``kubernetes`` client): what that client sends, refused and served as the real server does.

- **Who**: no token (or a client certificate the server's CA did not sign): 401; a user without the
  verb on the resource: 403 with the server's RBAC message (``rayjobs.ray.io is forbidden: User "x"
  cannot list resource "rayjobs" in API group "ray.io" in the namespace "ray-train"``). With
  ``tls=``, it serves HTTPS and takes the user of a client certificate from its subject's CN, as
  the real server's x509 authenticator does.
- **What**: a namespace that does not exist: 404; a name that is not a DNS-1123 subdomain, or an
  object its schema rejects (RayJobs against the KubeRay v1.7.0 CRD as a structural schema,
  unknown fields refused, tests/crd_schema.py; NetworkPolicies against Kubernetes' own schema):
  422; a create of a name that exists: 409 ``AlreadyExists``; a replace (PUT) whose
  ``resourceVersion`` is not the stored one: 409 ``Conflict`` (optimistic concurrency, what a
  Lease's compare-and-swap rests on); a replace of what does not exist: 404.
- **Lifecycles**: ``resourceVersion`` grows with every write; a delete of an object with finalizers
  sets its ``deletionTimestamp`` and leaves it until the finalizers are removed (what KubeRay's
  ``ray.io/rayjob-finalizer`` does to a RayJob); the garbage collector deletes, shortly after, any
  object whose every owner (``ownerReferences`` by uid) is gone, as kube-controller-manager's does.
- **Watches** (``?watch=true``): the matching objects as ``ADDED``, then every change as it happens,
  one JSON event a line, until ``timeoutSeconds``.
- **Port-forwards** (``pods/portforward``, a websocket upgrade authorized as ``create``): the
  ``v4.channel.k8s.io`` protocol to a local server standing in for the pod's port
  (tests/websocket_forward.py).
- **Logs**: a pod's ``log`` text (``previous_log`` for ``previous=true``), ``tailLines``; while its
  container waits to start, 400 ``container ... is waiting to start: ContainerCreating`` as the
  kubelet answers; ``follow=true`` streams until the test marks the container terminated (or, once,
  cuts the connection mid-stream: ``drop_follow_once``).

What it does not do: run anything (no KubeRay or Kueue here: a test sets an object's status with
:meth:`FakeApiServer.update`, as a controller would), admission webhooks, field defaulting beyond the
CRD's, strategic-merge patches.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from http_json import send_json

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: (group path, resource) -> (kind, apiVersion, API group for RBAC messages)
COLLECTIONS = {
    ("api/v1", "configmaps"): ("ConfigMap", "v1", ""),
    ("api/v1", "pods"): ("Pod", "v1", ""),
    ("apis/ray.io/v1", "rayjobs"): ("RayJob", "ray.io/v1", "ray.io"),
    ("apis/ray.io/v1", "rayservices"): ("RayService", "ray.io/v1", "ray.io"),
    ("apis/networking.k8s.io/v1", "networkpolicies"): ("NetworkPolicy", "networking.k8s.io/v1", "networking.k8s.io"),
    ("apis/coordination.k8s.io/v1", "leases"): ("Lease", "coordination.k8s.io/v1", "coordination.k8s.io"),
    ("apis/kueue.x-k8s.io/v1beta2", "workloads"): ("Workload", "kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io"),
    ("apis/kueue.x-k8s.io/v1beta2", "localqueues"): ("LocalQueue", "kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io"),
}
RESOURCES = {kind: (group, resource) for (group, resource), (kind, _, _) in COLLECTIONS.items()}
PATH = re.compile(r"^/(api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?(/log|/portforward)?$")
#: Kinds whose CRD has the status subresource: a replace of the object keeps the stored status.
STATUS_SUBRESOURCE = {"RayJob", "RayService"}


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message, "code": code}


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Stream:
    """A streamed reply: ``chunks`` yields bytes until it is done."""

    def __init__(self, chunks, content_type: str) -> None:
        self.chunks, self.content_type = chunks, content_type


class FakeApiServer:
    """The API server on 127.0.0.1 (``url``), with ``namespaces``, ``objects`` by (resource,
    namespace, name), and ``tokens``: token -> (user, what it may do: ``"*"``, or a collection of
    ``"resource"`` (every verb) or ``"verb resource"`` entries). ``accept``: a function that may take a
    token no entry names (EKS: an IAM one). ``tls``: (certificate file, key file, client CA file)
    to serve HTTPS and take client certificates; ``certificate_users``: CN -> what that user may do."""

    def __init__(self, *, namespaces=("ray-train",), tokens=None, accept=None, tls=None, certificate_users=None) -> None:
        from crd_schema import kuberay_schemas

        self.namespaces = set(namespaces)
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.tokens = dict(tokens or {"admin-token": ("admin", "*")})
        self.certificate_users = dict(certificate_users or {})
        self.accept = accept
        self.requests: list[tuple[str, str]] = []
        self.queries: list[tuple[str, str, dict]] = []
        self.schemas = kuberay_schemas()
        self.version = 1
        self.events: list[tuple[int, str, str, str, dict]] = []  # (version, type, resource, namespace, object)
        self.changed = threading.Condition()
        #: API groups the server does not serve (a controller not installed), e.g. ``apis/kueue.x-k8s.io/v1beta2``.
        self.unserved: set[str] = set()
        #: Port-forwards: (namespace, pod) -> (host, port) of the local server standing in for the pod's
        #: port, and each forward made (namespace, pod, port).
        self.forward_targets: dict[tuple[str, str], tuple[str, int]] = {}
        self.forwarded: list[tuple[str, str, int]] = []
        #: Answers to give before serving normally: (method, path prefix) -> list of (code, body) to pop.
        self.faults: dict[tuple[str, str], list[tuple[int, dict]]] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _reply(self, code: int, body) -> None:
                if isinstance(body, Stream):
                    self.send_response(code)
                    self.send_header("Content-Type", body.content_type)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    try:
                        for chunk in body.chunks:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            self.wfile.flush()
                        self.wfile.write(b"0\r\n\r\n")
                    except ConnectionAbortedError:  # the stream cut mid-way: no last chunk, the socket closed
                        self.connection.shutdown(2)
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    self.close_connection = True
                    return
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
                user = None
                if isinstance(self.connection, ssl.SSLSocket):
                    certificate = self.connection.getpeercert()
                    if certificate:
                        cn = dict(pair[0] for pair in certificate["subject"]).get("commonName")
                        user = (cn, server.certificate_users.get(cn, ()))
                code, reply = server.handle(method, self.path, self.headers.get("Authorization"), body, certificate_user=user)
                self._reply(code, reply)

            def do_GET(self):
                if self.headers.get("Upgrade", "").lower() == "websocket":
                    server.port_forward(self)
                    return
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_PUT(self):
                self._handle("PUT")

            def do_DELETE(self):
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        scheme = "http"
        if tls:
            certificate, key, client_ca = tls
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certificate, key)
            context.load_verify_locations(client_ca)
            context.verify_mode = ssl.CERT_OPTIONAL  # a client certificate, or a bearer token
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}"
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.collector = threading.Thread(target=self._collect_garbage, daemon=True)
        self.collector.start()

    def close(self) -> None:
        self.closed.set()
        with self.changed:
            self.changed.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ what a test (or a controller) does
    def put(self, obj: dict) -> dict:
        """An object that exists already (the stack's ConfigMaps), or a controller's create."""
        _, resource = RESOURCES[obj["kind"]]
        metadata = obj["metadata"]
        metadata.setdefault("uid", str(uuid.uuid4()))
        metadata.setdefault("creationTimestamp", now())
        with self.changed:
            key = (resource, metadata["namespace"], metadata["name"])
            self._write("MODIFIED" if key in self.objects else "ADDED", key, obj)
        return obj

    def port_forward(self, handler) -> None:
        """A ``pods/portforward`` websocket (tests/websocket_forward.py) to the pod's target,
        ``forward_targets[(namespace, pod)]``: (host, port) of a local server standing in for the pod."""
        import websocket_forward

        code, reply = self.handle("GET", handler.path, handler.headers.get("Authorization"), None)
        if code != 101:
            send_json(handler, code, reply)
            return
        _, namespace, pod = reply["forward"]
        websocket_forward.accept(handler, reply["port"])
        self.forwarded.append((namespace, pod, reply["port"]))
        websocket_forward.pump(handler.connection, self.forward_targets[(namespace, pod)], reply["port"])
        handler.close_connection = True

    def update(self, resource: str, namespace: str, name: str, **fields) -> dict:
        """Set fields of a stored object (a controller's status update: ``status={...}``), as a write."""
        with self.changed:
            obj = self.objects[(resource, namespace, name)]
            obj.update(fields)
            self._write("MODIFIED", (resource, namespace, name), obj)
            return obj

    def finalize(self, resource: str, namespace: str, name: str) -> None:
        """A controller removes its finalizers: a deleted object goes."""
        with self.changed:
            obj = self.objects[(resource, namespace, name)]
            obj["metadata"]["finalizers"] = []
            if obj["metadata"].get("deletionTimestamp"):
                self._remove((resource, namespace, name))
            else:
                self._write("MODIFIED", (resource, namespace, name), obj)

    def of(self, resource: str) -> list[dict]:
        """The stored objects of ``resource``."""
        with self.changed:
            return [obj for (r, _, _), obj in sorted(self.objects.items()) if r == resource]

    def _write(self, kind: str, key: tuple[str, str, str], obj: dict) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.objects[key] = obj
        self.events.append((self.version, kind, key[0], key[1], json.loads(json.dumps(obj))))
        self.changed.notify_all()

    def _remove(self, key: tuple[str, str, str]) -> dict:
        obj = self.objects.pop(key)
        self.version += 1
        self.events.append((self.version, "DELETED", key[0], key[1], json.loads(json.dumps(obj))))
        self.changed.notify_all()
        return obj

    def _collect_garbage(self) -> None:
        """kube-controller-manager's garbage collector: an object whose owners are all gone goes."""
        while not self.closed.wait(0.05):
            with self.changed:
                uids = {obj["metadata"]["uid"] for obj in self.objects.values()
                        if not obj["metadata"].get("deletionTimestamp") or obj["metadata"].get("finalizers")}
                for key, obj in list(self.objects.items()):
                    owners = obj["metadata"].get("ownerReferences") or []
                    if owners and not any(owner["uid"] in uids for owner in owners):
                        self._remove(key)

    # ------------------------------------------------------------------ the API
    def user(self, authorization: str | None):
        if not authorization or not authorization.startswith("Bearer "):
            return None
        token = authorization.removeprefix("Bearer ")
        if token in self.tokens:
            return self.tokens[token]
        return self.accept(token) if self.accept else None

    @staticmethod
    def verb(method: str, name: str | None, query: dict) -> str:
        if method == "GET":
            return "get" if name else ("watch" if query.get("watch", [""])[0].lower() == "true" else "list")
        return {"POST": "create", "PUT": "update", "DELETE": "delete"}[method]

    def handle(self, method: str, raw_path: str, authorization: str | None, body, *, certificate_user=None):
        url = urlparse(raw_path)
        query = parse_qs(url.query)
        self.requests.append((method, url.path))
        self.queries.append((method, url.path, {key: values[0] for key, values in query.items()}))
        for (fault_method, prefix), answers in self.faults.items():
            if fault_method == method and url.path.startswith(prefix) and answers:
                code, reply = answers.pop(0)
                return code, reply
        who = self.user(authorization) or certificate_user
        if who is None:
            return 401, status(401, "Unauthorized", "Unauthorized")
        match = PATH.match(url.path)
        if not match or (match.group(1), match.group(3)) not in COLLECTIONS or match.group(1) in self.unserved:
            return 404, status(404, "NotFound", f"the server could not find the requested resource ({url.path})")
        group, namespace, resource, name, log = match.groups()
        kind, _, api_group = COLLECTIONS[(group, resource)]
        user, allowed = who
        verb = self.verb(method, name, query)
        if log == "/portforward":
            resource_shown, verb = "pods/portforward", "create"  # a websocket upgrade is authorized as a create
        elif log:
            resource_shown, verb = "pods/log", "get"
        else:
            resource_shown = resource
        if allowed != "*" and resource_shown not in allowed and f"{verb} {resource_shown}" not in allowed:
            qualified = f"{resource_shown}.{api_group}" if api_group else resource_shown
            return 403, status(403, "Forbidden", f'{qualified} is forbidden: User "{user}" cannot {verb} resource '
                                                 f'"{resource_shown}" in API group "{api_group}" in the namespace "{namespace}"')
        if namespace not in self.namespaces:
            return 404, status(404, "NotFound", f'namespaces "{namespace}" not found')
        key = (resource, namespace, name)
        if log == "/portforward":
            if key not in self.objects:
                return self._not_found(resource, api_group, name)
            return 101, {"forward": key, "port": int(query.get("ports", ["0"])[0])}
        if log:
            return self._log(key, query)
        with self.changed:
            if method == "GET" and name:
                return (200, self.objects[key]) if key in self.objects else self._not_found(resource, api_group, name)
            if method == "GET" and verb == "watch":
                return 200, Stream(self._watch(resource, namespace, query), "application/json")
            if method == "GET":
                selector = query.get("labelSelector", [""])[0]
                fields = query.get("fieldSelector", [""])[0]
                return 200, {"kind": f"{kind}List", "apiVersion": COLLECTIONS[(group, resource)][1],
                             "metadata": {"resourceVersion": str(self.version)},
                             "items": [obj for (r, n, _), obj in sorted(self.objects.items())
                                       if r == resource and n == namespace and self._selected(obj, selector, fields)]}
            if method == "DELETE":
                return self._delete(key, api_group, body or {})
            if method == "PUT":
                return self._replace(group, key, body)
            return self._create(group, namespace, resource, body)

    @staticmethod
    def _not_found(resource: str, api_group: str, name: str):
        qualified = f"{resource}.{api_group}" if api_group else resource
        return 404, status(404, "NotFound", f'{qualified} "{name}" not found')

    @staticmethod
    def _selected(obj: dict, selector: str, fields: str = "") -> bool:
        labels = obj["metadata"].get("labels") or {}
        for term in filter(None, selector.split(",")):
            key, _, value = term.partition("=")
            if key not in labels or (value and labels[key] != value):
                return False
        for term in filter(None, fields.split(",")):
            key, _, value = term.partition("=")
            if key == "metadata.name" and obj["metadata"]["name"] != value:
                return False
        return True

    def _watch(self, resource: str, namespace: str, query: dict):
        selector = query.get("labelSelector", [""])[0]
        fields = query.get("fieldSelector", [""])[0]
        deadline = time.monotonic() + float(query.get("timeoutSeconds", ["30"])[0])
        since = query.get("resourceVersion", [""])[0]
        with self.changed:
            start = self.version
            initial = [] if since else [json.loads(json.dumps(obj)) for (r, n, _), obj in sorted(self.objects.items())
                                        if r == resource and n == namespace and self._selected(obj, selector, fields)]
            seen = int(since) if since else start
        for obj in initial:
            yield json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n"
        while time.monotonic() < deadline and not self.closed.is_set():
            with self.changed:
                fresh = [event for event in self.events if event[0] > seen]
                if not fresh:
                    self.changed.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                    continue
            for version, kind, r, n, obj in fresh:
                seen = version
                if r == resource and n == namespace and self._selected(obj, selector, fields):
                    yield json.dumps({"type": kind, "object": obj}).encode() + b"\n"

    def _log(self, key: tuple[str, str, str], query: dict):
        if key not in self.objects:
            return 404, status(404, "NotFound", f'pods "{key[2]}" not found')
        pod = self.objects[key]
        container = pod.get("container_state", "running")
        if container == "waiting":
            return 400, status(400, "BadRequest", f'container "ray-job-submitter" in pod "{key[2]}" is waiting to start: '
                                                  "ContainerCreating")
        if query.get("previous", ["false"])[0].lower() == "true":
            if "previous_log" not in pod:
                return 400, status(400, "BadRequest", f'previous terminated container "ray-job-submitter" in pod "{key[2]}" '
                                                      "not found")
            return 200, {"text": self._tail(pod["previous_log"], query)}
        if query.get("follow", ["false"])[0].lower() != "true":
            return 200, {"text": self._tail(pod.get("log", ""), query)}

        def follow():
            if pod.pop("drop_follow_once", False):  # a connection that drops mid-stream (a proxy, a replaced server)
                yield pod.get("log", "").encode()
                raise ConnectionAbortedError
            sent = 0
            text = self._tail(pod.get("log", ""), query)
            offset = len(pod.get("log", "")) - len(text)
            while not self.closed.is_set():
                with self.changed:
                    current = self.objects.get(key, pod)
                    text = current.get("log", "")[offset:]
                    done = current.get("container_state") == "terminated" or key not in self.objects
                if len(text) > sent:
                    yield text[sent:].encode()
                    sent = len(text)
                if done:
                    return
                with self.changed:
                    self.changed.wait(0.1)

        return 200, Stream(follow(), "text/plain")

    @staticmethod
    def _tail(text: str, query: dict) -> str:
        if "tailLines" not in query:
            return text
        lines = text.splitlines(keepends=True)
        return "".join(lines[-int(query["tailLines"][0]):]) if int(query["tailLines"][0]) else ""

    def _delete(self, key: tuple[str, str, str], api_group: str, options: dict):
        resource, _, name = key
        if key not in self.objects:
            return self._not_found(resource, api_group, name)
        obj = self.objects[key]
        expected = (options.get("preconditions") or {}).get("uid")
        if expected and expected != obj["metadata"]["uid"]:  # the apiserver's message (registry/rest/delete.go)
            return 409, status(409, "Conflict", f"Operation cannot be fulfilled on {resource} \"{name}\": Precondition "
                                                f"failed: UID in precondition: {expected}, UID in object meta: {obj['metadata']['uid']}")
        finalizers = list(obj["metadata"].get("finalizers") or [])
        if options.get("propagationPolicy") == "Foreground":
            finalizers.append("foregroundDeletion")
            if not any((o.get("metadata", {}).get("ownerReferences") or []) and
                       any(r["uid"] == obj["metadata"]["uid"] for r in o["metadata"]["ownerReferences"])
                       for o in self.objects.values()):
                finalizers.remove("foregroundDeletion")  # nothing owned: nothing to wait for
        if finalizers:
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = now()
                obj["metadata"]["finalizers"] = finalizers
                self._write("MODIFIED", key, obj)
            return 200, obj
        return 200, self._remove(key)

    def _replace(self, group: str, key: tuple[str, str, str], body: dict):
        resource, namespace, name = key
        kind, _, api_group = COLLECTIONS[(group, resource)]
        if key not in self.objects:
            return self._not_found(resource, api_group, name)
        stored = self.objects[key]
        sent = (body.get("metadata") or {}).get("resourceVersion")
        if sent and sent != stored["metadata"]["resourceVersion"]:
            return 409, status(409, "Conflict", f'Operation cannot be fulfilled on {resource}.{api_group} "{name}": the object '
                                                "has been modified; please apply your changes to the latest version and try again")
        problem = self._invalid(kind, name, body)
        if problem:
            return problem
        replaced = json.loads(json.dumps(body))
        for field in ("uid", "creationTimestamp", "deletionTimestamp"):
            if field in stored["metadata"]:
                replaced["metadata"][field] = stored["metadata"][field]
        if kind in STATUS_SUBRESOURCE:  # the main resource's update leaves the status as it was
            replaced.pop("status", None)
            if "status" in stored:
                replaced["status"] = stored["status"]
        # metadata.generation: 1 at the create, one more at each change of the spec (what controllers'
        # status.observedGeneration is compared with)
        replaced["metadata"]["generation"] = stored["metadata"].get("generation", 1) + (replaced.get("spec") != stored.get("spec"))
        replaced["metadata"]["namespace"] = namespace
        self._write("MODIFIED", key, replaced)
        return 200, replaced

    def _invalid(self, kind: str, name: str, body: dict):
        try:
            if kind in ("RayJob", "RayService"):
                from crd_schema import validate

                validate(body, self.schemas)
            elif kind in ("NetworkPolicy", "ConfigMap"):
                from crd_schema import validate_builtin

                validate_builtin(body)
        except Exception as error:  # noqa: BLE001 - the server's 422
            return 422, status(422, "Invalid", f'{kind} "{name}" is invalid: {str(error).splitlines()[0][:500]}')
        return None

    def _create(self, group: str, namespace: str, resource: str, body: dict):
        kind, api_version, api_group = COLLECTIONS[(group, resource)]
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
            qualified = f"{resource}.{api_group}" if api_group else resource
            return 409, status(409, "AlreadyExists", f'{qualified} "{name}" already exists')
        problem = self._invalid(kind, name, body)
        if problem:
            return problem
        stored = json.loads(json.dumps(body))
        stored["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        self._write("ADDED", (resource, namespace, name), stored)
        return 201, stored

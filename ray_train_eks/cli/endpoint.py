"""``ray-train-eks endpoint`` and ``chat``: a service reached through the Kubernetes API, with the
user's own IAM identity and RBAC (``create`` on ``pods/portforward``), no public endpoint.

The forward goes to the service's head pod, port 8000: its Serve proxy answers for every model (the
OpenAI router runs there: ray_train_eks/handlers/serving.py ``INGRESS_RESOURCE``), and it stays
while the GPU workers come and go with the load. The ``kubernetes`` client carries one TCP stream a
websocket (kubernetes/stream/ws_client.py ``PortForward``: a data and an error channel for the
port), so the endpoint opens a forward for each connection it accepts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import socket
import sys
import threading

from ray_train_eks.cli.kube import Cluster, KubeError
from ray_train_eks.cli.platform import CliError, connect
from ray_train_eks.workload.serving import SERVE_PORT, SERVICE_LABEL

#: Seconds ``chat`` waits for its answer to start: a replica started from zero (a GPU node, the image,
#: the weights) takes minutes; the service's router gives up after its own timeout (30 min).
CHAT_TIMEOUT_S = 1800


def head_pod(cluster: Cluster, namespace: str, name: str) -> str:
    """The running head pod of service ``name`` (the active cluster's, where two run during an upgrade)."""
    service = None
    try:
        service = cluster.request("CustomObjectsApi", "get_namespaced_custom_object", "ray.io", "v1", namespace,
                                  "rayservices", name)
    except KubeError as error:
        if error.code != 404:
            raise
    if service is None:
        raise CliError(f"no service {name} in namespace {namespace} (ray-train-eks serve --list shows them)")
    active = ((service.get("status") or {}).get("activeServiceStatus") or {}).get("rayClusterName")
    pods = cluster.request("CoreV1Api", "list_namespaced_pod", namespace,
                           label_selector=f"{SERVICE_LABEL}={name},ray.io/node-type=head").get("items") or []
    running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
    running.sort(key=lambda p: (p["metadata"].get("labels") or {}).get("ray.io/cluster") != active)
    if not running:
        raise CliError(f"service {name} has no running head pod yet (ray-train-eks serve --list says where it is)")
    return running[0]["metadata"]["name"]


def forward(cluster: Cluster, namespace: str, pod: str):
    """A socket to the pod's Serve port through the API server (one TCP stream)."""
    return cluster.port_forward(namespace, pod, SERVE_PORT)


def _pump(left, right) -> None:
    """Copy bytes both ways until either side closes."""
    try:
        while True:
            readable, _, _ = select.select([left, right], [], [], 60)
            for source in readable:
                data = source.recv(65536)
                if not data:
                    return
                (right if source is left else left).sendall(data)
    except OSError:
        return
    finally:
        for end in (left, right):
            try:
                end.close()
            except OSError:
                pass


def serve_local(cluster: Cluster, namespace: str, pod: str, listener: socket.socket, *, connections: int | None = None) -> None:
    """Accept local connections on ``listener`` and forward each to the pod (``connections``: at most
    that many, for a test; None: until interrupted)."""
    served = 0
    while connections is None or served < connections:
        client, _ = listener.accept()
        served += 1
        try:
            opened, remote = forward(cluster, namespace, pod)
        except KubeError as error:
            print(f"ray-train-eks endpoint: {error}", file=sys.stderr)
            client.close()
            continue
        threading.Thread(target=lambda: (_pump(client, remote), opened.close()), daemon=True).start()


def endpoint(args: argparse.Namespace) -> int:
    cluster = connect(args)
    pod = head_pod(cluster, args.namespace, args.name)
    listener = socket.create_server(("127.0.0.1", args.port))
    port = listener.getsockname()[1]
    print(f"service {args.name}: http://127.0.0.1:{port}/v1 (OpenAI API; models: curl http://127.0.0.1:{port}/v1/models), "
          f"through the Kubernetes API to pod {pod}; Ctrl-C ends it", flush=True)
    try:
        serve_local(cluster, args.namespace, pod, listener)
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()
    return 0


def _request(cluster: Cluster, namespace: str, pod: str, method: str, path: str, body: dict | None = None,
             key: str | None = None):
    """One HTTP request to the pod's Serve port over a forward: the response (its socket kept open).
    A forward that fails (nothing listening on the port yet, the pod gone) is a CliError saying so."""
    opened, remote = forward(cluster, namespace, pod)
    connection = http.client.HTTPConnection("127.0.0.1", SERVE_PORT, timeout=CHAT_TIMEOUT_S)
    connection.sock = remote
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        reply = connection.getresponse()
    except (http.client.HTTPException, OSError) as error:
        said = opened.error(SERVE_PORT) or f"{type(error).__name__}: {error}"
        opened.close()
        raise CliError(f"the forward to pod {namespace}/{pod} port {SERVE_PORT} failed ({said.strip()}): its Serve proxy is "
                       "not up yet or the pod went; ray-train-eks serve --list says where the service is") from None
    if reply.status == 401:
        opened.close()
        raise CliError("the service checks a bearer key (it was served with --internal-lb): give it with --key KEY or "
                       "RAY_TRAIN_EKS_SERVE_KEY")
    return opened, reply


def _model(cluster: Cluster, namespace: str, pod: str, asked: str | None, key: str | None) -> str:
    """The model to ask: ``asked``, or the service's only one, or its first adapter."""
    opened, reply = _request(cluster, namespace, pod, "GET", "/v1/models", key=key)
    try:
        if reply.status != 200:
            raise CliError(f"the service answered HTTP {reply.status} to /v1/models: {reply.read()[:300].decode(errors='replace')}")
        models = [m["id"] for m in json.loads(reply.read()).get("data") or []]
    finally:
        opened.close()
    if asked:
        if asked not in models:
            raise CliError(f"--model {asked}: the service serves {', '.join(models) or 'nothing yet'}")
        return asked
    adapters = [m for m in models if ":" in m]
    if not models:
        raise CliError("the service lists no model (/v1/models is empty): ray-train-eks serve --list")
    return adapters[0] if adapters else models[0]


def chat(args: argparse.Namespace) -> int:
    """One streamed chat request: the answer printed as it comes."""
    cluster = connect(args)
    pod = head_pod(cluster, args.namespace, args.name)
    key = args.key or os.environ.get("RAY_TRAIN_EKS_SERVE_KEY")
    model = _model(cluster, args.namespace, pod, args.model, key)
    print(f"[{model}] (a replica that is not up yet starts now: a GPU node and the weights take minutes)", file=sys.stderr,
          flush=True)
    body = {"model": model, "messages": [{"role": "user", "content": args.message}], "stream": True,
            "max_tokens": args.max_tokens}
    opened, reply = _request(cluster, args.namespace, pod, "POST", "/v1/chat/completions", body, key=key)
    try:
        if reply.status != 200:
            raise CliError(f"the service answered HTTP {reply.status}: {reply.read()[:500].decode(errors='replace')}")
        for line in reply:
            text = line.decode().strip()
            if not text.startswith("data:") or text == "data: [DONE]":
                continue
            for choice in json.loads(text[5:]).get("choices") or []:
                print((choice.get("delta") or {}).get("content") or "", end="", flush=True)
        print()
    finally:
        opened.close()
    return 0

"""A stand-in for the Kubernetes API's node endpoints, for training/resilience/kube.py's calls from a pod."""

from __future__ import annotations

import json
import threading

from http_json import send_json


class FakeKubernetes:
    """The Kubernetes API's node endpoints (GET, and PATCH with a JSON patch), as
    training/resilience/kube.py calls them from a pod: enough to see which taints a worker put on its node."""

    def __init__(self, *names: str) -> None:
        import http.server

        self.nodes = {name: {"metadata": {"name": name, "resourceVersion": "1"}, "spec": {}} for name in names}
        self.patches: list[tuple[str, list]] = []
        #: Somebody else (the kubelet) updates the node between the next GET and PATCH.
        self.race_next_patch = False
        #: name -> (n, status): the node's status becomes ``status`` after its n-th GET (the node
        #: monitoring agent finds a fault at a known point of a run, whatever the machine's speed).
        self.status_after_gets: dict[str, tuple[int, dict]] = {}
        self.gets: dict[str, int] = {}
        #: Karpenter's NodeClaims (``/apis/karpenter.sh/v1/nodeclaims``); None: no Karpenter (404).
        self.nodeclaims: list[dict] | None = None
        #: Events (``/api/v1/events``), as Karpenter writes them about NodeClaims.
        self.events: list[dict] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _node(self):
                name = self.path.rsplit("/", 1)[-1]
                return name, api.nodes.get(name)

            def _reply(self, code: int, body: dict) -> None:
                send_json(self, code, body)

            def do_GET(self):
                if self.path.startswith("/api/v1/events"):
                    return self._reply(200, {"items": api.events})
                if self.path == "/apis/karpenter.sh/v1/nodeclaims":
                    return (self._reply(200, {"items": api.nodeclaims}) if api.nodeclaims is not None
                            else self._reply(404, {"reason": "NotFound"}))
                name, node = self._node()
                api.gets[name] = api.gets.get(name, 0) + 1
                if name in api.status_after_gets and api.gets[name] > api.status_after_gets[name][0]:
                    node["status"] = api.status_after_gets[name][1]
                self._reply(200, node) if node else self._reply(404, {"reason": "NotFound"})

            def do_PATCH(self):
                name, node = self._node()
                patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.headers["Content-Type"] == "application/json-patch+json"
                api.patches.append((name, patch))
                if api.race_next_patch:
                    api.race_next_patch = False
                    node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                for op in patch:
                    if op["op"] == "test" and node["metadata"]["resourceVersion"] != op["value"]:
                        return self._reply(422, {"reason": "Invalid"})
                    if op["op"] == "add" and op["path"] == "/spec/taints":
                        node["spec"]["taints"] = op["value"]
                node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                self._reply(200, node)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # a quick shutdown

    def taints(self, name: str) -> list[dict]:
        return self.nodes[name]["spec"].get("taints") or []

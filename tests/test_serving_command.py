"""``ray-train-eks serve``, ``serve --list``, ``endpoint``, ``chat`` and ``unserve`` against the stand-in
API server (tests/fake_apiserver.py: the KubeRay v1.7.0 CRDs, RBAC, port-forwards over a websocket),
as a trainer with exactly the Role the stack binds, the runs in moto's S3, and a stand-in of the
Serve proxy behind the head pod's port 8000. KubeRay is a thread here that does what its RayService
controller would: the head and a GPU worker pod, then the status (tests set the failures)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

from fake_apiserver import FakeApiServer
from openai_standin import OpenAIStandIn
from test_cli import kubeconfig
from test_serving import BASE, BUCKET, NAMESPACE, moto, moto_client, platform_spec, put_run, s3  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def seeded(moto):  # noqa: F811
    client = moto_client(moto)
    for run in ("lora-a", "lora-b"):
        put_run(client, run)
    put_run(client, "full-b", kind="full")


@pytest.fixture
def runs(seeded, s3):  # noqa: F811
    return s3


@pytest.fixture
def api(runs):
    from ray_train_eks.workload.code import SETTINGS_CONFIGMAP
    from ray_train_eks.workload.spec import spec_settings
    from ray_train_eks.workload.trainer_access import TRAINER_RULES

    allowed = {f"{verb} {resource}" for _, resources, verbs in TRAINER_RULES for resource in resources for verb in verbs}
    server = FakeApiServer(tokens={"admin-token": ("admin", "*"), "trainer-token": ("trainer", allowed)})
    server.put({"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": SETTINGS_CONFIGMAP, "namespace": NAMESPACE},
                "data": {"bucket": BUCKET, "workload": spec_settings(platform_spec())}})
    yield server
    server.close()


class KubeRay:
    """What KubeRay's RayService controller does, for the services the API server holds: a cluster
    named ``<service>-<5 letters>``, its head pod (Running) and a GPU worker pod (Pending, then
    Running), then Ready with the cluster active. ``fail``: set InitializingTimeout instead."""

    def __init__(self, api: FakeApiServer, *, fail: bool = False) -> None:
        self.api, self.fail, self.done = api, fail, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        handled: set[tuple[str, int]] = set()
        while not self.done.is_set():
            for service in list(self.api.of("rayservices")):
                metadata = service["metadata"]
                key = (metadata["uid"], metadata["generation"])
                if key in handled or metadata.get("deletionTimestamp"):
                    continue
                handled.add(key)
                if metadata["generation"] == 1:
                    self._bring_up(metadata["name"], 1)
                else:
                    self._update(metadata["name"], metadata["generation"])
            time.sleep(0.05)

    def _update(self, name: str, generation: int) -> None:
        """A serve again: the new serveConfigV2 applied to the active cluster (its app DEPLOYING, then RUNNING)."""
        cluster = f"{name}-abcde"
        ready = [{"type": "Ready", "status": "True", "reason": "NonZeroServeEndpoints"}]
        self.api.update("rayservices", NAMESPACE, name, status={
            "observedGeneration": generation, "conditions": ready,
            "activeServiceStatus": {"rayClusterName": cluster, "applicationStatuses": {"llm": {"status": "DEPLOYING"}}}})
        self._until_watched(name)
        self.api.update("rayservices", NAMESPACE, name, status={
            "observedGeneration": generation, "conditions": ready,
            "activeServiceStatus": {"rayClusterName": cluster, "applicationStatuses": {"llm": {"status": "RUNNING"}}}})

    def _pod(self, name: str, service: str, node_type: str, phase: str) -> None:
        self.api.put({"kind": "Pod", "apiVersion": "v1", "metadata": {
            "name": name, "namespace": NAMESPACE, "labels": {"ray-train-eks/service": service, "ray.io/node-type": node_type,
                                                            "ray.io/cluster": f"{service}-abcde"}},
            "status": {"phase": phase}})

    def _bring_up(self, name: str, generation: int) -> None:
        cluster = f"{name}-abcde"
        self._pod(f"{cluster}-head", name, "head", "Running")
        self._pod(f"{cluster}-gpu-worker", name, "worker", "Pending")
        self.api.update("rayservices", NAMESPACE, name, status={
            "observedGeneration": generation,
            "conditions": [{"type": "Ready", "status": "False", "reason": "Initializing", "message": "the app is deploying"}],
            "pendingServiceStatus": {"rayClusterName": cluster, "applicationStatuses": {"llm": {"status": "DEPLOYING"}}}})
        self._until_watched(name)
        if self.fail:
            self.api.update("rayservices", NAMESPACE, name, status={"observedGeneration": generation, "conditions": [
                {"type": "Ready", "status": "False", "reason": "InitializingTimeout",
                 "message": "RayService failed to become ready within 45m0s"}]})
            return
        self._pod(f"{cluster}-gpu-worker", name, "worker", "Running")
        self.api.update("rayservices", NAMESPACE, name, status={
            "observedGeneration": generation,
            "conditions": [{"type": "Ready", "status": "True", "reason": "NonZeroServeEndpoints"}],
            "activeServiceStatus": {"rayClusterName": cluster, "applicationStatuses": {"llm": {"status": "RUNNING"}}}})

    def _until_watched(self, name: str) -> None:
        """Hold the service where it is until the command follows it (a watch of it, from now): what
        it says of a starting or updating service is then seen whatever the machine's load."""
        since, deadline = len(self.api.queries), time.monotonic() + 30
        while time.monotonic() < deadline and not self.done.is_set():
            if any(str(query.get("watch")).lower() == "true" and query.get("fieldSelector") == f"metadata.name={name}"
                   for method, path, query in list(self.api.queries)[since:] if path.endswith("/rayservices")):
                return
            time.sleep(0.05)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    from ray_train_eks.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def staged(s3, service: str) -> list[str]:  # noqa: F811
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"serve/{service}/").get("Contents") or []
    return sorted(item["Key"].removeprefix(f"serve/{service}/") for item in listed)


def test_serve_list_chat_endpoint_serve_again_and_unserve_as_a_trainer(api, runs, tmp_path, capsys):
    config = kubeconfig(tmp_path, api, "trainer-token")
    kuberay = KubeRay(api)
    try:
        code, out, err = run(capsys, "serve", "lora-a", "lora-b", "--name", "chat", "--kubeconfig", config, "--wait", "1")
        assert code == 0, err
        assert "service chat created" in out and f"models {BASE}, {BASE}:lora-a, {BASE}:lora-b" in out
        assert "a GPU worker waits for a node" in out and "service chat is ready" in out
        (service,) = api.of("rayservices")
        owned = [o for o in api.of("networkpolicies")
                 if (o["metadata"].get("ownerReferences") or [{}])[0].get("uid") == service["metadata"]["uid"]]
        assert sorted(o["metadata"]["name"] for o in owned) == ["chat-dashboard", "chat-ray-pods", "chat-serve"]
        engine = [key for key in staged(runs, "chat") if key.startswith("engine-")]
        assert len(engine) == 1 and engine[0] in service["spec"]["serveConfigV2"]
        assert [key for key in staged(runs, "chat") if not key.startswith("engine-")] == [
            "lora/lora-a/adapter_config.json", "lora/lora-a/adapter_model.safetensors",
            "lora/lora-b/adapter_config.json", "lora/lora-b/adapter_model.safetensors"]

        code, out, _ = run(capsys, "serve", "--list", "--kubeconfig", config)
        assert code == 0 and "chat" in out and "ready" in out and f"{BASE} (+ adapters)" in out and "4.60 USD/hour" in out
        code, out, err = run(capsys, "status", "chat", "--kubeconfig", config)
        assert code == 0, err
        assert out.splitlines()[:3] == [
            "service chat: ready, RayService ray-train/chat",
            "  GPU nodes: 1, 4.60 USD/hour now; none after 15 min without a request",
            f"  models: {BASE} (+ adapters); adapters: lora-a, lora-b"]

        standin = OpenAIStandIn([BASE, f"{BASE}:lora-a", f"{BASE}:lora-b"])
        api.forward_targets[(NAMESPACE, "chat-abcde-head")] = standin.address
        try:
            code, out, err = run(capsys, "chat", "chat", "Say hello", "--kubeconfig", config)
            assert code == 0, err
            assert out == "Hello from the service.\n" and f"[{BASE}:lora-a]" in err
            posted = [body for method, _, body in standin.requests if method == "POST"]
            assert posted[0]["messages"] == [{"role": "user", "content": "Say hello"}] and posted[0]["stream"] is True
            _through_the_endpoint(api, config, standin)
        finally:
            standin.close()
        assert {(NAMESPACE, "chat-abcde-head", 8000)} == set(api.forwarded)

        uid = service["metadata"]["uid"]
        # Fewer adapters: only the bucket changes (what /v1/models lists), not the service's configuration.
        code, out, err = run(capsys, "serve", "lora-a", "--name", "chat", "--kubeconfig", config, "--wait", "1")
        assert code == 0 and "service chat: the same configuration; the adapters staged now: lora-a" in out, err
        # A full model more: a new configuration, applied in place; not "ready" from the status before it.
        code, out, err = run(capsys, "serve", "lora-a", "full-b", "--name", "chat", "--kubeconfig", config, "--wait", "1")
        assert code == 0 and "service chat updated in place" in out, err
        assert "  updating" in out and out.index("  updating") < out.index("service chat is ready"), out
        (again,) = api.of("rayservices")
        assert again["metadata"]["uid"] == uid and again["metadata"]["generation"] == 2
        assert "full-b" in again["spec"]["serveConfigV2"]
        assert [key for key in staged(runs, "chat") if not key.startswith("engine-")] == [
            "lora/lora-a/adapter_config.json", "lora/lora-a/adapter_model.safetensors"]

        code, out, err = run(capsys, "unserve", "chat", "--kubeconfig", config)
        assert code == 0 and "unserved chat" in out and "its 1 GPU node(s) are freed" in out, err
        assert api.of("rayservices") == [] and staged(runs, "chat") == []
        assert not [q for q in api.queries if "secrets" in q[1]]  # nothing beyond the Role was even asked
    finally:
        kuberay.stop()


def _through_the_endpoint(api: FakeApiServer, config: str, standin: OpenAIStandIn) -> None:
    """``endpoint``'s forwarder: a local port whose connection reaches the head's port 8000."""
    from ray_train_eks.cli.endpoint import head_pod, serve_local
    from ray_train_eks.cli.kube import from_kubeconfig

    cluster = from_kubeconfig(config)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    forwarding = threading.Thread(target=serve_local, args=(cluster, NAMESPACE, head_pod(cluster, NAMESPACE, "chat"), listener),
                                  kwargs={"connections": 1}, daemon=True)
    forwarding.start()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=20) as reply:
        assert [m["id"] for m in json.loads(reply.read())["data"]] == standin.models
    forwarding.join(timeout=10)
    listener.close()


def test_serving_while_a_training_job_holds_the_gpu_nodes_says_what_waits_for_what(api, runs, tmp_path, capsys):
    config = kubeconfig(tmp_path, api)
    api.put({"kind": "RayJob", "apiVersion": "ray.io/v1", "metadata": {"name": "dolly-1234abcd", "namespace": NAMESPACE},
             "spec": {"entrypoint": "python -m training.train"}, "status": {"jobStatus": "RUNNING"}})
    code, out, err = run(capsys, "serve", "lora-a", "--name", "chat", "--kubeconfig", config, "--no-wait")
    assert code == 0, err
    assert ("it takes up to 1 of the 2 GPU nodes while a replica runs; a training job that needs them waits until serving "
            "goes to zero (15 min without a request) or is unserved; now dolly-1234abcd (running) holds the GPU nodes: the "
            "first replica waits until it ends") in out


def test_a_model_that_fails_to_load_is_said_and_unserve_frees_it_while_it_starts(api, runs, tmp_path, capsys):
    config = kubeconfig(tmp_path, api)
    kuberay = KubeRay(api, fail=True)
    try:
        code, _, err = run(capsys, "serve", "lora-a", "--name", "broken", "--kubeconfig", config, "--wait", "1")
        assert code == 1
        assert "service broken failed" in err and "ray-train-eks unserve broken frees what it holds" in err
    finally:
        kuberay.stop()
    code, out, err = run(capsys, "serve", "lora-b", "--name", "starting", "--kubeconfig", config, "--no-wait")
    assert code == 0, err
    code, out, err = run(capsys, "unserve", "starting", "--kubeconfig", config)
    assert code == 0 and "unserved starting" in out and "it held no GPU node" in out, err
    assert [s["metadata"]["name"] for s in api.of("rayservices")] == ["broken"]


def test_a_training_submit_while_serving_holds_a_gpu_node_says_what_waits(api, runs, tmp_path, capsys):
    api.put({"kind": "Pod", "apiVersion": "v1", "metadata": {
        "name": "chat-abcde-gpu-worker", "namespace": NAMESPACE,
        "labels": {"ray-train-eks/service": "chat", "ray.io/node-type": "worker", "ray.io/cluster": "chat-abcde"}},
        "status": {"phase": "Running"}})
    code, out, err = run(capsys, "submit", "--name", "while-serving", "--kubeconfig", kubeconfig(tmp_path, api), "--",
                         "--max-steps", "5")
    assert code == 0, err
    assert ("serving (chat) holds 1 of the 2 GPU nodes: the job's workers wait until it goes to zero (15 min after its last "
            "request) or ray-train-eks unserve chat") in out


def test_chat_says_a_forward_that_fails_and_a_bearer_key_it_needs_and_takes_the_key(api, runs, tmp_path, capsys):
    """What a port-forward to a head whose proxy is not up, or a service behind a bearer key, gives
    ``chat``: a sentence, not a traceback; with the key (``--key``), the answer."""
    config = kubeconfig(tmp_path, api)
    kuberay = KubeRay(api)
    try:
        assert run(capsys, "serve", "lora-a", "--name", "keyed", "--kubeconfig", config, "--wait", "1")[0] == 0
    finally:
        kuberay.stop()
    closed = socket.create_server(("127.0.0.1", 0))
    api.forward_targets[(NAMESPACE, "keyed-abcde-head")] = closed.getsockname()
    closed.close()  # nothing listens there: the pod's proxy is not up
    code, _, err = run(capsys, "chat", "keyed", "hi", "--kubeconfig", config)
    assert code == 1 and "the forward to pod ray-train/keyed-abcde-head port 8000 failed" in err and "Traceback" not in err
    standin = OpenAIStandIn([BASE, f"{BASE}:lora-a"], key="the-key")
    api.forward_targets[(NAMESPACE, "keyed-abcde-head")] = standin.address
    try:
        code, _, err = run(capsys, "chat", "keyed", "hi", "--kubeconfig", config)
        assert code == 1 and "the service checks a bearer key" in err and "--key KEY" in err
        code, out, err = run(capsys, "chat", "keyed", "hi", "--key", "the-key", "--kubeconfig", config)
        assert code == 0 and out == "Hello from the service.\n", err
    finally:
        standin.close()


def test_what_a_serve_again_cannot_change_in_place_is_refused_with_the_way_out(api, runs, tmp_path, capsys):
    """KubeRay starts no service again after its initializing timeout, and changes a serve Service only
    with a new cluster: a serve again of such a change is refused, nothing sent."""
    config = kubeconfig(tmp_path, api)
    assert run(capsys, "serve", "lora-a", "--name", "plain", "--kubeconfig", config, "--no-wait")[0] == 0
    code, _, err = run(capsys, "serve", "lora-a", "--name", "plain", "--internal-lb", "--kubeconfig", config, "--no-wait")
    assert code == 1 and ("service plain was made without --internal-lb, and KubeRay changes its Service only with a new "
                          "cluster: ray-train-eks unserve plain, then serve it again with it") in err
    api.update("rayservices", NAMESPACE, "plain", status={"conditions": [
        {"type": "Ready", "status": "False", "reason": "InitializingTimeout", "message": "gave up"}]})
    version = api.of("rayservices")[0]["metadata"]["resourceVersion"]
    code, _, err = run(capsys, "serve", "lora-b", "--name", "plain", "--kubeconfig", config, "--no-wait")
    assert code == 1 and "service plain gave up starting (KubeRay's initializing timeout)" in err
    assert api.of("rayservices")[0]["metadata"]["resourceVersion"] == version  # nothing sent

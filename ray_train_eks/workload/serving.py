"""A finished run behind an OpenAI-compatible endpoint: the RayService (KubeRay v1.7.0) that runs Ray
Serve LLM on the platform's nodes, its NetworkPolicies, and the operator's rules
about it. What it serves (``serveConfigV2``) is built from the runs' records by
ray_train_eks/handlers/serving.py; this module builds everything else, from the platform's spec
alone, so that serving other runs changes ``serveConfigV2`` only, which KubeRay applies in place
to the running cluster (``rayservice_controller.go`` ``updateServeDeployment``); a change of
``rayClusterConfig`` would build a second cluster (``upgradeStrategy: NewCluster``).

- **GPUs from zero and back.** The GPU worker group starts at 0 replicas with in-tree autoscaling on:
  Ray's autoscaler adds a GPU worker (so Karpenter or the node group a node) when a replica needs a
  GPU and removes it ``autoscalerOptions.idleTimeoutSeconds`` after its last replica went; Serve takes
  a model's replicas to zero ``downscale_to_zero_delay_s`` after its last request. A service is never
  queued by Kueue: Kueue refuses a queued RayService with autoscaling (kueue
  ``pkg/controller/jobs/raycluster/common.go`` ``ValidateCreate``), and KubeRay copies a RayService's
  labels to its RayClusters, so it carries no queue label.
- **The ingress on the head.** Ray Serve LLM's OpenAI router is a replica of its own: the head offers
  one unit of the custom resource ``serve-ingress`` and the router asks for it
  (handlers/serving.py ``INGRESS_RESOURCE``), so it never keeps a GPU node up.
- **A failed model load frees its GPUs.** The first deploy starts one replica (``initial_replicas``):
  until it is up the service is Initializing, and ``ray.io/initializing-timeout`` makes KubeRay give
  up on it and delete its cluster ``rayClusterDeletionDelaySeconds`` later.
- **Reachable by the right people only.** KubeRay's ``<name>-serve-svc`` is a ClusterIP Service; the
  NetworkPolicies let in the cluster's own pods and the operator (dashboard 8265, the proxy's health
  on 8000), nothing else. ``ray-train-eks endpoint`` reaches the head's port 8000 through the
  Kubernetes API (a port-forward: RBAC decides). An internal load balancer, with a bearer key checked
  by the ingress, is opt-in.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.workload.access import CLUSTER_LABEL, DASHBOARD_PORT, _network_policy
from ray_train_eks.workload.sizing import worker_sizing
from ray_train_eks.workload.spec import PART_OF, RayWorkloadSpec

RAY_API_VERSION = "ray.io/v1"
#: KubeRay v1.7.0: a RayService's name is at most 47 characters, a DNS-1035 label (utils/constant.go
#: ``MaxRayServiceNameLength = MaxRayClusterNameLength - 6``: its clusters add ``-<5 random>``;
#: utils/validation.go ``ValidateRayServiceMetadata``).
MAX_RAYSERVICE_NAME = 47
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: The label of a service's objects, naming it.
SERVICE_LABEL = "ray-train-eks/service"
#: Ray Serve's HTTP port (the proxy on every node with a replica); KubeRay's serve Service targets
#: the head container's port named ``serve`` (common/service.go ``BuildServeService``).
SERVE_PORT = 8000
#: How long KubeRay waits for a service's first deployment to be up before it gives up and deletes
#: its cluster (``ray.io/initializing-timeout``, rayservice_controller.go): a GPU node's start (with
#: Karpenter: minutes), the Serve LLM image's pull, the weights' download and vLLM's start.
INITIALIZING_TIMEOUT = "45m"
#: Seconds KubeRay keeps a cluster it no longer uses (a failed first deployment's, an upgraded one's)
#: before deleting it (``rayClusterDeletionDelaySeconds``, KubeRay's default 60).
CLUSTER_DELETION_DELAY_S = 30
#: Seconds Ray's autoscaler keeps an idle GPU worker (its node) after its last replica went.
NODE_IDLE_SECONDS = 60
#: The Serve LLM router's request timeout (``RAY_SERVE_LLM_ROUTER_HTTP_TIMEOUT``, 600 s by default:
#: ray/llm/_internal/serve/constants.py): a request that starts a replica from zero waits for a GPU
#: node, the image and the weights, longer than that on a first start.
ROUTER_TIMEOUT_S = 1800
CACHE_MOUNT = "/cache"
#: A service's head: CPU requested (the platform's system-node budget counts it: capacity.py), its
#: limit, and memory. It runs the GCS, the Serve controller and proxy, the app's build (which imports
#: vLLM) and the OpenAI router, on the system nodes beside the training's head.
SERVING_HEAD_CPU_M, SERVING_HEAD_CPU_LIMIT, SERVING_HEAD_MEMORY_GIB = 250, 2, 6
#: The Ray autoscaler KubeRay runs beside a service's head (its default: 500m CPU and 512Mi, requests
#: equal to limits, ray-operator common/pod.go ``BuildAutoscalerContainer``): a smaller request, the
#: budget's (capacity.py ``serving-head`` counts head and autoscaler).
AUTOSCALER_CPU_M, AUTOSCALER_MEMORY_MIB = 100, 512
AUTOSCALER_RESOURCES = {"requests": {"cpu": f"{AUTOSCALER_CPU_M}m", "memory": f"{AUTOSCALER_MEMORY_MIB}Mi"},
                        "limits": {"cpu": "500m", "memory": f"{AUTOSCALER_MEMORY_MIB}Mi"}}


def service_problems(spec: RayWorkloadSpec, name: str) -> list[str]:
    """What KubeRay v1.7.0 refuses of a RayService only once it is created (status
    ``ValidationFailed``, utils/validation.go ``ValidateRayServiceMetadata``/``ValidateRayServiceSpec``),
    and what the platform cannot serve on."""
    problems = []
    if not _DNS_1035.match(name) or len(name) > MAX_RAYSERVICE_NAME:
        problems.append(f"service name {name!r}: KubeRay takes a DNS-1035 label of at most {MAX_RAYSERVICE_NAME} characters "
                        "(lower-case letters, digits and '-', starting with a letter), e.g. --name dolly-chat")
    if spec.serving_gpu_nodes < 1:
        problems.append(f"servingGpuNodes={spec.serving_gpu_nodes}: serving needs at least 1 GPU node; deploy with "
                        "-c servingGpuNodes=1")
    if spec.gpu_instance_type not in INSTANCE_TYPES:
        problems.append(f"gpu_instance_type={spec.gpu_instance_type!r} is not in ray_train_eks.instances.INSTANCE_TYPES: "
                        "serving sizes its replicas from the table")
    return problems


def serving_head_room_problem(spec: RayWorkloadSpec) -> str | None:
    """Why a service's head cannot start beside a training job's head on the system nodes (their CPU
    requests leave less than it asks, capacity.py ``serving-head``, or one node's memory does), or None."""
    from ray_train_eks.capacity import CPU_REQUESTS_M

    need_m, need_mib = CPU_REQUESTS_M["serving-head"][0], SERVING_HEAD_MEMORY_GIB * 1024 + AUTOSCALER_MEMORY_MIB
    if spec.serving_gpu_nodes < 1:
        return None
    short = []
    if spec.system_room_m is not None and spec.system_room_m < need_m:
        short.append(f"{need_m}m CPU (they have {max(0, spec.system_room_m)}m left)")
    if spec.system_memory_room_mib is not None and spec.system_memory_room_mib < need_mib:
        short.append(f"{need_mib} MiB of one node's memory (about {max(0, spec.system_memory_room_mib)} MiB left)")
    if not short:
        return None
    return (f"a service's head (ray-train-eks serve) needs {' and '.join(short)} of the system nodes beside a training "
            "job's head: while a job runs a service's head waits, and while a service is up a job's head does; "
            "-c systemNodeCount=2 (or a larger -c systemInstanceType) gives both room, -c servingGpuNodes=0 turns serving off")


def _ray_start_resources(resources: Mapping[str, int]) -> str:
    """``rayStartParams.resources``: KubeRay passes the value to ``ray start --resources=`` through a
    shell, so it is the JSON quoted once more (KubeRay's docs: ``'"{\\"Custom1\\": 1}"'``), which Ray's
    autoscaler reads too (ray/autoscaler/_private/kuberay/autoscaling_config.py). KubeRay v1.7.0's own
    reading of it (common/pod.go ``getResourcesMap``) cannot parse the escapes and logs so; it uses that
    reading only for the GPU count, which ``num-gpus`` gives."""
    return '"' + json.dumps(dict(resources)).replace('"', '\\"') + '"'


def _volumes(memory_gib: int) -> tuple[list[dict], list[dict]]:
    """The cache for the weights, and /dev/shm for Ray's object store."""
    volumes = [
        {"name": "cache", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{max(1, int(memory_gib * 0.3))}Gi"}},
    ]
    return volumes, [{"name": "cache", "mountPath": CACHE_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}]


def _env(spec: RayWorkloadSpec) -> list[dict]:
    env = [{"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
           {"name": "RAY_SERVE_LLM_ROUTER_HTTP_TIMEOUT", "value": str(ROUTER_TIMEOUT_S)}]
    return env + ([{"name": "AWS_REGION", "value": spec.region}] if spec.region else [])


def _resources(cpu: int, memory_gib: int, extra: Mapping[str, int] | None = None) -> dict:
    amounts = {"cpu": str(cpu), "memory": f"{memory_gib}Gi", **{k: str(v) for k, v in (extra or {}).items()}}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _placement(selector: Mapping[str, str], tolerations) -> dict:
    placement: dict[str, Any] = {}
    if selector:
        placement["nodeSelector"] = dict(selector)
    if tolerations:
        placement["tolerations"] = [dict(t) for t in tolerations]
    return placement


def head_group(spec: RayWorkloadSpec, name: str) -> dict:
    """The head: on the system nodes as the training's head, no GPUs, CPUs for the ingress (and the
    custom resource that keeps it there), the dashboard and the Serve port."""
    from ray_train_eks.handlers.serving import INGRESS_RESOURCE

    memory = SERVING_HEAD_MEMORY_GIB
    volumes, mounts = _volumes(memory)
    # Requests below the limit (Burstable): the system nodes' budget holds the request beside the
    # training's head; the router and the app's build may use up to the limit when there is room.
    resources = {"requests": {"cpu": f"{SERVING_HEAD_CPU_M}m", "memory": f"{memory}Gi"},
                 "limits": {"cpu": str(SERVING_HEAD_CPU_LIMIT), "memory": f"{memory}Gi"}}
    return {
        # One logical CPU for the router's replica (it asks for one, and for the ingress resource).
        "rayStartParams": {"num-gpus": "0", "num-cpus": "1", "dashboard-host": "0.0.0.0",
                           "resources": _ray_start_resources({INGRESS_RESOURCE: 1})},
        "template": {
            "metadata": {"labels": {CLUSTER_LABEL: name, SERVICE_LABEL: name}},
            "spec": {
                "serviceAccountName": spec.service_account,
                **_placement(spec.head_node_selector, spec.head_tolerations),
                "volumes": volumes,
                "containers": [{
                    "name": "ray-head",
                    "image": spec.serving_image,
                    "imagePullPolicy": "IfNotPresent",
                    "ports": [{"name": "gcs-server", "containerPort": 6379},
                              {"name": "dashboard", "containerPort": DASHBOARD_PORT},
                              {"name": "client", "containerPort": 10001},
                              {"name": "serve", "containerPort": SERVE_PORT}],
                    "env": [*_env(spec), {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
                    "resources": resources,
                    "volumeMounts": mounts,
                }],
            },
        },
    }


def gpu_group(spec: RayWorkloadSpec, name: str) -> dict:
    """The GPU workers: none until a replica needs one, at most ``serving_gpu_nodes``, one pod a node
    with all its GPUs (a replica takes its tensor-parallel share), on the serving nodes."""
    cpu, memory = worker_sizing(spec)
    volumes, mounts = _volumes(memory)
    selector = spec.worker_node_selector if spec.serving_node_selector is None else spec.serving_node_selector
    return {
        "groupName": "gpu-serving",
        "replicas": 0,
        "minReplicas": 0,
        "maxReplicas": spec.serving_gpu_nodes,
        "rayStartParams": {},
        "template": {
            # Karpenter's consolidation must not take a node with a live replica: Ray's autoscaler removes
            # an idle GPU worker itself. (Training's pods carry none: the NodePool's budgets and their
            # preStop checkpoint cover them; a replica has no state to save, only requests to finish.)
            "metadata": {"labels": {CLUSTER_LABEL: name, SERVICE_LABEL: name},
                         "annotations": {"karpenter.sh/do-not-disrupt": "true"}},
            "spec": {
                "serviceAccountName": spec.service_account,
                **_placement(selector, (*spec.worker_tolerations, *spec.serving_tolerations)),
                "volumes": volumes,
                "containers": [{
                    "name": "ray-worker",
                    "image": spec.serving_image,
                    "imagePullPolicy": "IfNotPresent",
                    "env": _env(spec),
                    # The node's GPUs; no EFA interface: a replica's tensor parallelism stays in its node.
                    "resources": _resources(cpu, memory, {"nvidia.com/gpu": spec.worker_gpus}),
                    "volumeMounts": mounts,
                }],
            },
        },
    }


#: The RayService's annotation holding the SHA-256 of its ``rayClusterConfig`` as built here: a serve
#: again compares it to tell whether KubeRay will build a second cluster (the stored spec has the API
#: server's defaults in it, so the spec itself cannot be compared).
CLUSTER_CONFIG_ANNOTATION = "ray-train-eks/cluster-config-sha256"
#: The annotations that make KubeRay's serve Service an internal Network Load Balancer (the Kubernetes
#: cloud provider for AWS, which EKS runs: kubernetes/cloud-provider-aws ``aws-load-balancer-internal``,
#: ``aws-load-balancer-type``), in the cluster's private subnets.
INTERNAL_LB_ANNOTATIONS = {"service.beta.kubernetes.io/aws-load-balancer-internal": "true",
                           "service.beta.kubernetes.io/aws-load-balancer-type": "nlb"}


def cluster_config(spec: RayWorkloadSpec, name: str) -> dict:
    """The service's RayCluster spec: from the platform alone, the same whatever it serves."""
    return {
        "rayVersion": spec.ray_version,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {"idleTimeoutSeconds": NODE_IDLE_SECONDS, "upscalingMode": "Default",
                              "resources": AUTOSCALER_RESOURCES},
        "authOptions": {"mode": spec.auth_mode},
        "headGroupSpec": head_group(spec, name),
        "workerGroupSpecs": [gpu_group(spec, name)],
    }


def config_digest(config: Mapping[str, Any]) -> str:
    """The SHA-256 of a ``rayClusterConfig`` (:data:`CLUSTER_CONFIG_ANNOTATION`)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def ray_service(spec: RayWorkloadSpec, name: str, serve_config: str, *, load_balancer: bool = False) -> dict:
    """The RayService ``name`` serving ``serve_config`` (serveConfigV2, a YAML document); with
    ``load_balancer`` its serve Service is an internal load balancer (:data:`INTERNAL_LB_ANNOTATIONS`)."""
    config = cluster_config(spec, name)
    service: dict[str, Any] = {
        "serveConfigV2": serve_config,
        "upgradeStrategy": {"type": "NewCluster"},
        "rayClusterDeletionDelaySeconds": CLUSTER_DELETION_DELAY_S,
        "rayClusterConfig": config,
    }
    if load_balancer:
        service["serveService"] = {
            "metadata": {"name": f"{name}-serve-svc", "annotations": dict(INTERNAL_LB_ANNOTATIONS)},
            "spec": {"type": "LoadBalancer", "ports": [{"name": "serve", "port": SERVE_PORT, "targetPort": SERVE_PORT}]}}
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayService",
        "metadata": {"name": name, "namespace": spec.namespace, "labels": {**PART_OF, SERVICE_LABEL: name},
                     "annotations": {"ray.io/initializing-timeout": INITIALIZING_TIMEOUT,
                                     CLUSTER_CONFIG_ANNOTATION: config_digest(config)}},
        "spec": service,
    }


def service_policies(spec: RayWorkloadSpec, name: str, *, load_balancer: bool = False) -> list[dict]:
    """The service's NetworkPolicies (the namespace denies all other ingress): its pods to each other
    (every Ray port, and Serve's between proxies and replicas); the KubeRay operator to the head's
    dashboard (the Serve applications' API) and to every pod's Serve port (the operator asks each
    proxy's ``/-/healthz``: rayservice_controller.go ``updateHeadPodServeLabel``); with
    ``load_balancer``, anyone to the Serve port (the internal load balancer's traffic; the ingress
    checks the bearer key). None without ``spec.network_policies``."""
    if not spec.network_policies:
        return []
    pods = {CLUSTER_LABEL: name}
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.operator_namespace}},
                "podSelector": {"matchLabels": dict(spec.operator_pod_labels)}}
    policies = [
        _network_policy(spec, f"{name}-ray-pods", pods, [{"from": [{"podSelector": {"matchLabels": dict(pods)}}]}]),
        _network_policy(spec, f"{name}-dashboard", {**pods, "ray.io/node-type": "head"},
                        [{"from": [operator], "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]}]),
        _network_policy(spec, f"{name}-serve", pods,
                        [{**({} if load_balancer else {"from": [operator]}),
                          "ports": [{"protocol": "TCP", "port": SERVE_PORT}]}]),
    ]
    for policy in policies:
        policy["metadata"]["labels"][SERVICE_LABEL] = name
    return policies


def service_objects(spec: RayWorkloadSpec, name: str, serve_config: str, *, load_balancer: bool = False) -> list[dict]:
    """Everything a service is, in apply order: its NetworkPolicies, then the RayService."""
    return [*service_policies(spec, name, load_balancer=load_balancer), ray_service(spec, name, serve_config,
                                                                                   load_balancer=load_balancer)]


_GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
UPGRADE_STRATEGIES = ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or "")[:3]) or (0,)


def operator_problems(service: Mapping[str, Any]) -> list[str]:
    """KubeRay v1.7.0's checks of a RayService object (ray-operator/controllers/ray/utils/validation.go:
    ``ValidateRayServiceMetadata``, ``ValidateRayServiceSpec`` and what ``ValidateRayClusterSpec`` asks
    of the groups this module builds), which the CRD's schema does not carry and which show only
    as ``ValidationFailed`` in the RayService's status once it is created."""
    metadata, spec = service["metadata"], service["spec"]
    name, problems = metadata["name"], []
    if len(name) > MAX_RAYSERVICE_NAME:
        problems.append(f"RayService name should be no more than {MAX_RAYSERVICE_NAME} characters: {name}")
    if not _DNS_1035.match(name):
        problems.append(f"RayService name should be a valid DNS1035 label: {name}")
    timeout = (metadata.get("annotations") or {}).get("ray.io/initializing-timeout")
    if timeout and not (_GO_DURATION.match(timeout) or (timeout.isdigit() and int(timeout) > 0)):
        problems.append(f"ray.io/initializing-timeout has invalid format: {timeout}")
    cluster = spec["rayClusterConfig"]
    if ((cluster.get("headGroupSpec") or {}).get("headService") or {}).get("metadata", {}).get("name"):
        problems.append("spec.rayClusterConfig.headGroupSpec.headService.metadata.name should not be set")
    strategy = (spec.get("upgradeStrategy") or {}).get("type")
    if strategy and strategy not in UPGRADE_STRATEGIES:
        problems.append(f"Invalid value for RayService UpgradeStrategy: {strategy}")
    if spec.get("rayClusterDeletionDelaySeconds", 0) < 0:
        problems.append("RayService spec.rayClusterDeletionDelaySeconds should be a non-negative integer")
    auth = cluster.get("authOptions") or {}
    if auth.get("mode") == "token" and _version(cluster.get("rayVersion", "")) < (2, 52, 0):
        problems.append(f"authOptions.mode token needs rayVersion >= 2.52.0: {cluster.get('rayVersion')}")
    autoscaling = cluster.get("enableInTreeAutoscaling")
    for group in [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]:
        label = group.get("groupName", "head")
        if group.get("resources") and any(k in group.get("rayStartParams", {}) for k in ("num-cpus", "num-gpus", "memory", "resources")):
            problems.append(f"group {label}: rayStartParams num-cpus, num-gpus, memory or resources beside the group's resources")
        if "groupName" in group:
            lo, hi = group.get("minReplicas"), group.get("maxReplicas")
            if lo is None or hi is None or lo < 0 or hi < 0 or lo > hi:
                problems.append(f"worker group {label}: minReplicas {lo} and maxReplicas {hi} must be set, 0 or more, "
                                "min <= max")
            if group.get("suspend") and autoscaling:
                problems.append(f"worker group {label}: suspend is not allowed with in-tree autoscaling")
    return problems

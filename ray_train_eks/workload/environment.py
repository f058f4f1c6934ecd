"""The Ray pods' environment: what the head's and the GPU workers' containers are told (the code's
path, the settings ConfigMap's keys, where the runs log to, EFA and NCCL, the preStop check, the
node marker's variables, the metrics). Worked out once per job (job.py ``resolve_job``)."""

from __future__ import annotations

import json

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.workload.code import CODE_MOUNT, SETTINGS_CONFIGMAP
from ray_train_eks.workload.drain_hook import PRESTOP_CHECK_ENV
from ray_train_eks.workload.node_marker import NODE_NAME_ENV, POD_GPUS_ENV, UNHEALTHY_TAINT_ENV
from ray_train_eks.workload.spec import REPLACEMENT_TIMEOUT_ENV, RayWorkloadSpec

CACHE_MOUNT = "/cache"
#: Where the GPU workers stage checkpoints before Ray uploads them (training/storage/checkpoint.py): an
#: emptyDir, so on the node's NVMe RAID0 where the type has one (nodeadm's localStorage).
SCRATCH_MOUNT = "/scratch"
#: The settings ConfigMap's keys the stack writes where it has them (both optional in the pods): the SNS
#: topic a run's events go to (training/telemetry/notify.py), and the Capacity Blocks the GPU nodes run on
#: alone, comma-separated (training/resilience/deadline.py: the run stops before the earliest's end).
NOTIFY_TOPIC_KEY, CAPACITY_BLOCKS_KEY = "notify_topic_arn", "capacity_block_ids"
#: Or the tags that select those blocks (JSON), where the reservations are selected by tags.
CAPACITY_BLOCK_TAGS_KEY = "capacity_block_tags"
#: And what takes their nodes at a block's end (``karpenter`` or ``node-group``): only Karpenter follows an
#: extension (training/resilience/deadline.py ``extended``).
CAPACITY_BLOCK_NODES_KEY = "capacity_block_nodes"


def _tracking_env(spec: RayWorkloadSpec) -> list[dict]:
    """Where the runs log to (training/telemetry/tracking.py), what the platform is (its tags; the GPU
    nodes' on-demand price an hour, for the cost so far), where the run's events go and the capacity
    blocks it must stop before."""
    from ray_train_eks.tracking import TRACKING_URI_KEY

    gpu = INSTANCE_TYPES.get(spec.gpu_instance_type)
    platform = {"instance_type": spec.gpu_instance_type, "node_count": spec.gpu_node_count, "image": spec.ray_image,
                "gpu_type": gpu.gpu_model if gpu else None,
                "gpu_usd_per_hour": round(gpu.on_demand_usd_per_hour * spec.gpu_node_count, 4) if gpu else None}
    env = [{"name": "RAY_TRAIN_EKS_PLATFORM", "value": json.dumps({k: v for k, v in platform.items() if v is not None}, sort_keys=True)}]
    if spec.tracking:
        env.append({"name": "MLFLOW_TRACKING_URI", "valueFrom": {"configMapKeyRef": {
            "name": SETTINGS_CONFIGMAP, "key": TRACKING_URI_KEY, "optional": True}}})
        if spec.tracking_experiment:
            env.append({"name": "RAY_TRAIN_EKS_MLFLOW_EXPERIMENT", "value": spec.tracking_experiment})
    for name, key in (("RAY_TRAIN_EKS_NOTIFY_TOPIC_ARN", NOTIFY_TOPIC_KEY), ("RAY_TRAIN_EKS_CAPACITY_BLOCK_IDS", CAPACITY_BLOCKS_KEY),
                      ("RAY_TRAIN_EKS_CAPACITY_BLOCK_TAGS", CAPACITY_BLOCK_TAGS_KEY),
                      ("RAY_TRAIN_EKS_CAPACITY_BLOCK_NODES", CAPACITY_BLOCK_NODES_KEY)):
        env.append({"name": name, "valueFrom": {"configMapKeyRef": {"name": SETTINGS_CONFIGMAP, "key": key, "optional": True}}})
    return env


def _common_env(spec: RayWorkloadSpec) -> list[dict]:
    """What the head and the GPU workers both read: the code's path, the caches, the bucket and the
    storage path, the region, and :func:`_tracking_env`."""
    return [*_tracking_env(spec),
        {"name": "PYTHONPATH", "value": CODE_MOUNT},
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
        {"name": "RAY_TRAIN_EKS_CACHE", "value": f"{CACHE_MOUNT}/ray-train-eks"},
        {"name": "TRAINING_BUCKET", "valueFrom": {"configMapKeyRef": {"name": SETTINGS_CONFIGMAP, "key": "bucket"}}},
        # Kubernetes expands $(VAR) from earlier entries. The training module reads this when
        # --storage-path is not given, so the entrypoint holds no shell variable (KubeRay's
        # submitter pod would expand it in its own shell, where it is empty).
        {"name": "RAY_TRAIN_EKS_STORAGE_PATH", "value": "s3://$(TRAINING_BUCKET)/runs"},
        # The region for every AWS client of the training (metrics, the Capacity Blocks' end, SNS): a
        # pod cannot ask IMDS for it at hop limit 1, and the driver runs on the head.
        *([{"name": "AWS_REGION", "value": spec.region}] if spec.region else []),
    ]


def _head_env(spec: RayWorkloadSpec, common: list[dict]) -> list[dict]:
    """The head's environment: ``common``, no GPUs, and what the driver (on the head) reads of the
    platform: how long a node taken out may go unreplaced."""
    env = [*common, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    if spec.replacement_timeout_s is not None:
        env.append({"name": REPLACEMENT_TIMEOUT_ENV, "value": str(spec.replacement_timeout_s)})
    return env


def _worker_env(spec: RayWorkloadSpec, common: list[dict], *, gpus: int, drain_command: list[str]) -> list[dict]:
    """The GPU workers' environment: ``common``, EFA and NCCL's, the preStop check's (``drain_command``),
    training.resilience.health's (node_marker.py: the pod's ``gpus``) and the metrics'."""
    env = [
        *common,
        {"name": "RAY_TRAIN_EKS_SCRATCH", "value": SCRATCH_MOUNT},
        {"name": "FI_PROVIDER", "value": "efa"},
        {"name": "NCCL_NET_PLUGIN", "value": "ofi"},
        # Keep NCCL's bootstrap and socket fallback off loopback and pod-local links.
        {"name": "NCCL_SOCKET_IFNAME", "value": "^lo,docker,veth"},
        # Set either way: the DLC sets INFO in its image env and /etc/nccl.conf, and an
        # environment variable wins over nccl.conf. With WARN the preflight logs NCCL's
        # INIT/NET lines to a file in /tmp and echoes the transport (training/resilience/preflight.py).
        {"name": "NCCL_DEBUG", "value": "INFO" if spec.nccl_debug else "WARN"},
        # The preflight runs the preStop hook in check mode in the pod (training/resilience/preflight.py).
        {"name": PRESTOP_CHECK_ENV, "value": json.dumps([*drain_command, "check"])},
        # training/resilience/health.py: the GPUs the pod asked for (a missing one fails the preflight) and the
        # node to taint when a GPU breaks.
        {"name": POD_GPUS_ENV, "value": str(gpus)},
        {"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    if spec.unhealthy_taint_key:
        env.append({"name": UNHEALTHY_TAINT_ENV, "value": spec.unhealthy_taint_key})
    if spec.metrics_namespace:
        env.append({"name": "RAY_TRAIN_EKS_METRICS_NAMESPACE", "value": spec.metrics_namespace})
    return env


def pod_env(spec: RayWorkloadSpec, *, gpus: int, drain_command: list[str]) -> tuple[list[dict], list[dict]]:
    """The head's environment and each GPU worker's (``gpus`` each, ``drain_command`` its preStop hook)."""
    common = _common_env(spec)
    return _head_env(spec, common), _worker_env(spec, common, gpus=gpus, drain_command=drain_command)

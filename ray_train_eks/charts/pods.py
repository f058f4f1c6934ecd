"""The Ray pods: the head's and the GPU workers' group specs, their sizing (CPU, memory, GPUs,
EFA interfaces, the disk the workers stage checkpoints on), placement and volumes, and the rules
that keep them within their nodes."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from ray_train_eks.charts.access import CLUSTER_LABEL, DASHBOARD_PORT
from ray_train_eks.charts.code import CODE_MOUNT, SETTINGS_CONFIGMAP, code_config_map_name, code_items, code_parts
from ray_train_eks.charts.drain_hook import PRESTOP_CHECK_ENV, drain_hook_command
from ray_train_eks.charts.entrypoint import planned_training
from ray_train_eks.charts.node_marker import NODE_NAME_ENV, POD_GPUS_ENV, UNHEALTHY_TAINT_ENV
from ray_train_eks.charts.spec import REPLACEMENT_TIMEOUT_ENV, RayWorkloadSpec
from ray_train_eks.instances import INSTANCE_TYPES

CACHE_MOUNT = "/cache"
#: Where the GPU workers stage checkpoints before Ray uploads them (training/storage/checkpoint.py): an
#: emptyDir, so on the node's NVMe RAID0 where the type has one (nodeadm's localStorage).
SCRATCH_MOUNT = "/scratch"


def _resources(cpu: int | str, memory_gib: int, extra: Mapping[str, int] | None = None) -> dict:
    """Requests equal to limits (Guaranteed QoS; KubeRay sizes Ray from them)."""
    amounts = {"cpu": str(cpu), "memory": f"{memory_gib}Gi", **{k: str(v) for k, v in (extra or {}).items()}}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _common_volumes(shm_gib: int, code_package: str, code: Mapping[str, str],
                    code_config_map: str | None = None) -> tuple[list[dict], list[dict]]:
    volumes = [
        # Every part of the code (code_parts) in one folder, each file at its path in the package.
        {"name": "training-code", "projected": {"sources": [
            {"configMap": {"name": code_config_map_name(index, code_config_map), "items": code_items(part)}}
            for index, part in enumerate(code_parts(code))]}},
        # Pod-level emptyDir: survives a container restart, so the model is fetched once per pod.
        {"name": "cache", "emptyDir": {}},
        # Ray's object store lives in /dev/shm; size it explicitly (30% of memory, Ray's default share).
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}},
    ]
    mounts = [
        {"name": "training-code", "mountPath": f"{CODE_MOUNT}/{code_package}", "readOnly": True},
        {"name": "cache", "mountPath": CACHE_MOUNT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes, mounts


#: The settings ConfigMap's keys the stack writes where it has them (both optional in the pods): the SNS
#: topic a run's events go to (training/telemetry/notify.py), and the Capacity Blocks the GPU nodes run on
#: alone, comma-separated (training/resilience/deadline.py: the run stops before the earliest's end).
NOTIFY_TOPIC_KEY, CAPACITY_BLOCKS_KEY = "notify_topic_arn", "capacity_block_ids"
#: Or the tags that select those blocks (JSON), where the reservations are selected by tags.
CAPACITY_BLOCK_TAGS_KEY = "capacity_block_tags"


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
                      ("RAY_TRAIN_EKS_CAPACITY_BLOCK_TAGS", CAPACITY_BLOCK_TAGS_KEY)):
        env.append({"name": name, "valueFrom": {"configMapKeyRef": {"name": SETTINGS_CONFIGMAP, "key": key, "optional": True}}})
    return env


def _common_env(spec: RayWorkloadSpec) -> list[dict]:
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


def _head_env(spec: RayWorkloadSpec) -> list[dict]:
    """What the driver (on the head) reads of the platform: how long a node taken out may go unreplaced."""
    if spec.replacement_timeout_s is None:
        return []
    return [{"name": REPLACEMENT_TIMEOUT_ENV, "value": str(spec.replacement_timeout_s)}]


def head_sizing(spec: RayWorkloadSpec) -> tuple[int, int]:
    """CPU and GiB of the head: ``head_resources``, else half the system node (the rest for
    the operator and add-ons)."""
    if spec.head_resources is not None:
        return spec.head_resources
    system = INSTANCE_TYPES[spec.system_instance_type]
    return max(1, system.vcpus // 2), max(2, system.memory_gib // 2)


def worker_sizing(spec: RayWorkloadSpec) -> tuple[int, int]:
    """CPU and GiB of a GPU worker: ``worker_resources``, else the whole node less room for
    kubelet and the DaemonSets (VPC CNI, kube-proxy, device plugins, pod identity agent)."""
    if spec.worker_resources is not None:
        return spec.worker_resources
    gpu = INSTANCE_TYPES[spec.gpu_instance_type]
    return gpu.vcpus - 2, int(gpu.memory_gib * 0.85)


def _placement(node_selector: Mapping[str, str], tolerations) -> dict:
    """The pod's nodeSelector and tolerations, only when there are any."""
    placement: dict[str, Any] = {}
    if node_selector:
        placement["nodeSelector"] = dict(node_selector)
    if tolerations:
        placement["tolerations"] = [dict(t) for t in tolerations]
    return placement


def _pod_metadata(spec: RayWorkloadSpec, cluster: str | None) -> dict:
    """The pod template's metadata: the Ray cluster's label (``cluster``, for the NetworkPolicies)
    and the annotations, each only when there is one."""
    metadata: dict[str, Any] = {}
    if cluster is not None:
        metadata["labels"] = {CLUSTER_LABEL: cluster}
    if spec.pod_annotations:
        metadata["annotations"] = dict(spec.pod_annotations)
    return {"metadata": metadata} if metadata else {}


def head_group_spec(spec: RayWorkloadSpec, cluster: str | None = None) -> dict:
    """The head: where ``head_node_selector`` puts it, no GPUs, the dashboard, ``ray stop`` before it goes."""
    cpu, memory = head_sizing(spec)
    volumes, mounts = _common_volumes(max(1, int(memory * 0.3)), spec.code_package, spec.training_code,
                                      spec.code_config_map)
    return {
        "rayStartParams": {"num-gpus": "0", "num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {
            **_pod_metadata(spec, cluster),
            "spec": {
                "serviceAccountName": spec.service_account,
                **_placement(spec.head_node_selector, spec.head_tolerations),
                "volumes": volumes,
                "containers": [{
                    "name": "ray-head",
                    "image": spec.ray_image,
                    "imagePullPolicy": "IfNotPresent",
                    "ports": [
                        {"name": "gcs-server", "containerPort": 6379},
                        {"name": "dashboard", "containerPort": DASHBOARD_PORT},
                        {"name": "client", "containerPort": 10001},
                    ],
                    "env": [*_common_env(spec), {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}, *_head_env(spec)],
                    "resources": _resources(cpu, memory),
                    "volumeMounts": mounts,
                    "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
                }],
            }
        },
    }


def _worker_env(spec: RayWorkloadSpec) -> list[dict]:
    """The GPU workers' environment: the code's and settings', EFA and NCCL's, the preStop check's,
    training.resilience.health's (node_marker.py) and the metrics'."""
    env = [
        *_common_env(spec),
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
        {"name": PRESTOP_CHECK_ENV, "value": json.dumps([*drain_hook_command(spec), "check"])},
        # training/resilience/health.py: the GPUs the pod asked for (a missing one fails the preflight) and the
        # node to taint when a GPU breaks.
        {"name": POD_GPUS_ENV, "value": str(spec.worker_gpus)},
        {"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    if spec.unhealthy_taint_key:
        env.append({"name": UNHEALTHY_TAINT_ENV, "value": spec.unhealthy_taint_key})
    if spec.metrics_namespace:
        env.append({"name": "RAY_TRAIN_EKS_METRICS_NAMESPACE", "value": spec.metrics_namespace})
    return env


#: The GPU worker container's liveness probe: KubeRay's own check (v1.7.0 common/pod.go
#: ``initLivenessAndReadinessProbe``: GET ``/api/healthz`` on the dashboard agent, port 52365, which
#: fails once the GCS has the node dead or its raylet is gone), with a threshold of 50 s instead of
#: KubeRay's 120 x 5 s. A Ray node drained at a hardware fault or a preemption ends, its raylet
#: exits 0 and ``ray start --block`` goes on running (Ray 2.58 ``scripts/scripts.py`` takes an exit
#: 0 as expected); the pod still counts as a replica, and KubeRay makes a new one only once its
#: container has ended (``raycluster_controller.go`` ``shouldDeletePod``). With KubeRay's probe
#: every GPU of the run waited ten minutes for that; with this one, under a minute. KubeRay
#: injects its probe only where the container has none, so this one stands.
WORKER_LIVENESS_PROBE = {
    "httpGet": {"path": "/api/healthz", "port": 52365},
    "initialDelaySeconds": 30,
    "periodSeconds": 10,
    "timeoutSeconds": 5,
    "successThreshold": 1,
    "failureThreshold": 5,
}


def worker_group_spec(spec: RayWorkloadSpec, cluster: str | None = None) -> dict:
    """GPU workers: one pod per GPU node with all its GPUs and EFA interfaces, where
    ``worker_node_selector`` and ``worker_tolerations`` put them."""
    cpu, memory = worker_sizing(spec)
    volumes, mounts = _common_volumes(max(1, int(memory * 0.3)), spec.code_package, spec.training_code,
                                      spec.code_config_map)
    volumes.append({"name": "scratch", "emptyDir": {}})
    mounts.append({"name": "scratch", "mountPath": SCRATCH_MOUNT})
    env = _worker_env(spec)
    extra = {"nvidia.com/gpu": spec.worker_gpus}
    if spec.worker_efa:
        extra["vpc.amazonaws.com/efa"] = spec.worker_efa
    resources = _resources(cpu, memory, extra)
    disk = worker_disk_gib(spec)
    if disk is not None:
        # A request, no limit: the scheduler keeps room for the staged checkpoints on the node's
        # disk (the NVMe RAID0 nodeadm mounts the kubelet's directory on, where the type has one);
        # a limit would evict the pod, mid-checkpoint, the moment it was passed.
        resources["requests"]["ephemeral-storage"] = f"{disk}Gi"
    return {
        "groupName": "gpu-workers",
        "replicas": spec.gpu_node_count,
        "minReplicas": spec.gpu_node_count,
        "maxReplicas": spec.gpu_node_count,
        "rayStartParams": {},
        "template": {
            **_pod_metadata(spec, cluster),
            "spec": {
                "serviceAccountName": spec.service_account,
                **_placement(spec.worker_node_selector, spec.worker_tolerations),
                # Room for the checkpoint the training writes at the preemption notice.
                "terminationGracePeriodSeconds": spec.worker_termination_grace_seconds,
                # A worker pod whose Ray node ended (drained at a hardware fault or a preemption) is
                # deleted and created anew by KubeRay (raycluster_controller.go shouldDeletePod at
                # v1.7.0), so the scheduler places it again and an unhealthy taint keeps it off the
                # broken node. Unset, Kubernetes' default Always restarts the container in place, on
                # the same node, and Ray Train's retry would land on the broken GPU again.
                "restartPolicy": "Never",
                "volumes": volumes,
                "containers": [{
                    "name": "ray-worker",
                    "image": spec.ray_image,
                    "imagePullPolicy": "IfNotPresent",
                    "env": env,
                    "resources": resources,
                    "volumeMounts": mounts,
                    "lifecycle": {"preStop": {"exec": {"command": drain_hook_command(spec)}}},
                    "livenessProbe": WORKER_LIVENESS_PROBE,
                }],
            }
        },
    }


#: What else a GPU worker keeps on its node's disk besides staged checkpoints: the model's
#: download and the data set in /cache, Ray's logs and spilled objects.
SCRATCH_MARGIN_GIB = 10


def worker_disk_gib(spec: RayWorkloadSpec) -> int | None:
    """The ephemeral storage a GPU worker pod requests (its emptyDirs, /scratch and /cache, are
    on the node's disk): two staged checkpoints of its node's share (one being written while the
    previous one uploads: training/storage/checkpoint.py; fp32 weights and AdamW's two moments, 12 bytes a
    parameter, a node's share of one copy), the model's bf16 weights, and a margin. Under LoRA
    (``--peft lora``) a checkpoint holds the adapters alone, and with ``--merge-lora`` the merged
    model (bf16) is staged there too before its upload. None when synth cannot know the model (a
    custom entrypoint, a model out of the plan's table)."""
    planned = planned_training(spec)
    if planned is None:
        return None
    config, shape = planned
    parameters = trained = shape.parameters
    lora = getattr(config, "peft", "none") == "lora"
    if lora:
        try:
            trained = shape.layers * sum(math.prod(s) for s in shape.adapter_shapes(config.lora_rank, config.lora_target_modules))
        except ValueError:  # targets the model lacks: memory_plan_problem says so
            pass
    checkpoint_share = trained * 12 / max(1, spec.gpu_node_count)
    models = 2 if lora and config.merge_lora else 1
    return math.ceil((2 * checkpoint_share + models * parameters * 2) / 2**30) + SCRATCH_MARGIN_GIB


def worker_disk_problem(spec: RayWorkloadSpec) -> str | None:
    """Why the GPU nodes' instance store cannot hold what a worker keeps on it, or None."""
    needed, gpu = worker_disk_gib(spec), INSTANCE_TYPES.get(spec.gpu_instance_type)
    if needed is None or gpu is None or not gpu.instance_store_gb:
        return None
    if needed * 2**30 > gpu.instance_store_gb * 1e9:
        return (f"trainingArgs={' '.join(spec.training_args)!r}: each GPU worker stages {needed} GiB of checkpoints and "
                f"model on its node's disk, more than {spec.gpu_instance_type}'s {gpu.instance_store_gb} GB of NVMe; use "
                "more nodes (-c gpuNodeCount) or a type with more instance storage")
    return None


def pod_problems(spec: RayWorkloadSpec) -> list[str]:
    """The pods must be sizeable (an instance type of the table, or explicit sizes) and ask no more
    GPUs and EFA interfaces than their node has."""
    problems: list[str] = []
    if spec.gpu_node_count < 1:
        problems.append(f"gpuNodeCount={spec.gpu_node_count}: at least 1 GPU node is needed; e.g. -c gpuNodeCount=2")
    if spec.head_resources is None and spec.system_instance_type not in INSTANCE_TYPES:
        problems.append(
            f"system_instance_type={spec.system_instance_type!r} is not in ray_train_eks.instances.INSTANCE_TYPES, so the Ray "
            "head cannot be sized from it; pass head_resources=(cpu, memory_gib)"
        )
    if spec.gpu_instance_type not in INSTANCE_TYPES and (
        spec.worker_resources is None or spec.gpus_per_worker is None or spec.efa_per_worker is None
    ):
        problems.append(
            f"gpu_instance_type={spec.gpu_instance_type!r} is not in ray_train_eks.instances.INSTANCE_TYPES; pass "
            "worker_resources=(cpu, memory_gib), gpus_per_worker and efa_per_worker"
        )
    gpu = INSTANCE_TYPES.get(spec.gpu_instance_type)
    if gpu is not None:
        if not 1 <= spec.worker_gpus <= gpu.gpus:
            problems.append(f"gpusPerWorker={spec.worker_gpus}: {spec.gpu_instance_type} has {gpu.gpus} GPUs; use 1 to {gpu.gpus}")
        if not 0 <= spec.worker_efa <= gpu.efa_interfaces:
            problems.append(
                f"efaPerWorker={spec.worker_efa}: {spec.gpu_instance_type} has {gpu.efa_interfaces} EFA interfaces; "
                f"use 0 to {gpu.efa_interfaces}"
            )
    return problems

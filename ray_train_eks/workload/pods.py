"""The Ray pods: the head's and the GPU workers' group specs (their resources, placement, volumes,
probes and hooks), built from the resolved job (job.py): the sizes, disks and environments are
its fields, worked out once."""

from __future__ import annotations

import json
from typing import Any, Mapping

from ray_train_eks.workload.access import CLUSTER_LABEL, DASHBOARD_PORT
from ray_train_eks.workload.code import CODE_MOUNT
from ray_train_eks.workload.environment import CACHE_MOUNT, SCRATCH_MOUNT
from ray_train_eks.workload.job import ResolvedJob, resolved
from ray_train_eks.workload.spec import RayWorkloadSpec


def _resources(cpu: int | str, memory_gib: int, extra: Mapping[str, int] | None = None) -> dict:
    """Requests equal to limits (Guaranteed QoS; KubeRay sizes Ray from them)."""
    amounts = {"cpu": str(cpu), "memory": f"{memory_gib}Gi", **{k: str(v) for k, v in (extra or {}).items()}}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _common_volumes(job: ResolvedJob, memory_gib: int) -> tuple[list[dict], list[dict]]:
    """The code, the cache and /dev/shm of a pod with ``memory_gib`` of memory."""
    spec = job.spec
    volumes = [
        json.loads(json.dumps(job.code_volume)),  # the resolved job's, a copy per pod
        # Pod-level emptyDir: survives a container restart, so the model is fetched once per pod.
        {"name": "cache", "emptyDir": {}},
        # Ray's object store lives in /dev/shm; size it explicitly (30% of memory, Ray's default share).
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{max(1, int(memory_gib * 0.3))}Gi"}},
    ]
    mounts = [
        {"name": "training-code", "mountPath": f"{CODE_MOUNT}/{spec.code_package}", "readOnly": True},
        {"name": "cache", "mountPath": CACHE_MOUNT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes, mounts


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


def head_group_spec(job: ResolvedJob | RayWorkloadSpec, cluster: str | None = None) -> dict:
    """The head: where ``head_node_selector`` puts it, no GPUs, the dashboard, ``ray stop`` before it goes."""
    job = resolved(job)
    spec, (cpu, memory) = job.spec, job.head_size
    volumes, mounts = _common_volumes(job, memory)
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
                    "env": job.head_env,
                    "resources": _resources(cpu, memory),
                    "volumeMounts": mounts,
                    "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
                }],
            }
        },
    }


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


def elastic_minimum(job: ResolvedJob) -> int | None:
    """The fewest GPU nodes the job's training goes on with (``--min-nodes``), where it is elastic; None otherwise."""
    training = job.training
    minimum = getattr(training, "min_nodes", None)
    return minimum if minimum is not None and 1 <= minimum < job.spec.gpu_node_count else None


def worker_group_spec(job: ResolvedJob | RayWorkloadSpec, cluster: str | None = None) -> dict:
    """GPU workers: one pod per GPU node with all its GPUs and EFA interfaces, where
    ``worker_node_selector`` and ``worker_tolerations`` put them."""
    job = resolved(job)
    spec, (cpu, memory) = job.spec, job.worker_size
    volumes, mounts = _common_volumes(job, memory)
    volumes.append({"name": "scratch", "emptyDir": {}})
    mounts.append({"name": "scratch", "mountPath": SCRATCH_MOUNT})
    extra = {"nvidia.com/gpu": job.worker_gpus}
    if job.worker_efa:
        extra["vpc.amazonaws.com/efa"] = job.worker_efa
    resources = _resources(cpu, memory, extra)
    if job.worker_disk_gib is not None:
        # A request, no limit: the scheduler keeps room for the staged checkpoints on the node's
        # disk (the NVMe RAID0 nodeadm mounts the kubelet's directory on, where the type has one);
        # a limit would evict the pod, mid-checkpoint, the moment it was passed.
        resources["requests"]["ephemeral-storage"] = f"{job.worker_disk_gib}Gi"
    return {
        "groupName": "gpu-workers",
        # Every node, whatever the training's --min-nodes: KubeRay keeps `replicas` pods (autoscaling off:
        # GetWorkerGroupDesiredReplicas, ray-operator/controllers/ray/utils/util.go at v1.7.0), so a lost node's
        # pod is created again and waits Pending, which is what asks Karpenter or the node group for a node;
        # an elastic run trains on what there is meanwhile and grows back onto it (docs/elastic-runs.md).
        "replicas": spec.gpu_node_count,
        "minReplicas": elastic_minimum(job) or spec.gpu_node_count,
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
                    "env": job.worker_env,
                    "resources": resources,
                    "volumeMounts": mounts,
                    "lifecycle": {"preStop": {"exec": {"command": job.drain_command}}},
                    "livenessProbe": WORKER_LIVENESS_PROBE,
                }],
            }
        },
    }

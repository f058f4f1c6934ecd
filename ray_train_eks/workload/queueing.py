"""Queueing the jobs with Kueue (``-c queueing=kueue``): each RayJob is admitted whole, its head, its
GPU workers and its submitter together, or waits in order; never two jobs each holding part of the
GPU nodes and waiting for the rest.

How it works (Kueue v0.19.2's RayJob integration, KubeRay v1.7.0):

- A RayJob labelled ``kueue.x-k8s.io/queue-name`` is created suspended; Kueue counts its pod sets
  (the head, each worker group's replicas, the K8sJobMode submitter: kueue
  ``pkg/controller/jobs/rayjob/rayjob_controller.go``) against its ClusterQueue's quota and admits
  it by setting ``suspend: false`` when all of it fits. Every resource a pod requests must be
  covered by the ClusterQueue (``BlockUndeclared``, the default), the EFA interfaces and the
  ephemeral storage too.
- The quota is what the platform's nodes hold for one job (:func:`queue_quota`): the head and the
  submitter as the system nodes run them, and the GPU nodes whole, their disk included. Every job
  asks for all the GPU nodes, so one is admitted at a time and the rest wait, oldest first
  (``StrictFIFO``); and every job that fits the nodes fits the quota. A job the quota can never hold
  would head the queue and block every job behind it (Kueue ``pkg/cache/queue/cluster_queue.go``:
  under StrictFIFO an inadmissible head is requeued at once), so ``ray-train-eks submit`` refuses it
  (:func:`queue_fit_problems`).
- KubeRay rejects a suspended RayJob without ``shutdownAfterJobFinishes`` and ``deletionRules``
  with it (``utils/validation.go`` ``ValidateRayJobSpec``: "not allowed to be suspended", "mutually
  exclusive"), and Kueue asks for it too: a queued job ends with its whole cluster deleted
  ``ttlSecondsAfterFinished`` after it finished, not its GPU workers at once (workload.py
  ``end_of_job``). Kueue frees the job's quota as soon as its deployment status is Complete or
  Failed (``rayjob_controller.go`` ``Finished``), so the next job is admitted then: the TTL of a
  queued job is at most :data:`QUEUED_TTL_SECONDS`, so the GPU nodes it held are free within a
  minute of that, not after the platform's ``ttlSecondsAfterFinished`` (its logs are in CloudWatch and
  the bucket).
- A RayCluster of its own (``workload=cluster``) is not queued: Kueue does not manage a RayJob with a
  ``clusterSelector``, and KubeRay does not suspend one.
"""

from __future__ import annotations

import re
from typing import Mapping

from ray_train_eks.workload.spec import PART_OF, RayWorkloadSpec

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"
#: KubeRay v1.7.0's default submitter pod (ray-operator/controllers/ray/common/job.go: requests cpu
#: 500m, memory 200Mi), which Kueue counts as the job's ``submitter`` pod set in K8sJobMode.
SUBMITTER_REQUESTS = {"cpu": "500m", "memory": "200Mi"}
#: The names of the queue objects (the LocalQueue in the Ray namespace, the cluster-wide ones).
LOCAL_QUEUE = "ray-train-eks"
CLUSTER_QUEUE = "ray-train-eks-gpus"
RESOURCE_FLAVOR = "ray-train-eks-nodes"
#: The longest a queued job's finished cluster stays (its GPU workers with it): Kueue has freed its
#: quota and admitted the next job by then, whose pods wait for these nodes.
QUEUED_TTL_SECONDS = 30
#: The share of a GPU node's NVMe a pod may be given, on the safe side of the kubelet's allocatable
#: ephemeral storage: capacity less the kubelet's default hard eviction threshold
#: (``nodefs.available<10%``: kubernetes.io "Node-pressure Eviction"), its reserved storage and the
#: file system's own, so that a quota this sizes never admits a job the scheduler cannot place.
NODE_DISK_ALLOCATABLE_SHARE = 0.85

_QUANTITY = re.compile(r"^([0-9.]+)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (``500m``, ``12Gi``, ``4``) as a number of units."""
    match = _QUANTITY.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity this module reads")
    return float(match.group(1)) * _FACTORS[match.group(2)]


def _shown(resource: str, amount: float) -> str:
    if resource == "cpu":
        return f"{round(amount * 1000)}m"
    if resource in ("memory", "ephemeral-storage"):
        return f"{-(-round(amount) // 2**20)}Mi"
    return str(round(amount))


def _pod_requests(template: Mapping) -> dict[str, float]:
    """One pod's requests as Kueue counts them (``pkg/workload/resources.go``: a limit stands in for a
    missing request; ``resourcehelpers.PodRequests``: the containers' sum, at least each init container)."""
    total: dict[str, float] = {}
    for container in template["spec"]["containers"]:
        resources = container.get("resources") or {}
        for name, value in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            total[name] = total.get(name, 0.0) + quantity(value)
    for container in template["spec"].get("initContainers") or []:
        resources = container.get("resources") or {}
        for name, value in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            total[name] = max(total.get(name, 0.0), quantity(value))
    return total


def pod_sets(job: Mapping) -> list[tuple[str, int, dict[str, float]]]:
    """Kueue v0.19.2's pod sets of RayJob ``job`` (``pkg/controller/jobs/rayjob``): the head, each
    worker group (its replicas times ``numOfHosts``) and, in K8sJobMode, the submitter (KubeRay's
    default, ``SUBMITTER_REQUESTS``, where the job gives no ``submitterPodTemplate``)."""
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    sets = [("head", 1, _pod_requests(cluster["headGroupSpec"]["template"]))]
    sets += [(group["groupName"], (group.get("replicas") or 1) * max(1, group.get("numOfHosts", 1)),
              _pod_requests(group["template"])) for group in cluster["workerGroupSpecs"]]
    if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
        submitter = spec.get("submitterPodTemplate")
        sets.append(("submitter", 1, _pod_requests(submitter) if submitter else
                     {name: quantity(value) for name, value in SUBMITTER_REQUESTS.items()}))
    return sets


def _summed(sets) -> dict[str, float]:
    total: dict[str, float] = {}
    for _, count, requests in sets:
        for name, amount in requests.items():
            total[name] = total.get(name, 0.0) + count * amount
    return total


def job_requests(job: Mapping) -> dict[str, str]:
    """What Kueue counts for RayJob ``job`` (a dict as workload.py ``ray_job`` builds it): its head,
    every worker group's replicas and, in K8sJobMode, KubeRay's default submitter; by resource."""
    return {name: _shown(name, amount) for name, amount in sorted(_summed(pod_sets(job)).items()) if amount}


def node_disk_bytes(instance_type: str) -> float | None:
    """What a GPU node's disk gives its pods (:data:`NODE_DISK_ALLOCATABLE_SHARE` of its NVMe,
    where nodeadm puts the kubelet's directory), or None for a type without instance storage."""
    from ray_train_eks.instances import INSTANCE_TYPES

    gpu = INSTANCE_TYPES.get(instance_type)
    if gpu is None or not gpu.instance_store_gb:
        return None
    return gpu.instance_store_gb * 1e9 * NODE_DISK_ALLOCATABLE_SHARE


def _quota_amounts(spec: RayWorkloadSpec, job: Mapping) -> dict[str, float]:
    sets = pod_sets(job)
    disk = node_disk_bytes(spec.gpu_instance_type)
    if disk is not None:  # the GPU workers may have their nodes' disk whole, whatever the model
        sets = [(name, count, {**requests, "ephemeral-storage": disk} if name == "gpu-workers" else requests)
                for name, count, requests in sets]
    return _summed(sets)


def queue_quota(spec: RayWorkloadSpec, job: Mapping) -> dict[str, str]:
    """The ClusterQueue's quota for the platform of ``spec`` (``job``: its RayJob, for the pods'
    shapes, which every job of the platform shares): the head, the submitter and the GPU workers,
    each GPU worker with its node's disk (:func:`node_disk_bytes`) where the type has instance
    storage; one job's requests where it has none."""
    amounts = _quota_amounts(spec, job)
    return {name: _shown_down(name, amount) for name, amount in sorted(amounts.items()) if amount}


def _shown_down(resource: str, amount: float) -> str:
    """A quota, rounded down (a quota must not promise what the nodes do not have)."""
    if resource in ("memory", "ephemeral-storage"):
        return f"{int(amount // 2**20)}Mi"
    return _shown(resource, amount)


def queue_fit_problems(platform: RayWorkloadSpec, deployed_job: Mapping, job: Mapping) -> list[str]:
    """Why Kueue would never admit ``job`` on the platform whose deployed RayJob is
    ``deployed_job`` (the ClusterQueue's quota, :func:`queue_quota`): each resource it asks for
    more of than the quota holds, or that the quota does not cover (Kueue's ``BlockUndeclared``:
    "resource ... unavailable in ClusterQueue"). Such a job would head the StrictFIFO queue
    forever and block every job behind it."""
    quota = {name: quantity(amount) for name, amount in queue_quota(platform, deployed_job).items()}
    asked = _summed(pod_sets(job))
    problems = []
    for name, amount in sorted(asked.items()):
        if not amount:
            continue
        if name not in quota:
            problems.append(f"the job requests {_shown(name, amount)} of {name}, which the queue's ClusterQueue "
                            f"{CLUSTER_QUEUE} does not cover: Kueue would never admit it; deploy the platform again with "
                            "this ray-train-eks (make deploy)")
        elif amount > quota[name] * (1 + 1e-9):
            fix = ("a smaller model, LoRA (--peft lora), or more GPU nodes (-c gpuNodeCount) so each holds less"
                   if name == "ephemeral-storage" else "deploy the platform with larger nodes or more of them")
            problems.append(f"the job requests {_shown(name, amount)} of {name} in all, more than the "
                            f"{_shown(name, quota[name])} the ClusterQueue {CLUSTER_QUEUE} holds (what the platform's "
                            f"nodes hold): Kueue would never admit it, and it would block every job queued after it; "
                            f"use {fix}")
    return problems


def queue_objects(spec: RayWorkloadSpec, job: Mapping) -> list[dict]:
    """The ResourceFlavor, the ClusterQueue whose quota is what the platform's nodes hold for one
    job (:func:`queue_quota`) for the Ray namespace, and the LocalQueue jobs name."""
    quota = queue_quota(spec, job)
    return [
        {"apiVersion": KUEUE_API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": RESOURCE_FLAVOR, "labels": dict(PART_OF)},
         "spec": {}},
        {"apiVersion": KUEUE_API_VERSION, "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE, "labels": dict(PART_OF)},
         "spec": {
             "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.namespace}},
             # Oldest first: a job that fits never overtakes an older one that waits.
             "queueingStrategy": "StrictFIFO",
             "resourceGroups": [{"coveredResources": list(quota),
                                 "flavors": [{"name": RESOURCE_FLAVOR,
                                              "resources": [{"name": name, "nominalQuota": amount}
                                                            for name, amount in quota.items()]}]}],
         }},
        {"apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
         "metadata": {"name": spec.queue_name or LOCAL_QUEUE, "namespace": spec.namespace, "labels": dict(PART_OF)},
         "spec": {"clusterQueue": CLUSTER_QUEUE}},
    ]


def queueing_problems(spec: RayWorkloadSpec) -> list[str]:
    """A queued workload must be a RayJob with a cluster of its own."""
    if spec.queue_name and spec.workload == "cluster":
        return [f"queue_name={spec.queue_name!r} with workload='cluster': Kueue does not queue a RayJob that runs on a "
                "standing RayCluster (a clusterSelector); use the job workload, or no queue"]
    if spec.queue_name and not spec.shutdown_after_job_finishes:
        return [f"queue_name={spec.queue_name!r} needs shutdownAfterJobFinishes=true: a queued RayJob is created suspended, "
                "which KubeRay and Kueue accept only with it"]
    return []

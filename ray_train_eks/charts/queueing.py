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
- The quota here is one job's requests exactly (:func:`job_requests`): the platform's GPU nodes
  hold one job, so one is admitted at a time, the rest wait, oldest first (``StrictFIFO``).
- KubeRay rejects a suspended RayJob without ``shutdownAfterJobFinishes`` and ``deletionRules``
  with it (``utils/validation.go`` ``ValidateRayJobSpec``: "not allowed to be suspended", "mutually
  exclusive"), and Kueue asks for it too: a queued job ends with its whole cluster deleted
  ``ttlSecondsAfterFinished`` after it finished, not its GPU workers at once (workload.py
  ``end_of_job``). Kueue frees the job's quota when it finishes, so the next job is admitted then.
- A RayCluster of its own (``workload=cluster``) is not queued: Kueue does not manage a RayJob with a
  ``clusterSelector``, and KubeRay does not suspend one.
"""

from __future__ import annotations

import re
from typing import Mapping

from ray_train_eks.charts.spec import PART_OF, RayWorkloadSpec

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"
#: KubeRay v1.7.0's default submitter pod (ray-operator/controllers/ray/common/job.go: requests cpu
#: 500m, memory 200Mi), which Kueue counts as the job's ``submitter`` pod set in K8sJobMode.
SUBMITTER_REQUESTS = {"cpu": "500m", "memory": "200Mi"}
#: The names of the queue objects (the LocalQueue in the Ray namespace, the cluster-wide ones).
LOCAL_QUEUE = "ray-train-eks"
CLUSTER_QUEUE = "ray-train-eks-gpus"
RESOURCE_FLAVOR = "ray-train-eks-nodes"

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


def job_requests(job: Mapping) -> dict[str, str]:
    """What Kueue counts for RayJob ``job`` (a dict as workload.py ``ray_job`` builds it): its head,
    every worker group's replicas and, in K8sJobMode, KubeRay's default submitter; by resource."""
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    pods = [(1, cluster["headGroupSpec"]["template"])]
    pods += [(group.get("replicas", 1) * group.get("numOfHosts", 1), group["template"]) for group in cluster["workerGroupSpecs"]]
    total: dict[str, float] = {}
    for count, template in pods:
        for container in template["spec"]["containers"]:
            resources = container.get("resources") or {}
            requests = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}  # limits fill missing requests
            for name, value in requests.items():
                total[name] = total.get(name, 0.0) + count * quantity(value)
    if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
        for name, value in SUBMITTER_REQUESTS.items():
            total[name] = total.get(name, 0.0) + quantity(value)
    return {name: _shown(name, amount) for name, amount in sorted(total.items()) if amount}


def queue_objects(spec: RayWorkloadSpec, job: Mapping) -> list[dict]:
    """The ResourceFlavor, the ClusterQueue whose quota is ``job``'s requests (one job's: the
    platform's GPU nodes hold one) for the Ray namespace, and the LocalQueue jobs name."""
    quota = job_requests(job)
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

"""A job stopped with ``ray job stop`` frees its GPUs: a watch beside the Ray head of each RayJob
whose cluster ends by deletion rules (stopped_job_watch.py, run by the head image's ``python``),
and what lets it delete that RayJob and nothing else: a Role (get, delete RayJobs in the
namespace) bound to the Ray pods' service account, and a ValidatingAdmissionPolicy under which
that account may delete a RayJob only once it is stopped (``jobStatus: STOPPED``,
``jobDeploymentStatus: Complete``), so no training code can end another running job.

Only where the RayJob's cluster ends by deletion rules (workload.py ``end_of_job``): a job with
``shutdownAfterJobFinishes`` (queued, suspended) is taken down ``ttlSecondsAfterFinished`` after
any end, STOPPED included (KubeRay 1.7.0 ``rayjob_controller.go``, ``handleShutdownAfterJobFinishes``
for every Complete job), and a job that keeps its cluster on purpose keeps it stopped too.
"""

from __future__ import annotations

import json
from pathlib import Path

from ray_train_eks.workload.job import ResolvedJob, resolved
from ray_train_eks.workload.spec import PART_OF, RayWorkloadSpec

#: The watch's source, run as ``python -c``: it needs nothing the image lacks and nothing mounted.
WATCH_SOURCE = (Path(__file__).parent / "stopped_job_watch.py").read_text()
WATCH_CONTAINER = "stopped-job-watch"
#: The watch reads the RayJob this often (one GET of one object).
POLL_SECONDS = 15


def watch_container(spec: RayWorkloadSpec, job_name: str) -> dict:
    """The head pod's second container: the watch of RayJob ``job_name``, on the head's image."""
    return {
        "name": WATCH_CONTAINER,
        "image": spec.ray_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-c", WATCH_SOURCE],
        "env": [{"name": "RAY_TRAIN_EKS_RAYJOB", "value": f"{spec.namespace}/{job_name}"},
                {"name": "RAY_TRAIN_EKS_STOPPED_GRACE_S", "value": str(spec.stopped_job_grace_s)},
                {"name": "RAY_TRAIN_EKS_STOPPED_POLL_S", "value": str(POLL_SECONDS)},
                {"name": "PYTHONUNBUFFERED", "value": "1"}],
        # Python with urllib and ssl: about 30 MiB. Requests equal to limits, as the head's: the pod
        # stays in the Guaranteed QoS class, the last evicted under node pressure.
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "50m", "memory": "64Mi"}},
    }


def stopped_job_objects(job: ResolvedJob | RayWorkloadSpec) -> list[dict]:
    """The Role, its binding, and the admission policy and its binding; none without the watch."""
    job = resolved(job)
    if not job.frees_stopped_jobs:
        return []
    spec = job.spec
    name = f"ray-train-eks-stopped-jobs-{spec.namespace}"
    user = f"system:serviceaccount:{spec.namespace}:{spec.service_account}"
    labels = dict(PART_OF)
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "ray-train-eks-stopped-jobs", "namespace": spec.namespace, "labels": labels},
         "rules": [{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["get", "delete"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "ray-train-eks-stopped-jobs", "namespace": spec.namespace, "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ray-train-eks-stopped-jobs"},
         "subjects": [{"kind": "ServiceAccount", "name": spec.service_account, "namespace": spec.namespace}]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name, "labels": labels},
         "spec": {
             "failurePolicy": "Fail",
             "matchConstraints": {
                 "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.namespace}},
                 "resourceRules": [{"apiGroups": ["ray.io"], "apiVersions": ["*"], "operations": ["DELETE"],
                                    "resources": ["rayjobs"]}]},
             "matchConditions": [{"name": "ray-pods", "expression": f"request.userInfo.username == {json.dumps(user)}"}],
             "validations": [{
                 "expression": "has(oldObject.status) && has(oldObject.status.jobStatus) && "
                               "oldObject.status.jobStatus == 'STOPPED' && has(oldObject.status.jobDeploymentStatus) && "
                               "oldObject.status.jobDeploymentStatus == 'Complete'",
                 "message": "the Ray pods may delete a RayJob only once it was stopped with ray job stop (STOPPED, Complete)"}],
         }},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name, "labels": labels},
         "spec": {"policyName": name, "validationActions": ["Deny"]}},
    ]

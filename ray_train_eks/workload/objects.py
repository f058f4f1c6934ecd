"""The Ray workload as Kubernetes objects: a RayJob that runs the fine-tune (and, in ``cluster``
mode, a standing RayCluster it runs on), each after its NetworkPolicies, composed from the resolved
job (job.py) by the pods (pods.py), the access rules (access.py), the node marker (node_marker.py)
and the stopped-job watch (stopped_jobs.py); the RayJob's name and hash; the RayJob's rules; and
:func:`workload_problems`, every concern's rules at once."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable, Mapping

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.workload.access import CLUSTER_LABEL, access_problems, cluster_policies, network_policies
from ray_train_eks.workload.code import code_problems, files_digest
from ray_train_eks.workload.drain_hook import drain_problems
from ray_train_eks.workload.entrypoint import entrypoint_problems
from ray_train_eks.workload.job import ResolvedJob, resolved
from ray_train_eks.workload.memory_plan import memory_plan_problem
from ray_train_eks.workload.node_marker import node_marker_objects, node_marker_problems
from ray_train_eks.workload.pods import head_group_spec, worker_group_spec
from ray_train_eks.workload.queueing import QUEUE_LABEL, queueing_problems
from ray_train_eks.workload.sizing import disk_problem, pod_problems
from ray_train_eks.workload.spec import PART_OF, RayWorkloadSpec, spec_problems
from ray_train_eks.workload.stopped_jobs import stopped_job_objects, watch_container

RAY_API_VERSION = "ray.io/v1"
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
#: KubeRay's limits: the operator derives longer child names from these.
MAX_RAYJOB_NAME = 47
MAX_RAYCLUSTER_NAME = 53
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


# --------------------------------------------------------------------- rules

def name_problems(spec: RayWorkloadSpec) -> list[str]:
    """The RayCluster's name and the RayJob's prefix must make names KubeRay takes."""
    problems: list[str] = []
    if not _DNS_1035.match(spec.ray_cluster_name) or len(spec.ray_cluster_name) > MAX_RAYCLUSTER_NAME:
        problems.append(
            f"rayClusterName={spec.ray_cluster_name!r}: a RayCluster name must be DNS-1035 (lower-case letters, digits, '-', "
            f"starting with a letter) and at most {MAX_RAYCLUSTER_NAME} characters"
        )
    longest = MAX_RAYJOB_NAME - 9  # "-" and an 8-character spec hash follow the prefix
    if not _DNS_1035.match(spec.ray_job_name_prefix) or len(spec.ray_job_name_prefix) > longest:
        problems.append(
            f"rayJobNamePrefix={spec.ray_job_name_prefix!r}: the RayJob name is '<prefix>-<8-character hash>', DNS-1035 and at "
            f"most {MAX_RAYJOB_NAME} characters, so the prefix must be DNS-1035 and at most {longest} characters"
        )
    return problems


def _cluster_selector_problems(spec: RayWorkloadSpec) -> list[str]:
    """A RayJob on the standing cluster: KubeRay v1.7.0 ValidateRayJobSpec
    (ray-operator/controllers/ray/utils/validation.go). These end as ValidationFailed in the
    RayJob's status, with no retry, while the apply succeeds."""
    if spec.workload != "cluster" or not spec.run_job:
        return []
    problems: list[str] = []
    if spec.backoff_limit > 0:
        problems.append(
            f"backoffLimit={spec.backoff_limit} with workload=cluster: KubeRay rejects backoffLimit > 0 for a RayJob on an "
            "existing cluster (clusterSelector); use backoffLimit=0"
        )
    if spec.submission_mode == "SidecarMode":
        problems.append("submissionMode=SidecarMode with workload=cluster: KubeRay does not support clusterSelector in "
                        "SidecarMode; use K8sJobMode or HTTPMode")
    if spec.suspend:
        problems.append("suspend=true with workload=cluster: KubeRay's clusterSelector mode cannot suspend; use workload=job")
    return problems


def job_problems(spec: RayWorkloadSpec) -> list[str]:
    """The RayJob's settings, as KubeRay would check them."""
    problems: list[str] = []
    if spec.pre_running_deadline_seconds is not None and spec.pre_running_deadline_seconds <= 0:
        problems.append(
            f"preRunningDeadlineSeconds={spec.pre_running_deadline_seconds}: KubeRay takes a positive number of seconds; "
            "use e.g. 1800, or leave it unset for no deadline"
        )
    if spec.submission_mode not in SUBMISSION_MODES:
        problems.append(f"submissionMode={spec.submission_mode!r}: use one of {', '.join(SUBMISSION_MODES)}")
    if spec.ttl_seconds_after_finished and not spec.shutdown_after_job_finishes:
        problems.append(
            f"ttlSecondsAfterFinished={spec.ttl_seconds_after_finished} needs shutdownAfterJobFinishes=true "
            "(KubeRay rejects a TTL without it); set both, or ttlSecondsAfterFinished=0"
        )
    if spec.suspend and not spec.shutdown_after_job_finishes:
        problems.append("suspend=true needs shutdownAfterJobFinishes=true (KubeRay rejects it otherwise)")
    if spec.workload == "cluster" and spec.shutdown_after_job_finishes and spec.run_job:
        problems.append(
            "workload=cluster with shutdownAfterJobFinishes=true: a RayJob on an existing cluster (clusterSelector) "
            "cannot shut that cluster down; set shutdownAfterJobFinishes=false (and ttlSecondsAfterFinished=0)"
        )
    problems.extend(_cluster_selector_problems(spec))
    if spec.submission_mode == "InteractiveMode" and spec.backoff_limit > 0:
        problems.append(f"backoffLimit={spec.backoff_limit} with submissionMode=InteractiveMode: KubeRay rejects retries in "
                        "InteractiveMode; use backoffLimit=0")
    for name, value in (("ttlSecondsAfterFinished", spec.ttl_seconds_after_finished), ("backoffLimit", spec.backoff_limit)):
        if value < 0:
            problems.append(f"{name}={value} must be 0 or more")
    if spec.active_deadline_seconds < 60:
        problems.append(f"activeDeadlineSeconds={spec.active_deadline_seconds}: below a minute the job cannot even start; use e.g. 14400")
    return problems


#: Each concern's rules, in the order their problems are told.
_RULES: tuple[Callable[[RayWorkloadSpec], list[str]], ...] = (
    node_marker_problems, spec_problems, name_problems, job_problems, access_problems, pod_problems, code_problems,
    entrypoint_problems, drain_problems, queueing_problems,
)


def workload_problems(job: ResolvedJob | RayWorkloadSpec) -> list[str]:
    """What the KubeRay operator would reject (late, as ValidationFailed), checked at synth: every
    concern's rules; then, for a spec with none of their problems and a GPU type of the table,
    whether the training fits its GPUs (its memory plan) and its node's disk."""
    spec = job.spec if isinstance(job, ResolvedJob) else job
    problems = [problem for rules in _RULES for problem in rules(spec)]
    if problems or spec.gpu_instance_type not in INSTANCE_TYPES:
        return problems
    job = resolved(job)
    return [problem for problem in (memory_plan_problem(job), disk_problem(spec, job.worker_disk_gib)) if problem]


# --------------------------------------------------------------------- objects

def ray_cluster_spec(job: ResolvedJob | RayWorkloadSpec) -> dict:
    """The RayCluster spec the RayJob and the standing RayCluster share, its pods not yet labelled
    with their cluster (:func:`_labelled`)."""
    job = resolved(job)
    return {
        "rayVersion": job.spec.ray_version,
        "enableInTreeAutoscaling": False,
        # Always explicit: KubeRay v1.7.0 documents "token" as the default but defaults nothing.
        "authOptions": {"mode": job.spec.auth_mode},
        "headGroupSpec": head_group_spec(job),
        "workerGroupSpecs": [worker_group_spec(job)],
    }


def _labelled(cluster_spec: Mapping[str, Any], cluster: str) -> dict:
    """``cluster_spec`` with every pod template labelled ``cluster`` (access.py ``CLUSTER_LABEL``: what
    the NetworkPolicies select), a copy."""
    labelled = json.loads(json.dumps(cluster_spec))
    for group in [labelled["headGroupSpec"], *labelled["workerGroupSpecs"]]:
        template = group["template"]
        metadata = template.get("metadata", {})
        # labels first, then the template's metadata, then its spec: how a reader expects a pod template
        group["template"] = {"metadata": {"labels": {**metadata.get("labels", {}), CLUSTER_LABEL: cluster},
                                          **{k: v for k, v in metadata.items() if k != "labels"}},
                             **{k: v for k, v in template.items() if k != "metadata"}}
    return labelled


def job_name(spec: RayWorkloadSpec, job_spec: Mapping[str, Any]) -> str:
    """The RayJob's name: ``ray_job_name_prefix``, then 8 hex digits of a hash of its spec (before
    its pods are labelled with the name) and of its code."""
    digest = hashlib.sha256(json.dumps([job_spec, files_digest(spec.training_code)], sort_keys=True).encode()).hexdigest()[:8]
    return f"{spec.ray_job_name_prefix}-{digest}"


def ray_job(job: ResolvedJob | RayWorkloadSpec, cluster_spec: Mapping[str, Any] | None = None) -> dict:
    """The fine-tune as a RayJob, named from a hash of its spec and code: a RayJob ignores
    changes to its spec once created, so a changed run must be a new object. ``cluster_spec``: the
    RayCluster spec it brings (:func:`ray_cluster_spec`), when already built."""
    job = resolved(job)
    spec = job.spec
    job_spec: dict[str, Any] = {
        "entrypoint": job.entrypoint,
        "runtimeEnvYAML": job.runtime_env_yaml,
        "submissionMode": spec.submission_mode,
        "activeDeadlineSeconds": spec.active_deadline_seconds,
    }
    if spec.pre_running_deadline_seconds is not None:
        job_spec["preRunningDeadlineSeconds"] = spec.pre_running_deadline_seconds
    if spec.workload == "cluster":
        # No backoffLimit at all: KubeRay rejects any value above 0 with a clusterSelector.
        job_spec["clusterSelector"] = {"ray.io/cluster": spec.ray_cluster_name}
        job_spec["shutdownAfterJobFinishes"] = False
    else:
        job_spec["rayClusterSpec"] = cluster_spec if cluster_spec is not None else ray_cluster_spec(job)
        job_spec["backoffLimit"] = spec.backoff_limit
        job_spec.update(job.end_of_job)
    if spec.suspend or spec.queue_name:  # queued: Kueue admits it (queueing.py)
        job_spec["suspend"] = True
    name = job_name(spec, job_spec)
    if "rayClusterSpec" in job_spec:
        job_spec["rayClusterSpec"] = _labelled(job_spec["rayClusterSpec"], name)
        if job.frees_stopped_jobs:  # beside the head: a job stopped with ray job stop frees its GPUs
            job_spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"].append(watch_container(spec, name))
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": spec.namespace,
                     "labels": {**PART_OF, **({QUEUE_LABEL: spec.queue_name} if spec.queue_name else {})}},
        "spec": job_spec,
    }


def ray_cluster(job: ResolvedJob | RayWorkloadSpec, cluster_spec: Mapping[str, Any] | None = None) -> dict:
    """The standing RayCluster of the ``cluster`` workload (``cluster_spec``: its spec, when already built)."""
    job = resolved(job)
    spec = job.spec
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayCluster",
        "metadata": {"name": spec.ray_cluster_name, "namespace": spec.namespace, "labels": dict(PART_OF)},
        # KubeRay recreates no pod when a RayCluster's spec changes (token auth turned on, a new
        # image) unless told to: with Recreate it deletes them all when the spec's hash differs
        # from the one on its head pod (raycluster_controller.go shouldRecreatePodsForUpgrade;
        # only for a RayCluster of its own, not a RayJob's: utils/validation.go). Pods created
        # before it carry no hash and stay once: delete them (README, "Who can run code").
        "spec": {**_labelled(cluster_spec if cluster_spec is not None else ray_cluster_spec(job), spec.ray_cluster_name),
                 "upgradeStrategy": {"type": "Recreate"}},
    }


def standing_cluster_objects(job: ResolvedJob | RayWorkloadSpec, cluster_spec: Mapping[str, Any] | None = None) -> list[dict]:
    """The standing RayCluster, after its NetworkPolicies (applied first; in the VPC CNI's standard
    mode a new pod still accepts traffic until the agent has applied them to it)."""
    job = resolved(job)
    spec = job.spec
    policies = cluster_policies(spec, spec.ray_cluster_name, submitter_of=None) if spec.network_policies else []
    return [*policies, ray_cluster(job, cluster_spec)]


def job_objects(job: ResolvedJob | RayWorkloadSpec, cluster_spec: Mapping[str, Any] | None = None) -> list[dict]:
    """The RayJob, after the NetworkPolicies of the cluster it brings (none on a standing cluster)."""
    job = resolved(job)
    spec = job.spec
    ray_job_object = ray_job(job, cluster_spec)
    name = ray_job_object["metadata"]["name"]
    policies = cluster_policies(spec, name, submitter_of=name) if spec.network_policies and spec.workload == "job" else []
    return [*policies, ray_job_object]


def ray_objects(job: ResolvedJob | RayWorkloadSpec) -> list[dict]:
    """The Ray objects of the configured workload in apply order (the training-code ConfigMap, built
    with cdk8s-plus, comes before them: charts/ray_workload_chart.py): the node marker's permission
    and policy, the stopped-job watch's, the NetworkPolicies (every pod's ingress denied, then each
    cluster's allows), then the standing RayCluster and the RayJob. The one RayCluster spec (the
    standing cluster's or the job's own) is built once."""
    job = resolved(job)
    spec = job.spec
    permissions = [*node_marker_objects(spec), *stopped_job_objects(job)]
    cluster_spec = ray_cluster_spec(job)
    ray, clusters = [], []
    if spec.workload == "cluster":
        ray.append(ray_cluster(job, cluster_spec))
        clusters.append((spec.ray_cluster_name, None))
    if spec.run_job:
        ray.append(ray_job(job, cluster_spec if spec.workload == "job" else None))
        if spec.workload == "job":
            clusters.append((ray[-1]["metadata"]["name"],) * 2)
    return [*permissions, *network_policies(spec, clusters), *ray]

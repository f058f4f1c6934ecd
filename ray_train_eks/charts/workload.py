"""The Ray workload as Kubernetes objects: a RayJob that runs the fine-tune (and, in ``cluster``
mode, a standing RayCluster it runs on), each after its NetworkPolicies, composed from the pods
(pods.py), the access rules (access.py) and the node marker (node_marker.py); the RayJob's name
and hash; the RayJob's rules; and :func:`workload_problems`, every concern's rules at once."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable, Mapping

from ray_train_eks.charts.access import access_problems, cluster_policies, deny_ingress_policy
from ray_train_eks.charts.code import CODE_MOUNT, code_problems, files_digest
from ray_train_eks.charts.drain_hook import drain_problems
from ray_train_eks.charts.entrypoint import (entrypoint_problems, job_config, memory_plan_problem, training_entrypoint,
                                             training_modules)
from ray_train_eks.charts.node_marker import node_marker_objects, node_marker_problems
from ray_train_eks.charts.queueing import QUEUE_LABEL, QUEUED_TTL_SECONDS, queueing_problems
from ray_train_eks.charts.pods import head_group_spec, pod_problems, worker_disk_problem, worker_group_spec
from ray_train_eks.charts.spec import PART_OF, RayWorkloadSpec, spec_problems
from ray_train_eks.charts.stopped_jobs import frees_stopped_jobs, stopped_job_objects, watch_container
from ray_train_eks.instances import INSTANCE_TYPES

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


def workload_problems(spec: RayWorkloadSpec) -> list[str]:
    """What the KubeRay operator would reject (late, as ValidationFailed), checked at synth: every
    concern's rules; then, for a spec with none of their problems and a GPU type of the table,
    whether the training fits its GPUs (its memory plan) and its node's disk."""
    problems = [problem for rules in _RULES for problem in rules(spec)]
    if problems or spec.gpu_instance_type not in INSTANCE_TYPES:
        return problems
    return [problem for problem in (memory_plan_problem(spec), worker_disk_problem(spec)) if problem]


# --------------------------------------------------------------------- objects

def ray_cluster_spec(spec: RayWorkloadSpec, cluster: str | None = None) -> dict:
    """The RayCluster spec the RayJob and the standing RayCluster share; its pods labelled with
    ``cluster`` (access.py ``CLUSTER_LABEL``)."""
    return {
        "rayVersion": spec.ray_version,
        "enableInTreeAutoscaling": False,
        # Always explicit: KubeRay v1.7.0 documents "token" as the default but defaults nothing.
        "authOptions": {"mode": spec.auth_mode},
        "headGroupSpec": head_group_spec(spec, cluster),
        "workerGroupSpecs": [worker_group_spec(spec, cluster)],
    }


#: Seconds Ray's job supervisor waits after the SIGTERM of ``ray job stop`` before its SIGKILL (Ray's default:
#: 3, ``RAY_JOB_STOP_WAIT_TIME_S``, ray/dashboard/modules/job/job_supervisor.py; the supervisor reads the job's
#: runtime-env variables): a tracked run's driver ends its MLflow run KILLED in that time.
JOB_STOP_WAIT_S = 30


def runtime_env_yaml(spec: RayWorkloadSpec | None = None) -> str:
    """The job's runtime environment. The code is in the image's pods already (ConfigMap
    volume); the runtime env puts it on the path of the driver and of every Ray worker.
    No ``pip`` for an untracked full fine-tune: the image has what training needs (Hub data sets load
    without ``datasets``). A LoRA job (``--peft lora`` in its options) needs PEFT, and a tracked one
    (``spec.tracking``) MLflow's client, which the Ray Train image does not carry: Ray installs the
    pinned packages (training/config.py ``LORA_PACKAGES``, ``TRACKING_PACKAGES``) into the job's
    environment on every node, over the image's packages (Ray's ``pip`` runtime env; its torch and
    transformers already satisfy them, so nothing of the image is replaced). A benchmark (``--eval-tasks``)
    installs lm-evaluation-harness for its own tasks only (training/evaluation/harness.py).
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: PyTorch's allocator grows segments
    instead of caching fixed blocks, so a step's varying shapes fragment less (torchtitan runs
    with it); read once, when a process first uses CUDA, so it is set before any worker starts."""
    text = (f"env_vars:\n  PYTHONPATH: {CODE_MOUNT}\n  TOKENIZERS_PARALLELISM: \"false\"\n"
            "  PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True\n")
    if spec is not None and spec.tracking:  # ray job stop: time for the driver to end its MLflow run KILLED
        text += f"  RAY_JOB_STOP_WAIT_TIME_S: \"{JOB_STOP_WAIT_S}\"\n"
    config = job_config(spec) if spec is not None else None
    packages = []
    if config is not None and config.peft == "lora":
        packages += training_modules()[0].LORA_PACKAGES
    if spec is not None and spec.tracking:
        packages += training_modules()[0].TRACKING_PACKAGES
    if packages:
        text += "pip:\n  packages:\n" + "".join(f"  - {package}\n" for package in packages)
        text += "  pip_check: false\n"
    return text


def job_name(spec: RayWorkloadSpec, job_spec: Mapping[str, Any]) -> str:
    """The RayJob's name: ``ray_job_name_prefix``, then 8 hex digits of a hash of its spec (before
    its pods are labelled with the name) and of its code."""
    digest = hashlib.sha256(json.dumps([job_spec, files_digest(spec.training_code)], sort_keys=True).encode()).hexdigest()[:8]
    return f"{spec.ray_job_name_prefix}-{digest}"


#: The job's end states KubeRay 1.7.0's deletion rules can name: its job statuses (the CRD's enum:
#: SUCCEEDED, FAILED) and its deployment status Failed (a deadline passed, the submitter's retries
#: spent). A job stopped by hand (``ray job stop``: STOPPED) matches none; delete its RayJob.
END_STATES = ({"jobStatus": "SUCCEEDED"}, {"jobStatus": "FAILED"}, {"jobDeploymentStatus": "Failed"})


def end_of_job(spec: RayWorkloadSpec) -> dict:
    """What KubeRay deletes when the job ends, and when.

    With ``shutdown_after_job_finishes``: the GPU workers at once and the head, for its logs,
    ``ttl_seconds_after_finished`` later, through KubeRay 1.7.0's ``deletionStrategy.deletionRules``
    (feature gate ``RayJobDeletionPolicy``, beta and on by default: ``pkg/features/features.go``).
    ``DeleteWorkers`` sets ``suspend`` on every worker group (``rayjob_controller.go``
    ``suspendWorkerGroups``), so the GPU nodes empty and Karpenter or the bill stops; the plain
    ``shutdownAfterJobFinishes`` would keep the workers for the whole TTL. KubeRay rejects rules
    together with ``shutdownAfterJobFinishes`` or a TTL, and ``DeleteWorkers`` with in-tree
    autoscaling, which this chart never enables (``utils/validation.go`` ``ValidateRayJobSpec``,
    ``validateDeletionRules``). A job created suspended (queued by Kueue) must keep
    ``shutdownAfterJobFinishes`` (the same file), so it keeps today's TTL for the whole cluster.
    """
    if not spec.shutdown_after_job_finishes:
        return {"shutdownAfterJobFinishes": False}
    if spec.queue_name:  # Kueue admits the next job when this one ends: its nodes must be free soon after
        return {"shutdownAfterJobFinishes": True,
                "ttlSecondsAfterFinished": min(spec.ttl_seconds_after_finished, QUEUED_TTL_SECONDS)}
    if spec.suspend:
        return {"shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished}
    rules = []
    for state in END_STATES:
        rules.append({"condition": {**state, "ttlSeconds": 0}, "policy": "DeleteWorkers"})
        rules.append({"condition": {**state, "ttlSeconds": spec.ttl_seconds_after_finished}, "policy": "DeleteCluster"})
    return {"shutdownAfterJobFinishes": False, "deletionStrategy": {"deletionRules": rules}}


def ray_job(spec: RayWorkloadSpec) -> dict:
    """The fine-tune as a RayJob, named from a hash of its spec and code: a RayJob ignores
    changes to its spec once created, so a changed run must be a new object."""
    job_spec: dict[str, Any] = {
        "entrypoint": training_entrypoint(spec),
        "runtimeEnvYAML": runtime_env_yaml(spec),
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
        job_spec["rayClusterSpec"] = ray_cluster_spec(spec)  # labelled with the job's name below
        job_spec["backoffLimit"] = spec.backoff_limit
        job_spec.update(end_of_job(spec))
    if spec.suspend or spec.queue_name:  # queued: Kueue admits it (queueing.py)
        job_spec["suspend"] = True
    name = job_name(spec, job_spec)
    if "rayClusterSpec" in job_spec:
        job_spec["rayClusterSpec"] = ray_cluster_spec(spec, cluster=name)
        if frees_stopped_jobs(spec):  # beside the head: a job stopped with ray job stop frees its GPUs
            job_spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"].append(watch_container(spec, name))
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": spec.namespace,
                     "labels": {**PART_OF, **({QUEUE_LABEL: spec.queue_name} if spec.queue_name else {})}},
        "spec": job_spec,
    }


def ray_cluster(spec: RayWorkloadSpec) -> dict:
    """The standing RayCluster of the ``cluster`` workload."""
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayCluster",
        "metadata": {"name": spec.ray_cluster_name, "namespace": spec.namespace, "labels": dict(PART_OF)},
        # KubeRay recreates no pod when a RayCluster's spec changes (token auth turned on, a new
        # image) unless told to: with Recreate it deletes them all when the spec's hash differs
        # from the one on its head pod (raycluster_controller.go shouldRecreatePodsForUpgrade;
        # only for a RayCluster of its own, not a RayJob's: utils/validation.go). Pods created
        # before it carry no hash and stay once: delete them (README, "Who can run code").
        "spec": {**ray_cluster_spec(spec, cluster=spec.ray_cluster_name), "upgradeStrategy": {"type": "Recreate"}},
    }


def standing_cluster_objects(spec: RayWorkloadSpec) -> list[dict]:
    """The standing RayCluster, after its NetworkPolicies (applied first; in the VPC CNI's standard
    mode a new pod still accepts traffic until the agent has applied them to it)."""
    policies = cluster_policies(spec, spec.ray_cluster_name, submitter_of=None) if spec.network_policies else []
    return [*policies, ray_cluster(spec)]


def job_objects(spec: RayWorkloadSpec) -> list[dict]:
    """The RayJob, after the NetworkPolicies of the cluster it brings (none on a standing cluster)."""
    job = ray_job(spec)
    name = job["metadata"]["name"]
    policies = cluster_policies(spec, name, submitter_of=name) if spec.network_policies and spec.workload == "job" else []
    return [*policies, job]


def ray_objects(spec: RayWorkloadSpec) -> list[dict]:
    """The Ray objects of the configured workload with their NetworkPolicies, in apply order (the
    training-code ConfigMap, built with cdk8s-plus, comes before them: ray_workload_chart.py), after
    the node marker's permission and policy."""
    objects = [*node_marker_objects(spec), *stopped_job_objects(spec),
               *([deny_ingress_policy(spec)] if spec.network_policies else [])]
    if spec.workload == "cluster":
        objects.extend(standing_cluster_objects(spec))
    if spec.run_job:
        objects.extend(job_objects(spec))
    return objects

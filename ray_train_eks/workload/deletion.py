"""What KubeRay deletes when a job ends, and when (the RayJob's ``deletionStrategy`` or
``shutdownAfterJobFinishes`` and TTL), and whether a job stopped with ``ray job stop`` needs the
watch beside its head to free its GPUs (stopped_jobs.py). Decided once per job (job.py)."""

from __future__ import annotations

from ray_train_eks.workload.queueing import QUEUED_TTL_SECONDS
from ray_train_eks.workload.spec import RayWorkloadSpec

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


def frees_stopped_jobs(spec: RayWorkloadSpec, ending: dict) -> bool:
    """Whether a watch beside the head deletes the job once it is stopped with ``ray job stop``
    (stopped_jobs.py): a job workload whose cluster ends by deletion rules (``ending``:
    :func:`end_of_job`), with a grace set. KubeRay 1.7.0's deletion rules cannot name STOPPED."""
    return spec.stopped_job_grace_s is not None and spec.workload == "job" and "deletionStrategy" in ending

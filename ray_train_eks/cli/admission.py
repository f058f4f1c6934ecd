"""When a submitted job may start: every job asks for all the platform's GPU nodes, so two at once
would each hold part and wait for the rest forever.

- **Without Kueue**: the API server arbitrates. A submit takes the namespace's Lease
  :data:`GPU_LEASE` (``coordination.k8s.io/v1``) for its RayJob before creating anything: a create
  of the Lease, or a replace carrying the ``resourceVersion`` it read, so of two submits at the same
  moment exactly one succeeds and the other reads the winner as the holder (HTTP 409). The Lease is
  held while its holder's RayJob is active, or, before that RayJob exists, for
  :data:`LEASE_SECONDS` after it was taken. Other active RayJobs of the namespace (the deployed job,
  one created with kubectl) are checked too.
- **With Kueue** (``-c queueing=kueue``): the queue must be there (Kueue's API and the LocalQueue),
  the job must fit the ClusterQueue's quota (workload/queueing.py ``queue_fit_problems``), and a queued
  job's reason is its Workload's ``QuotaReserved`` condition, its place the order Kueue's StrictFIFO
  keeps (priority, then creation time: ``pkg/cache/queue/cluster_queue.go``).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from ray_train_eks.cli.kube import Cluster, KubeError

#: The Lease a submit takes for its RayJob, in the Ray namespace.
GPU_LEASE = "ray-train-eks-gpus"
#: How long a taken Lease holds before its holder's RayJob exists (a submit that died half-way frees it).
LEASE_SECONDS = 120
#: On the Lease once its holder's RayJob exists: the RayJob's uid (a holder gone after that is ended).
CREATED_ANNOTATION = "ray-train-eks/rayjob-uid"
RUN_LABEL = "ray-train-eks/run"
#: KubeRay v1.7.0's end states (apis/ray/v1/rayjob_types.go): the job's (``IsJobTerminal``) and the
#: deployment's. ``ValidationFailed`` is not terminal to KubeRay (it waits for a spec that passes,
#: which a RayJob never gets), but such a job runs nothing and holds nothing: ended, for us.
ENDED = {"SUCCEEDED", "FAILED", "STOPPED"}
ENDED_DEPLOYMENTS = {"Complete", "Failed", "ValidationFailed"}
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


class NotAdmitted(RuntimeError):
    """The job cannot start now, said with why and what to do."""


def ended(job: dict) -> bool:
    """The RayJob ran to an end, or is being deleted."""
    status = job.get("status") or {}
    return (status.get("jobStatus") in ENDED or status.get("jobDeploymentStatus") in ENDED_DEPLOYMENTS
            or bool(job["metadata"].get("deletionTimestamp")))


def state_of(job: dict) -> str:
    """Queued, being deleted, running, or how it ended, from KubeRay's status."""
    status = job.get("status") or {}
    if job["metadata"].get("deletionTimestamp"):
        return "stopping"
    if status.get("jobDeploymentStatus") == "ValidationFailed":
        return "validationfailed"
    if job.get("spec", {}).get("suspend") and status.get("jobDeploymentStatus") not in ENDED_DEPLOYMENTS:
        return "queued"
    return (status.get("jobStatus") or status.get("jobDeploymentStatus") or "created").lower()


def rayjobs(cluster: Cluster, namespace: str, selector: str | None = None) -> list[dict]:
    kwargs = {"label_selector": selector} if selector else {}
    listed = cluster.request("CustomObjectsApi", "list_namespaced_custom_object", "ray.io", "v1", namespace, "rayjobs", **kwargs)
    return sorted(listed.get("items") or [], key=lambda job: job["metadata"].get("creationTimestamp", ""))


def _described(job: dict) -> str:
    run = (job["metadata"].get("labels") or {}).get(RUN_LABEL)
    return f"{job['metadata']['name']} ({state_of(job)}" + (f", run {run})" if run else ")")


def _micro_time(seconds: float | None = None) -> str:
    return datetime.fromtimestamp(seconds or time.time(), timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _seconds(micro_time: str | None) -> float:
    if not micro_time:
        return 0.0
    return datetime.strptime(micro_time.replace("Z", "").split(".")[0], "%Y-%m-%dT%H:%M:%S").replace(
        tzinfo=timezone.utc).timestamp()


def take_gpus(cluster: Cluster, namespace: str, job_name: str, gpu_nodes: int, *, attempts: int = 5) -> None:
    """Hold the GPU nodes for ``job_name`` (its RayJob is created next), or NotAdmitted naming what
    holds them. Safe to repeat for the same job (a retried submit)."""
    busy = [job for job in rayjobs(cluster, namespace) if not ended(job) and job["metadata"]["name"] != job_name]
    if busy:
        raise NotAdmitted(_taken(", ".join(_described(job) for job in busy), gpu_nodes, namespace))
    for _ in range(attempts):
        try:
            lease = cluster.request("CoordinationV1Api", "read_namespaced_lease", GPU_LEASE, namespace)
        except KubeError as error:
            if error.code != 404:
                raise
            lease = None
        holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
        if lease is not None and holder and holder != job_name and _held(cluster, namespace, lease):
            raise NotAdmitted(_taken(f"{holder} (submitted {lease['spec'].get('acquireTime', '?')})", gpu_nodes, namespace))
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": GPU_LEASE, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "ray-train-eks"},
                             "annotations": {},
                             **({"resourceVersion": lease["metadata"]["resourceVersion"]} if lease else {})},
                "spec": {"holderIdentity": job_name, "leaseDurationSeconds": LEASE_SECONDS,
                         "acquireTime": _micro_time(), "renewTime": _micro_time()}}
        try:
            if lease is None:
                cluster.request("CoordinationV1Api", "create_namespaced_lease", namespace, body)
            else:
                cluster.request("CoordinationV1Api", "replace_namespaced_lease", GPU_LEASE, namespace, body)
            return
        except KubeError as error:
            if error.code != 409:  # another submit took it first: read who
                raise
    raise NotAdmitted(f"the GPU nodes' Lease {namespace}/{GPU_LEASE} kept changing under {attempts} tries; try again")


def gpus_taken_by(cluster: Cluster, namespace: str, job: dict) -> None:
    """Mark the Lease: its holder's RayJob exists now (when it is gone, the Lease is free at once)."""
    try:
        lease = cluster.request("CoordinationV1Api", "read_namespaced_lease", GPU_LEASE, namespace)
        if (lease.get("spec") or {}).get("holderIdentity") != job["metadata"]["name"]:
            return
        lease["metadata"].setdefault("annotations", {})[CREATED_ANNOTATION] = job["metadata"]["uid"]
        cluster.request("CoordinationV1Api", "replace_namespaced_lease", GPU_LEASE, namespace, lease)
    except KubeError as error:  # the Lease then holds LEASE_SECONDS after it was taken, no more
        if error.code not in (404, 409):
            raise


def _held(cluster: Cluster, namespace: str, lease: dict) -> bool:
    """The Lease's holder is an active RayJob, or one being submitted (taken less than its duration ago)."""
    holder = lease["spec"]["holderIdentity"]
    try:
        job = cluster.request("CustomObjectsApi", "get_namespaced_custom_object", "ray.io", "v1", namespace, "rayjobs", holder)
    except KubeError as error:
        if error.code != 404:
            raise
        if (lease["metadata"].get("annotations") or {}).get(CREATED_ANNOTATION):
            return False  # created, and gone since: stopped
        taken = _seconds(lease["spec"].get("renewTime") or lease["spec"].get("acquireTime"))
        return time.time() - taken < (lease["spec"].get("leaseDurationSeconds") or LEASE_SECONDS)
    return not ended(job)


def _taken(what: str, gpu_nodes: int, namespace: str) -> str:
    return (f"the GPU nodes are taken: {what} asks for all {gpu_nodes} of them, as this job would; two at once would each "
            f"hold part and wait forever. Stop it (ray-train-eks stop NAME, or kubectl -n {namespace} delete rayjob NAME), "
            "wait for it to end, or deploy with -c queueing=kueue to queue the jobs")


# --------------------------------------------------------------------- Kueue


def check_queue(cluster: Cluster, namespace: str, queue: str) -> None:
    """Kueue's API and the LocalQueue ``queue`` are there (a queued job waits for them forever otherwise)."""
    try:
        cluster.request("CustomObjectsApi", "get_namespaced_custom_object", KUEUE_GROUP, KUEUE_VERSION, namespace,
                        "localqueues", queue)
    except KubeError as error:
        if error.code == 403:
            return  # not ours to read: the queue is the platform's, and the job is labelled for it
        if error.code != 404:
            raise
        missing_api = "could not find the requested resource" in str(error) or "page not found" in str(error).lower()
        if missing_api:
            raise NotAdmitted(f"the platform queues jobs with Kueue (-c queueing=kueue) but the cluster serves no "
                              f"{KUEUE_GROUP}/{KUEUE_VERSION} API: Kueue is not installed or not running; a queued job "
                              "would wait forever. Deploy the stack again (make deploy), or check kubectl -n kueue-system "
                              "get pods") from None
        raise NotAdmitted(f"the platform queues jobs in LocalQueue {namespace}/{queue}, which does not exist; a job labelled "
                          "for it would wait forever. Deploy the stack again (make deploy) to create it") from None


def queue_reasons(cluster: Cluster, namespace: str, jobs: list[dict]) -> dict[str, str]:
    """For each queued RayJob (by name): its place in the queue and why Kueue has not admitted it
    (its Workload's ``QuotaReserved`` condition), or that no Workload exists for it yet."""
    queued = [job for job in jobs if state_of(job) == "queued"]
    if not queued:
        return {}
    try:
        listed = cluster.request("CustomObjectsApi", "list_namespaced_custom_object", KUEUE_GROUP, KUEUE_VERSION, namespace,
                                 "workloads")
    except KubeError as error:
        return {job["metadata"]["name"]: f"Kueue's workloads cannot be read ({error})" for job in queued}
    workloads = {(w["metadata"].get("labels") or {}).get(JOB_UID_LABEL): w for w in listed.get("items") or []}
    pending = sorted((w for w in workloads.values() if not _condition(w, "QuotaReserved", "True")),
                     key=lambda w: (-((w.get("spec") or {}).get("priority") or 0), w["metadata"].get("creationTimestamp", "")))
    place = {w["metadata"]["uid"]: index + 1 for index, w in enumerate(pending)}
    reasons = {}
    for job in queued:
        workload = workloads.get(job["metadata"].get("uid"))
        if workload is None:
            reasons[job["metadata"]["name"]] = ("no Kueue Workload yet: Kueue has not seen the job (is its controller "
                                                "running? kubectl -n kueue-system get pods)")
            continue
        condition = next((c for c in (workload.get("status") or {}).get("conditions") or [] if c["type"] == "QuotaReserved"), None)
        why = f"{condition.get('reason', '')}: {condition.get('message', '')}".strip(": ") if condition else "waiting for Kueue"
        position = place.get(workload["metadata"]["uid"])
        reasons[job["metadata"]["name"]] = (f"{position} of {len(pending)} in the queue; " if position else "") + why
    return reasons


def _condition(obj: dict, kind: str, value: str) -> bool:
    return any(c["type"] == kind and c.get("status") == value for c in (obj.get("status") or {}).get("conditions") or [])

"""A run's training output, as KubeRay's submitter pod prints it (``ray job logs --follow`` in a
Kubernetes Job of the RayJob's name, K8sJobMode: KubeRay v1.7.0 ``common/job.go``), through the
pod's log: waiting while the pod starts (the kubelet answers 400 "waiting to start" until its
container runs), and following the Job's next pod when it retries (its ``backoffLimit``, 2)."""

from __future__ import annotations

import sys
import time

from ray_train_eks.cli.admission import ended
from ray_train_eks.cli.kube import Cluster, KubeError

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
#: How long ``logs -f`` waits for a submitter pod to start, in all.
START_WAIT_S = 1800


def _pods(cluster: Cluster, namespace: str, job: dict) -> tuple[list[dict], str | None]:
    """The submitter pods of RayJob ``job``, oldest first, and the list's version (to watch from). A
    pod created before the RayJob is a previous job's of the same name, which the garbage collector
    has not taken yet: not this one's."""
    listed = cluster.request("CoreV1Api", "list_namespaced_pod", namespace,
                             label_selector=f"{JOB_NAME_LABEL}={job['metadata']['name']}")
    since = job["metadata"].get("creationTimestamp", "")
    pods = [p for p in listed.get("items") or [] if p["metadata"].get("creationTimestamp", "") >= since]
    return sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp", "")), (listed.get("metadata") or {}).get(
        "resourceVersion")


def _waiting(pod: dict) -> str | None:
    """Why the pod's container has not started (its waiting reason, or its phase), or None once it runs."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        if "waiting" in state:
            return state["waiting"].get("reason") or "waiting"
        if "running" in state or "terminated" in state:
            return None
    return status.get("phase") or "Pending"


def _job_gone_or_ended(cluster: Cluster, namespace: str, rayjob: str) -> bool:
    try:
        job = cluster.request("CustomObjectsApi", "get_namespaced_custom_object", "ray.io", "v1", namespace, "rayjobs", rayjob)
    except KubeError as error:
        if error.code == 404:
            return True
        raise
    return ended(job)


def _wait_for_pod(cluster: Cluster, namespace: str, job: dict, after: set[str], deadline: float) -> dict | None:
    """The newest submitter pod not in ``after`` whose container has started, saying what it waits for."""
    said, rayjob = None, job["metadata"]["name"]
    while time.monotonic() < deadline:
        pods, version = _pods(cluster, namespace, job)
        fresh = [p for p in pods if p["metadata"]["name"] not in after]
        if fresh and _waiting(fresh[-1]) is None:
            return fresh[-1]
        why = (f"its submitter pod {fresh[-1]['metadata']['name']} is starting ({_waiting(fresh[-1])})" if fresh
               else "its submitter pod is not created yet (KubeRay creates it once the Ray head is ready)")
        if why != said:
            print(f"ray-train-eks logs: waiting: {why}", file=sys.stderr, flush=True)
            said = why
        if _job_gone_or_ended(cluster, namespace, rayjob) and not fresh:
            return None
        # From the list's version: the next change, not the pods already seen, ends the wait.
        started = time.monotonic()
        for _ in cluster.watch("CoreV1Api", "list_namespaced_pod", namespace, label_selector=f"{JOB_NAME_LABEL}={rayjob}",
                               resource_version=version, timeout_s=min(30.0, max(1.0, deadline - time.monotonic()))):
            break  # something changed: look again
        time.sleep(max(0.0, 0.5 - (time.monotonic() - started)))  # never a tight loop of requests
    return None


def follow_submitter(cluster: Cluster, namespace: str, job: dict, *, follow: bool, tail: int | None, previous: bool) -> int:
    """Print the log of ``job``'s submitter pod; with ``follow``, as it comes, across its retries."""
    rayjob = job["metadata"]["name"]
    if not follow:
        pods, _ = _pods(cluster, namespace, job)
        if not pods:
            raise KubeError(f"run's RayJob {rayjob}: its submitter pod has not started yet; ray-train-eks logs -f waits for it")
        pod = pods[-1]
        if not previous and _waiting(pod) is not None:
            raise KubeError(f"RayJob {rayjob}: its submitter pod {pod['metadata']['name']} is starting ({_waiting(pod)}); "
                            "ray-train-eks logs -f waits for it")
        for chunk in cluster.log_stream(pod["metadata"]["name"], namespace, follow=False, tail=tail, previous=previous):
            sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()
        return 0
    deadline, seen = time.monotonic() + START_WAIT_S, set()
    while True:
        pod = _wait_for_pod(cluster, namespace, job, seen, deadline)
        if pod is None:
            print(f"ray-train-eks logs: RayJob {rayjob} has ended or gone without a new submitter pod", file=sys.stderr)
            return 0
        name = pod["metadata"]["name"]
        if seen:
            print(f"ray-train-eks logs: the submitter was retried: following its new pod {name}", file=sys.stderr, flush=True)
        seen.add(name)
        _follow_pod(cluster, namespace, name, tail)
        tail = None  # a retried pod's log is new: all of it
        if _job_gone_or_ended(cluster, namespace, rayjob):
            later = [p for p in _pods(cluster, namespace, job)[0] if p["metadata"]["name"] not in seen]
            if not later:
                return 0


def _follow_pod(cluster: Cluster, namespace: str, pod: str, tail: int | None) -> None:
    """Print the pod's log as it comes until its container ends; a dropped connection (an API server
    replaced, a proxy's idle timeout) is reattached from the lines written since."""
    while True:
        try:
            for chunk in cluster.log_stream(pod, namespace, follow=True, tail=tail, previous=False):
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            return
        except KubeError as error:
            if not error.dropped:
                raise
            print(f"ray-train-eks logs: {error}; reattaching (lines written meanwhile may be missing)", file=sys.stderr,
                  flush=True)
            tail = 0

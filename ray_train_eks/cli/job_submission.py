"""Sending a job's objects so that sending them again always works: the same command twice, after a
``stop``, after a submit that failed half-way, or a run resubmitted after it failed.

- The NetworkPolicies go first (the job's pods never run without them), then the RayJob; then each
  policy is given the RayJob as its owner, so the API server's garbage collector deletes it with
  the job (``ownerReferences`` by uid; ``blockOwnerDeletion`` is left out: it needs the ``update``
  of ``rayjobs/finalizers``, a permission a trainer has no use for).
- A create of one of the run's own objects that exists already is taken as done: a policy is
  replaced with ours (its owner is this job now), a RayJob of the same name (the same spec and
  code) that is still active is this job, submitted before.
- A RayJob of the same name that ended, or that is being deleted (KubeRay's finalizer
  ``ray.io/rayjob-finalizer`` keeps a deleted RayJob until it has stopped the Ray job), is waited
  for until it is gone, and the job is created anew.
"""

from __future__ import annotations

import sys
import time

from ray_train_eks.cli.admission import RUN_LABEL, ended
from ray_train_eks.cli.kube import Cluster, KubeError

#: How long a submit waits for a deleted RayJob of the same name to go.
DELETED_WAIT_S = 180
_CREATE = {"RayJob": ("CustomObjectsApi", "create_namespaced_custom_object", ("ray.io", "v1")),
           "NetworkPolicy": ("NetworkingV1Api", "create_namespaced_network_policy", ()),
           "ConfigMap": ("CoreV1Api", "create_namespaced_config_map", ())}


class SubmitError(RuntimeError):
    """A job's objects cannot be sent, said with what to do."""


def _create(cluster: Cluster, obj: dict) -> dict:
    api, method, group = _CREATE[obj["kind"]]
    namespace = obj["metadata"]["namespace"]
    if obj["kind"] == "RayJob":
        return cluster.request(api, method, *group, namespace, "rayjobs", obj)
    return cluster.request(api, method, namespace, obj)


def _get_rayjob(cluster: Cluster, namespace: str, name: str) -> dict | None:
    return cluster.ray_object(namespace, "rayjobs", name)


def create_shared(cluster: Cluster, obj: dict) -> None:
    """An object named by its content (the code ConfigMaps, named by the code's hash): one that
    exists already is the same."""
    try:
        _create(cluster, obj)
    except KubeError as error:
        if error.code != 409:
            raise


def _wait_gone(cluster: Cluster, namespace: str, name: str) -> None:
    print(f"waiting for RayJob {namespace}/{name} (the same job, ended or stopped) to be deleted before it is created "
          "again (KubeRay stops its Ray job first)", file=sys.stderr)
    deadline = time.monotonic() + DELETED_WAIT_S
    while (left := deadline - time.monotonic()) > 0:
        job = _get_rayjob(cluster, namespace, name)
        if job is None:
            return
        # From the version just read, so a deletion between the read and the watch is not missed.
        for kind, _ in cluster.watch("CustomObjectsApi", "list_namespaced_custom_object", "ray.io", "v1", namespace,
                                     "rayjobs", field_selector=f"metadata.name={name}",
                                     resource_version=job["metadata"]["resourceVersion"], timeout_s=min(10.0, left)):
            if kind == "DELETED":
                return
    raise SubmitError(f"RayJob {namespace}/{name} is still there {DELETED_WAIT_S} s after its deletion (is the KubeRay "
                      f"operator running? kubectl -n {namespace} get rayjob {name} -o yaml shows its finalizers); "
                      "submit again once it is gone")


def send_policy(cluster: Cluster, policy: dict, owner: dict | None, *, attempts: int = 5) -> None:
    """Create the policy (owned by ``owner`` when given), or replace the run's own one of that name.
    A stopped job's policy of the same name may be going (the garbage collector deletes it once its
    RayJob is gone): a create that meets it, then a read that does not, tries again."""
    namespace, name = policy["metadata"]["namespace"], policy["metadata"]["name"]
    body = {**policy, "metadata": {**policy["metadata"]}}
    if owner is not None:
        body["metadata"]["ownerReferences"] = [{"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                                                "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}]
    for _ in range(attempts):
        try:
            _create(cluster, body)
            return
        except KubeError as error:
            if error.code != 409:
                raise
        try:
            existing = cluster.request("NetworkingV1Api", "read_namespaced_network_policy", name, namespace)
        except KubeError as error:
            if error.code == 404:
                continue  # collected meanwhile: create it
            raise
        run = (policy["metadata"].get("labels") or {}).get(RUN_LABEL)
        if (existing["metadata"].get("labels") or {}).get(RUN_LABEL) != run:
            raise SubmitError(f"NetworkPolicy {namespace}/{name} exists and belongs to another run; choose another --name")
        replaced = {**body, "metadata": {**body["metadata"], "resourceVersion": existing["metadata"]["resourceVersion"]}}
        try:
            cluster.request("NetworkingV1Api", "replace_namespaced_network_policy", name, namespace, replaced)
            return
        except KubeError as error:
            if error.code not in (404, 409):  # collected or changed meanwhile: again
                raise
    raise SubmitError(f"NetworkPolicy {namespace}/{name} kept changing under {attempts} tries (a stopped job's being "
                      "deleted?); submit again")


def send_job(cluster: Cluster, objects: list[dict]) -> tuple[dict, bool]:
    """Send the job's NetworkPolicies and RayJob (the last of ``objects``): the RayJob as the API
    server has it, and whether it was there already (this job, submitted before)."""
    *policies, job = objects
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    existing = _get_rayjob(cluster, namespace, name)
    if existing is not None and ended(existing):
        if not existing["metadata"].get("deletionTimestamp"):
            cluster.request("CustomObjectsApi", "delete_namespaced_custom_object", "ray.io", "v1", namespace, "rayjobs", name,
                            body={"propagationPolicy": "Background"})
        _wait_gone(cluster, namespace, name)
        existing = None
    owned = there = existing is not None
    for policy in policies:
        send_policy(cluster, policy, existing)
    if existing is None:
        try:
            existing = _create(cluster, job)
        except KubeError as error:
            if error.code != 409:
                raise
            existing, there = _get_rayjob(cluster, namespace, name), True  # a retried create that had arrived
            if existing is None:
                raise SubmitError(f"RayJob {namespace}/{name} was there and is gone: submit again") from None
    if not owned:
        for policy in policies:  # owned by the job now: deleted with it
            send_policy(cluster, policy, existing)
    for policy in policies:  # one the collector took after all (it had judged the old one before our replace)
        try:
            cluster.request("NetworkingV1Api", "read_namespaced_network_policy", policy["metadata"]["name"], namespace)
        except KubeError as error:
            if error.code != 404:
                raise
            send_policy(cluster, policy, existing)
    return existing, there

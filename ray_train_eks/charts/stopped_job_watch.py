"""Runs in the Ray head pod of a RayJob's cluster, beside the head, with the standard library only
(the chart passes this file's text to ``python -c``: stopped_jobs.py): a job stopped with ``ray
job stop`` frees its GPUs.

KubeRay 1.7.0 marks such a job ``jobStatus: STOPPED``, ``jobDeploymentStatus: Complete``
(``rayjob_controller.go``: every terminal job status is Complete but a failed deployment) and then
applies the RayJob's deletion rules, which can name SUCCEEDED, FAILED and a failed deployment only
(the CRD's enums): the cluster, GPU workers included, would stay until someone deletes the RayJob.
This reads the RayJob every ``POLL_S`` seconds with the pod's service account; once it has been
STOPPED and Complete for ``GRACE_S`` seconds (the head's last logs reach the log store) it deletes
that RayJob, the uid it read as a precondition (never a newer job of the same name), and KubeRay
and the garbage collector take its cluster down. A RayJob being deleted, ended otherwise, or gone
is left to the deletion rules. Errors of the API server are said once each and the reading goes
on. It never exits by itself: the head pod restarts a container that ends.

Environment: ``RAY_TRAIN_EKS_RAYJOB`` (namespace/name), ``RAY_TRAIN_EKS_STOPPED_GRACE_S``,
``RAY_TRAIN_EKS_STOPPED_POLL_S``; ``RAY_TRAIN_EKS_KUBE_API`` (tests: an http:// URL) replaces the
in-cluster API address and its CA, ``RAY_TRAIN_EKS_SERVICE_ACCOUNT_DIR`` where the token is read.
"""

import json
import os
import ssl
import time
import urllib.error
import urllib.request

SERVICE_ACCOUNT_DIR = os.environ.get("RAY_TRAIN_EKS_SERVICE_ACCOUNT_DIR", "/var/run/secrets/kubernetes.io/serviceaccount")


def say(text):
    print(f"ray-train-eks stopped-job watch: {text}", flush=True)


def call(method, path, body=None):
    """The API server's answer to one request: (HTTP status, the JSON it sent)."""
    headers = {"Accept": "application/json"}
    token_file = os.path.join(SERVICE_ACCOUNT_DIR, "token")
    if os.path.exists(token_file):  # re-read each time: the kubelet rotates the bound token
        with open(token_file) as handle:
            headers["Authorization"] = "Bearer " + handle.read().strip()
    base, context = os.environ.get("RAY_TRAIN_EKS_KUBE_API"), None
    if not base:
        base = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"
        context = ssl.create_default_context(cafile=os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt"))
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(base.rstrip("/") + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=15, context=context) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        try:
            said = json.loads(error.read() or b"{}")
        except ValueError:
            said = {}
        return error.code, said


def stopped_by_hand(job):
    status = job.get("status") or {}
    return (status.get("jobStatus") == "STOPPED" and status.get("jobDeploymentStatus") == "Complete"
            and not job["metadata"].get("deletionTimestamp"))


def main():
    namespace, name = os.environ["RAY_TRAIN_EKS_RAYJOB"].split("/", 1)
    grace = float(os.environ.get("RAY_TRAIN_EKS_STOPPED_GRACE_S", "60"))
    poll = float(os.environ.get("RAY_TRAIN_EKS_STOPPED_POLL_S", "15"))
    path = f"/apis/ray.io/v1/namespaces/{namespace}/rayjobs/{name}"
    said, stopped_at, done = set(), None, False
    say(f"watching RayJob {namespace}/{name}: stopped with ray job stop, it is deleted {grace:.0f} s later")
    while True:
        time.sleep(poll)
        if done:
            continue
        try:
            code, job = call("GET", path)
        except OSError as error:  # the API server unreachable for a while: read again
            code, job = 0, {"message": str(error)}
        if code == 404:
            say(f"RayJob {namespace}/{name} is gone")
            done = True
            continue
        if code != 200:
            message = f"reading RayJob {namespace}/{name}: HTTP {code} {job.get('message', '')}"
            if message not in said:
                said.add(message)
                say(message + " (read again every %.0f s)" % poll)
            continue
        if not stopped_by_hand(job):
            stopped_at = None
            continue
        if stopped_at is None:
            stopped_at = time.monotonic()
            say(f"RayJob {namespace}/{name} was stopped with ray job stop; its deletion rules cannot name STOPPED, "
                f"so it is deleted in {grace:.0f} s to free its GPU nodes (its checkpoints stay)")
        if time.monotonic() - stopped_at < grace:
            continue
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background",
                   "preconditions": {"uid": job["metadata"]["uid"]}}
        code, answer = call("DELETE", path, options)
        if code in (200, 202, 404, 409):  # 409: the uid differs, a newer job of the name: not ours to delete
            say(f"RayJob {namespace}/{name} deleted: KubeRay takes its cluster down" if code in (200, 202)
                else f"RayJob {namespace}/{name} not deleted: HTTP {code} {answer.get('message', '')}")
            done = True
        else:
            message = f"deleting RayJob {namespace}/{name}: HTTP {code} {answer.get('message', '')}"
            if message not in said:
                said.add(message)
                say(message + " (tried again every %.0f s)" % poll)


if __name__ == "__main__":
    main()

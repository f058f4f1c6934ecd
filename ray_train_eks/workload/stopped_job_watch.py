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
is left to the deletion rules. Errors of the API server (or of the network to it) are said once
each and the reading goes on. It never exits by itself: in SidecarMode KubeRay sets the head pod's
``restartPolicy: Never`` (``rayjob_controller.go``), so a container that ended would stay ended.

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


class Watch:
    def __init__(self, namespace, name, grace, poll):
        self.namespace, self.name, self.grace, self.poll = namespace, name, grace, poll
        self.path = f"/apis/ray.io/v1/namespaces/{namespace}/rayjobs/{name}"
        self.said, self.stopped_at, self.done = set(), None, False

    def once(self, message):
        if message not in self.said:
            self.said.add(message)
            say(message + " (tried again every %.0f s)" % self.poll)

    def look(self):
        """One reading of the RayJob, and the delete when its time has come."""
        what = f"RayJob {self.namespace}/{self.name}"
        code, job = call("GET", self.path)
        if code == 404:
            say(f"{what} is gone")
            self.done = True
            return
        if code != 200:
            self.once(f"reading {what}: HTTP {code} {job.get('message', '')}")
            return
        if not stopped_by_hand(job):
            self.stopped_at = None
            return
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
            say(f"{what} was stopped with ray job stop; its deletion rules cannot name STOPPED, "
                f"so it is deleted in {self.grace:.0f} s to free its GPU nodes (its checkpoints stay)")
        if time.monotonic() - self.stopped_at < self.grace:
            return
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background",
                   "preconditions": {"uid": job["metadata"]["uid"]}}
        code, answer = call("DELETE", self.path, options)
        if code in (200, 202, 404, 409):  # 409: the uid differs, a newer job of the name: not ours to delete
            say(f"{what} deleted: KubeRay takes its cluster down" if code in (200, 202)
                else f"{what} not deleted: HTTP {code} {answer.get('message', '')}")
            self.done = True
        else:
            self.once(f"deleting {what}: HTTP {code} {answer.get('message', '')}")


def main():
    namespace, name = os.environ["RAY_TRAIN_EKS_RAYJOB"].split("/", 1)
    watch = Watch(namespace, name, float(os.environ.get("RAY_TRAIN_EKS_STOPPED_GRACE_S", "60")),
                  float(os.environ.get("RAY_TRAIN_EKS_STOPPED_POLL_S", "15")))
    say(f"watching RayJob {namespace}/{name}: stopped with ray job stop, it is deleted {watch.grace:.0f} s later")
    while True:
        time.sleep(watch.poll)
        if watch.done:
            continue
        try:
            watch.look()
        except Exception as error:  # noqa: BLE001 - the network or the API server away for a while: read again
            watch.once(f"reading or deleting RayJob {namespace}/{name}: {type(error).__name__}: {error}")


if __name__ == "__main__":
    main()

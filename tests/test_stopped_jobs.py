"""A job stopped with ``ray job stop`` frees its GPUs (ray_train_eks/workload/stopped_jobs.py): the
watch beside the Ray head, run as the pod runs it (``python -c`` of its source) against the stand-in
API server (tests/fake_apiserver.py) with a service-account token, and the admission policy that
lets the Ray pods delete only a stopped RayJob, evaluated as the API server would (CEL)."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import time

import celpy
import pytest

from fake_apiserver import FakeApiServer
from ray_train_eks.charts import RayWorkloadSpec, ray_job
from ray_train_eks.workload.spec import RAY_NAMESPACE, RAY_SERVICE_ACCOUNT
from ray_train_eks.workload.job import resolve_job
from ray_train_eks.workload.stopped_jobs import WATCH_SOURCE, stopped_job_objects


def frees_stopped_jobs(spec: RayWorkloadSpec) -> bool:
    """Whether the resolved job gets the watch (ray_train_eks/workload/job.py)."""
    return resolve_job(spec).frees_stopped_jobs
from ray_train_eks.config import PlatformConfig

STOPPED = {"jobStatus": "STOPPED", "jobDeploymentStatus": "Complete"}
RAY_PODS = f"system:serviceaccount:{RAY_NAMESPACE}:{RAY_SERVICE_ACCOUNT}"


def _spec(**context) -> RayWorkloadSpec:
    return PlatformConfig.from_context(context.get, environ={}).workload_spec({"train.py": "print(1)\n"})


@pytest.fixture
def cluster(tmp_path):
    """The stand-in API server, the deployed RayJob in it (as KubeRay's status: running), and the
    environment of the watch container with the Ray pods' token in a service-account directory."""
    server = FakeApiServer(tokens={"ray-pods-token": (RAY_PODS, ("get rayjobs", "delete rayjobs"))})
    job = ray_job(_spec())
    job["status"] = {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}
    server.put(job)
    (tmp_path / "token").write_text("ray-pods-token\n")
    (watch,) = [c for c in job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
                if c["name"] == "stopped-job-watch"]
    env = {**os.environ, **{e["name"]: e["value"] for e in watch["env"]},
           "RAY_TRAIN_EKS_KUBE_API": server.url, "RAY_TRAIN_EKS_SERVICE_ACCOUNT_DIR": str(tmp_path),
           "RAY_TRAIN_EKS_STOPPED_GRACE_S": "0.5", "RAY_TRAIN_EKS_STOPPED_POLL_S": "0.05"}
    assert watch["command"] == ["python", "-c", WATCH_SOURCE]
    yield server, job["metadata"]["name"], env
    server.close()


def _watch(env: dict, until, timeout: float = 20.0) -> str:
    """Run the watch as the pod does (``python -c``) until ``until()`` holds, then stop it; its output."""
    process = subprocess.Popen([sys.executable, "-c", WATCH_SOURCE], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        held = until()
        time.sleep(0.3)  # what it says after
        assert process.poll() is None, "the watch must never exit by itself (the head pod would restart it)"
    finally:
        process.terminate()
        output = process.communicate(timeout=10)[0]
    assert held, output
    return output


def test_a_job_stopped_with_ray_job_stop_is_deleted_after_the_grace_and_its_cluster_goes(cluster):
    server, name, env = cluster
    started = time.monotonic()
    server.update("rayjobs", RAY_NAMESPACE, name, status=STOPPED)  # what KubeRay writes after ray job stop
    output = _watch(env, until=lambda: not server.of("rayjobs"))
    assert time.monotonic() - started >= 0.5  # not before the grace
    assert f"RayJob {RAY_NAMESPACE}/{name} was stopped with ray job stop" in output and "deleted in 0 s" in output
    assert f"RayJob {RAY_NAMESPACE}/{name} deleted: KubeRay takes its cluster down" in output
    (delete,) = [q for q in server.queries if q[0] == "DELETE"]
    assert delete[1].endswith(f"/rayjobs/{name}")


def test_a_running_job_is_left_and_one_stopped_later_is_deleted(cluster):
    server, name, env = cluster
    stop_at = time.monotonic() + 0.75

    def stopped_meanwhile():  # the job runs while the watch reads it, then someone stops it
        if time.monotonic() > stop_at and server.of("rayjobs") and server.of("rayjobs")[0].get("status", {}).get("jobStatus") == "RUNNING":
            server.update("rayjobs", RAY_NAMESPACE, name, status=STOPPED)
        return not server.of("rayjobs")

    _watch(env, until=stopped_meanwhile)
    gets = [q for q in server.queries if q[0] == "GET"]
    assert len(gets) >= 5  # it read the running job several times and left it


@pytest.mark.parametrize("status, deleting", [
    ({"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}, False),  # the deletion rules take it down
    ({"jobStatus": "STOPPED", "jobDeploymentStatus": "Failed"}, False),  # a deadline passed: a rule names it
    (STOPPED, True),  # ray-train-eks stop or kubectl delete: KubeRay's finalizer holds it; not ours to delete again
])
def test_jobs_that_end_otherwise_or_are_being_deleted_are_left(cluster, status, deleting):
    server, name, env = cluster
    server.update("rayjobs", RAY_NAMESPACE, name, status=status)
    if deleting:
        job = server.of("rayjobs")[0]
        job["metadata"]["finalizers"] = ["ray.io/rayjob-finalizer"]
        with server.changed:  # a delete as the API server takes it: the finalizer holds it, deletionTimestamp set
            server._delete(("rayjobs", RAY_NAMESPACE, name), "ray.io", {})
    reads = lambda: len([q for q in server.queries if q[0] == "GET"])
    _watch(env, until=lambda: reads() >= 25)  # 1.25 s: past the grace
    assert server.of("rayjobs") and not [q for q in server.queries if q[0] == "DELETE"]


def test_a_newer_job_of_the_same_name_is_not_deleted(cluster):
    """Between the watch's last read and its delete, the stopped job was deleted and submitted again
    under the same name: the delete carries the uid it read, the API server refuses it (409), and
    the new job runs on."""
    server, name, env = cluster
    server.update("rayjobs", RAY_NAMESPACE, name, status=STOPPED)
    first_read, handle = [], server.handle

    def handle_then_resubmit(method, raw_path, *args, **kwargs):
        answer = handle(method, raw_path, *args, **kwargs)
        if method == "GET" and answer[0] == 200:
            first_read.append(time.monotonic())
            if time.monotonic() - first_read[0] >= 0.5:  # past the grace: the watch deletes right after this read
                with server.changed:
                    job = copy.deepcopy(server.objects[("rayjobs", RAY_NAMESPACE, name)])
                    job["metadata"]["uid"] = "a-newer-job"
                    job["status"] = {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}
                    server._write("MODIFIED", ("rayjobs", RAY_NAMESPACE, name), job)
        return answer

    server.handle = handle_then_resubmit
    output = _watch(env, until=lambda: any(q[0] == "DELETE" for q in server.queries))
    (job,) = server.of("rayjobs")
    assert job["metadata"]["uid"] == "a-newer-job" and job["status"]["jobStatus"] == "RUNNING"
    assert f"RayJob {RAY_NAMESPACE}/{name} not deleted: HTTP 409" in output and "Precondition failed" in output


def test_without_permission_it_says_so_once_and_reads_on(cluster):
    """The Role missing (a hand-made namespace, a cluster policy): the 403 is said once, the watch
    keeps reading, and the job stays (list and status say how to free it)."""
    server, name, env = cluster
    server.tokens["ray-pods-token"] = (RAY_PODS, ())
    server.update("rayjobs", RAY_NAMESPACE, name, status=STOPPED)
    reads = lambda: len([q for q in server.queries if q[0] == "GET"])
    output = _watch(env, until=lambda: reads() >= 10)
    assert output.count("HTTP 403") == 1 and 'cannot get resource "rayjobs"' in output
    assert server.of("rayjobs")


def test_the_api_server_unreachable_for_a_while_then_back(cluster):
    server, name, env = cluster
    path = f"/apis/ray.io/v1/namespaces/{RAY_NAMESPACE}/rayjobs/{name}"
    server.faults[("GET", path)] = ([(503, {"message": "the server is currently unable to handle the request"})] * 3
                                    + [(200, {"text": "<html>a proxy's page, not JSON</html>"})] * 2)
    server.update("rayjobs", RAY_NAMESPACE, name, status=STOPPED)
    output = _watch(env, until=lambda: not server.of("rayjobs"))
    assert output.count("HTTP 503") == 1 and output.count("JSONDecodeError") == 1  # said once each, and read on


# --------------------------------------------------------------------- where the watch is, and its permission

def test_only_jobs_whose_cluster_ends_by_deletion_rules_get_the_watch():
    assert frees_stopped_jobs(_spec())
    # queued (Kueue) or suspended: shutdownAfterJobFinishes takes a stopped job down after its TTL
    assert not frees_stopped_jobs(dataclasses.replace(_spec(), queue_name="ray-train"))
    assert not frees_stopped_jobs(dataclasses.replace(_spec(), suspend=True))
    assert not frees_stopped_jobs(dataclasses.replace(_spec(), shutdown_after_job_finishes=False, ttl_seconds_after_finished=0))
    assert not frees_stopped_jobs(dataclasses.replace(_spec(), stopped_job_grace_s=None))
    assert stopped_job_objects(dataclasses.replace(_spec(), stopped_job_grace_s=None)) == []
    head = ray_job(dataclasses.replace(_spec(), suspend=True))["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert [c["name"] for c in head["template"]["spec"]["containers"]] == ["ray-head"]


def _admitted(old: dict, username: str = RAY_PODS) -> list[str]:
    """The policy's failed validations for a DELETE of ``old`` by ``username``, as the API server
    evaluates them (matchConditions first)."""
    policy = stopped_job_objects(_spec())[2]["spec"]
    environment = celpy.Environment()
    activation = {"oldObject": celpy.json_to_cel(old), "object": None, "request": celpy.json_to_cel({"userInfo": {"username": username}})}
    run = lambda expression: bool(environment.program(environment.compile(expression)).evaluate(activation))
    if not all(run(c["expression"]) for c in policy["matchConditions"]):
        return []
    return [v["message"] for v in policy["validations"] if not run(v["expression"])]


def test_the_ray_pods_may_delete_a_stopped_job_only():
    role, binding, policy, policy_binding = stopped_job_objects(_spec())
    assert role["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["get", "delete"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RAY_SERVICE_ACCOUNT, "namespace": RAY_NAMESPACE}]
    assert policy_binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["DELETE"]
    job = ray_job(_spec())
    assert _admitted({**job, "status": STOPPED}) == []
    (message,) = _admitted({**job, "status": {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}})
    assert "only once it was stopped with ray job stop" in message
    assert _admitted({**job, "status": {"jobStatus": "STOPPED", "jobDeploymentStatus": "Failed"}})
    assert _admitted(job)  # no status yet: a job just created
    assert _admitted({**job, "status": {"jobStatus": "RUNNING"}}, username="trainer") == []  # people are not limited


def test_a_platform_deployed_before_the_watch_gets_no_watch_from_a_newer_command():
    """ray-train-eks builds its RayJobs from the deployed platform's settings: one deployed before the
    watch existed has no Role for it, so its jobs get no watch (and list says ray-train-eks stop)."""
    import json

    from ray_train_eks.workload.spec import spec_from_settings, spec_settings
    from ray_train_eks.cli.runs import stopped_note

    older = json.loads(spec_settings(_spec()))
    older.pop("stopped_job_grace_s")
    spec = spec_from_settings(json.dumps(older))
    assert spec.stopped_job_grace_s is None and not frees_stopped_jobs(spec)
    job = ray_job(spec)
    assert "until ray-train-eks stop r deletes it" in stopped_note(job, "r")
    assert spec_from_settings(spec_settings(_spec())).stopped_job_grace_s == 60


@pytest.mark.synth
def test_the_platform_applies_the_watchs_permission_before_its_rayjobs(default_platform):
    """The stack's manifests hold the Role, its binding and the admission policy, applied before the
    RayJob (whose head's watch uses them); ray-train-eks's jobs find them deployed."""
    manifests = default_platform.manifests()
    (key,) = [k for k, objects in manifests.items() if any(o["kind"] == "Role" for o in objects)]
    assert [o["kind"] for o in manifests[key]] == ["Role", "RoleBinding", "ValidatingAdmissionPolicy",
                                                   "ValidatingAdmissionPolicyBinding"]
    job_key, job = default_platform.ray_job()
    assert key in default_platform.template["Resources"][job_key]["DependsOn"]
    containers = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["ray-head", "stopped-job-watch"]

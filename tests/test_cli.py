"""``ray-train-eks`` (ray_train_eks/cli/) against a stand-in API server that refuses what the real
one refuses (tests/fake_apiserver.py: tokens, permissions, namespaces, names, the KubeRay CRD
schemas), with the settings the stack writes into the cluster; the AWS calls (CloudFormation, EKS,
STS) through botocore's Stubber, the token made offline as ``aws eks get-token`` makes it."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from fake_apiserver import FakeApiServer

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "ray-train"


@pytest.fixture(scope="module")
def deployed_spec():
    """What the stack deploys with its defaults (ray_train_eks/config.py), as its settings hold it."""
    from ray_train_eks.config import PlatformConfig

    return PlatformConfig.from_context({}, environ={}).workload_spec()


@pytest.fixture
def api(deployed_spec):
    """The cluster as ``cdk deploy`` leaves it: the settings ConfigMap (the bucket and the workload's
    spec) and the training code's ConfigMap with the installed code's digest."""
    from ray_train_eks.charts import spec_settings
    from ray_train_eks.workload.code import CODE_DIGEST_ANNOTATION, SETTINGS_CONFIGMAP, TRAINING_CODE_CONFIGMAP, files_digest
    from ray_train_eks.cli import installed_training_code

    server = FakeApiServer(tokens={"admin-token": ("admin", "*"), "reader-token": ("reader", ("configmaps",))})
    server.put({"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": SETTINGS_CONFIGMAP, "namespace": NAMESPACE},
                "data": {"bucket": "raytraineks-bucket", "workload": spec_settings(deployed_spec)}})
    server.put({"kind": "ConfigMap", "apiVersion": "v1",
                "metadata": {"name": TRAINING_CODE_CONFIGMAP, "namespace": NAMESPACE,
                             "annotations": {CODE_DIGEST_ANNOTATION: files_digest(installed_training_code())}}})
    yield server
    server.close()


@pytest.fixture
def bucket(monkeypatch):
    """moto's S3 server with the stack's bucket, boto3 and pyarrow pointed at it."""
    from bench.local_s3 import start_moto

    server, env = start_moto("raytraineks-bucket")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield "raytraineks-bucket"
    server.terminate()
    server.wait(timeout=30)


def kubeconfig(tmp_path: Path, server: FakeApiServer, token: str = "admin-token") -> str:
    path = tmp_path / f"kubeconfig-{token}"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": {"server": server.url}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
    }))
    return str(path)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    from ray_train_eks.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_the_manifests_the_stack_would_apply_and_needs_no_aws(capsys, monkeypatch):
    """No AWS credentials, no cluster: the platform's defaults; the objects validate against the
    KubeRay CRD and Kubernetes' schemas, carry the run's name and its options."""
    from crd_schema import kuberay_schemas, validate

    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    code, out, _ = cli(capsys, "submit", "--name", "dolly-lr1e5", "--dry-run", "--", "--learning-rate", "1e-5", "--max-steps", "60")
    assert code == 0
    objects = list(yaml.safe_load_all(out))
    assert [obj["kind"] for obj in objects] == ["NetworkPolicy", "NetworkPolicy", "RayJob"]
    schemas = kuberay_schemas()
    for obj in objects:
        validate(obj, schemas)
        assert obj["metadata"]["labels"]["ray-train-eks/run"] == "dolly-lr1e5"
    job = objects[-1]
    assert job["metadata"]["name"].startswith("dolly-lr1e5-")
    assert "--learning-rate 1e-5 --max-steps 60 --run-name dolly-lr1e5" in job["spec"]["entrypoint"]
    # The memory plan and the spec's rules run before anything is printed.
    code, _, err = cli(capsys, "submit", "--name", "too-big", "--dry-run", "--", "--model", "Qwen/Qwen2.5-32B")
    assert code == 1 and "Qwen/Qwen2.5-32B does not fit 8 x L4" in err


def jobs_of(api: FakeApiServer) -> list[dict]:
    return api.of("rayjobs")


def kuberay(api: FakeApiServer, job: dict, **status) -> None:
    """What KubeRay writes into a RayJob's status."""
    api.update("rayjobs", NAMESPACE, job["metadata"]["name"], status=status)


def test_two_submits_of_different_options_are_two_jobs_listed_and_one_stopped(api, bucket, tmp_path, capsys):
    """The second waits for the first to end: both would ask for every GPU node and, started together,
    each hold one and wait for the other forever. Every KubeRay end state counts as ended, the
    never-terminal ValidationFailed too."""
    config = kubeconfig(tmp_path, api)
    for name, rate in (("lr-high", "3e-5"), ("lr-low", "1e-5")):
        code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--name", name, "--", "--learning-rate", rate)
        if name == "lr-low":  # refused while lr-high is active, then taken once it has ended
            assert code == 1 and "the GPU nodes are taken: lr-high-" in err and "(created, run lr-high)" in err
            kuberay(api, jobs_of(api)[0], jobDeploymentStatus="ValidationFailed")
            code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--name", name, "--", "--learning-rate", rate)
        assert code == 0, err
        assert f"submitted run {name}: RayJob {NAMESPACE}/{name}-" in out and "9.20 USD/hour for its 2 x g6.12xlarge" in out
    jobs = jobs_of(api)
    assert len(jobs) == 2 and {obj["metadata"]["labels"]["ray-train-eks/run"] for obj in jobs} == {"lr-high", "lr-low"}
    policies = api.of("networkpolicies")
    assert len(policies) == 4  # each job's cluster has its own, owned by its RayJob
    owners = {job["metadata"]["uid"]: job["metadata"]["name"] for job in jobs}
    assert all(owners[p["metadata"]["ownerReferences"][0]["uid"]] == p["metadata"]["labels"]["ray.io/cluster"]
               if "ray.io/cluster" in p["metadata"]["labels"] else p["metadata"]["ownerReferences"][0]["uid"] in owners
               for p in policies)
    code, out, _ = cli(capsys, "list", "--kubeconfig", config)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "STATE", "STEP", "LOSS", "AGE", "COST", "SO", "FAR", "RAYJOB"]
    assert [line.split()[:2] for line in lines[1:]] == [["lr-high", "validationfailed"], ["lr-low", "created"]]
    # lr-low stopped with ray job stop: KubeRay keeps its cluster (no deletion rule names STOPPED); list says so.
    kuberay(api, next(j for j in jobs_of(api) if j["metadata"]["labels"]["ray-train-eks/run"] == "lr-low"),
            jobDeploymentStatus="Complete", jobStatus="STOPPED")
    code, out, _ = cli(capsys, "list", "--kubeconfig", config)
    assert "lr-low: stopped with ray job stop: the watch beside its Ray head deletes it 60 s after" in out
    assert "ray-train-eks stop lr-low frees them now" in out
    code, out, _ = cli(capsys, "stop", "--kubeconfig", config, "lr-high")
    assert code == 0 and "stopped run lr-high" in out and "its checkpoints stay" in out
    assert [obj["metadata"]["labels"]["ray-train-eks/run"] for obj in jobs_of(api)] == ["lr-low"]
    wait_until(lambda: len(api.of("networkpolicies")) == 2)  # the garbage collector took lr-high's
    code, _, err = cli(capsys, "stop", "--kubeconfig", config, "lr-high")
    assert code == 1 and "no run 'lr-high'" in err


def wait_until(condition, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time a controller takes"
        time.sleep(0.05)


@pytest.fixture
def kuberay_finalizer(api):
    """KubeRay's part in a RayJob's deletion: its finalizer ``ray.io/rayjob-finalizer`` (added when
    it first sees the job), removed a moment after the job is deleted, once it has stopped the Ray job."""
    import threading
    import time

    done = threading.Event()

    def operator():
        while not done.wait(0.05):
            for job in api.of("rayjobs"):
                meta = job["metadata"]
                if meta.get("deletionTimestamp"):
                    time.sleep(0.3)
                    api.finalize("rayjobs", NAMESPACE, meta["name"])
                elif not meta.get("finalizers"):
                    meta["finalizers"] = ["ray.io/rayjob-finalizer"]

    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    yield
    done.set()
    thread.join()


def test_stop_then_resume_with_the_same_options_twice(api, bucket, kuberay_finalizer, tmp_path, capsys):
    """The workflow the README names: the same options give the same RayJob and NetworkPolicy names,
    which a resume must be able to create again while KubeRay still finalizes the stopped job and the
    garbage collector takes its policies (HTTP 409 before)."""
    config = kubeconfig(tmp_path, api)
    assert cli(capsys, "submit", "--kubeconfig", config, "--name", "dolly", "--", "--max-steps", "100")[0] == 0
    first = jobs_of(api)[0]["metadata"]["name"]
    for _ in range(2):
        assert cli(capsys, "stop", "--kubeconfig", config, "dolly")[0] == 0
        code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--resume", "dolly")
        assert code == 0, err
        (job,) = jobs_of(api)
        assert job["metadata"]["name"] == first and not job["metadata"].get("deletionTimestamp")
        policies = api.of("networkpolicies")
        assert len(policies) == 2 and {p["metadata"]["ownerReferences"][0]["uid"] for p in policies} == {job["metadata"]["uid"]}
    # The same run resubmitted after it failed: the ended RayJob of that name is replaced.
    kuberay(api, jobs_of(api)[0], jobDeploymentStatus="Failed", jobStatus="FAILED")
    code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--resume", "dolly")
    assert code == 0, err
    assert [state_of_job(job) for job in jobs_of(api)] == ["created"]


def state_of_job(job: dict) -> str:
    from ray_train_eks.cli.admission import state_of

    return state_of(job)


def test_a_retry_after_a_submit_that_failed_half_way_completes_it(api, bucket, tmp_path, capsys, monkeypatch):
    """The API server fails the RayJob's create (5xx past the client's retries) after the policies
    were created; the same command again creates it and owns the policies. Then the owner update
    fails after the RayJob was created: the same command again finds its job and completes it."""
    from ray_train_eks.cli import kube
    from ray_train_eks.cli.kube import retries

    monkeypatch.setattr(kube, "RETRY_BACKOFF_S", 0.01)  # the same retries, without their 15 s of waiting
    config = kubeconfig(tmp_path, api)
    overloaded = (503, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "ServiceUnavailable",
                        "message": "etcdserver: request timed out", "code": 503})
    api.faults[("POST", f"/apis/ray.io/v1/namespaces/{NAMESPACE}/rayjobs")] = [overloaded] * (retries().status + 1)
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--name", "half", "--", "--max-steps", "10")
    assert code == 1 and "HTTP 503 etcdserver: request timed out" in err and "Traceback" not in err
    assert not jobs_of(api) and len(api.of("networkpolicies")) == 2
    code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--name", "half", "--", "--max-steps", "10")
    assert code == 0, err
    (job,) = jobs_of(api)
    assert {p["metadata"]["ownerReferences"][0]["uid"] for p in api.of("networkpolicies")} == {job["metadata"]["uid"]}
    # A 503 on a create is retried by the client: one that passes on the third try is no failure at all.
    assert cli(capsys, "stop", "--kubeconfig", config, "half")[0] == 0
    api.faults[("PUT", f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies")] = [overloaded] * 10
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--resume", "half")
    assert code == 1 and "HTTP 503" in err
    api.faults.clear()
    code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--resume", "half")
    assert code == 0 and "submitted before; its objects are complete now" in out, err
    (job,) = jobs_of(api)
    assert {p["metadata"]["ownerReferences"][0]["uid"] for p in api.of("networkpolicies")} == {job["metadata"]["uid"]}


def test_a_run_that_exists_is_not_continued_without_resume(api, bucket, tmp_path, capsys):
    """A second user's submit --name X with other options: refused, naming --resume X and another name,
    whether X's RayJob is there or only its records in the bucket."""
    config = kubeconfig(tmp_path, api)
    assert cli(capsys, "submit", "--kubeconfig", config, "--name", "shared", "--", "--learning-rate", "1e-5")[0] == 0
    kuberay(api, jobs_of(api)[0], jobDeploymentStatus="Complete", jobStatus="SUCCEEDED")
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--name", "shared", "--", "--learning-rate", "3e-5")
    assert code == 1 and "run shared exists (its RayJob shared-" in err
    assert "submit --resume shared continues it" in err and "give another --name" in err
    assert cli(capsys, "stop", "--kubeconfig", config, "shared")[0] == 0
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--name", "shared", "--", "--learning-rate", "3e-5")
    assert code == 1 and f"run shared exists (s3://{bucket}/runs/shared/submitted.json)" in err
    # --resume continues it with its own options, and what is given now changes them.
    code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--resume", "shared", "--", "--max-steps", "20")
    assert code == 0, err
    assert "--learning-rate 1e-5 --max-steps 20 --run-name shared" in jobs_of(api)[0]["spec"]["entrypoint"]
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--resume", "never-submitted")
    assert code == 1 and "the run was not submitted by ray-train-eks and its options are not known" in err


def test_two_submits_at_the_same_moment_one_is_admitted(api, bucket, tmp_path, capsys):
    """Two users, two threads, one instant: both find no active job, and the Lease's compare-and-swap
    on the API server lets exactly one take the GPU nodes."""
    import threading

    from ray_train_eks.cli import main

    config = kubeconfig(tmp_path, api)
    start, codes = threading.Barrier(2), {}

    def submit(name: str) -> None:
        start.wait()
        codes[name] = main(["submit", "--kubeconfig", config, "--name", name, "--", "--max-steps", "5"])

    threads = [threading.Thread(target=submit, args=(name,)) for name in ("user-a", "user-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _, err = capsys.readouterr()
    assert sorted(codes.values()) == [0, 1], err
    (job,) = jobs_of(api)
    assert "the GPU nodes are taken" in err and job["metadata"]["name"] in err
    (lease,) = api.of("leases")
    assert lease["spec"]["holderIdentity"] == job["metadata"]["name"]


def test_with_kueue_a_second_job_queues_and_list_says_why(api, bucket, deployed_spec, tmp_path, capsys):
    """A platform deployed with -c queueing=kueue: each job is labelled with the queue and created
    suspended, and waits for Kueue to admit it whole; list and status show its Workload's reason and
    its place in the queue. A larger model than the deployed one fits the quota (the GPU nodes' disk)."""
    import dataclasses

    from ray_train_eks.charts import spec_settings
    from ray_train_eks.workload.code import SETTINGS_CONFIGMAP

    queued = dataclasses.replace(deployed_spec, queue_name="ray-train-eks")
    api.update("configmaps", NAMESPACE, SETTINGS_CONFIGMAP,
               data={"bucket": "raytraineks-bucket", "workload": spec_settings(queued)})
    config = kubeconfig(tmp_path, api)
    api.unserved = {"apis/kueue.x-k8s.io/v1beta2"}  # Kueue not installed: its API is not served
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--name", "first", "--", "--max-steps", "50")
    assert code == 1 and "serves no kueue.x-k8s.io/v1beta2 API: Kueue is not installed" in err
    api.unserved = set()  # installed, but no LocalQueue
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--name", "first", "--", "--max-steps", "50")
    assert code == 1 and "LocalQueue ray-train/ray-train-eks, which does not exist" in err
    api.put({"kind": "LocalQueue", "apiVersion": "kueue.x-k8s.io/v1beta2",
             "metadata": {"name": "ray-train-eks", "namespace": NAMESPACE}, "spec": {"clusterQueue": "ray-train-eks-gpus"}})
    for name, model in (("first", ["--min-nodes", "1"]), ("second", ["--model", "Qwen/Qwen2.5-3B-Instruct"])):
        code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--name", name, "--", "--max-steps", "50", *model)
        assert code == 0, err
        assert "queued in ray-train-eks (Kueue admits it whole when the job before it has ended" in out
        # An elastic job (--min-nodes): admitted whole too, its quota held while it runs smaller (Kueue v0.19.2).
        assert ("Kueue admits it whole, at 2 nodes, and keeps that quota while it runs smaller" in out) == (name == "first")
    jobs = jobs_of(api)
    assert {job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] for job in jobs} == {"ray-train-eks"}
    assert all(job["spec"]["suspend"] is True and job["spec"]["ttlSecondsAfterFinished"] == 30 for job in jobs)
    # Kueue's Workloads as its scheduler leaves them: the first admitted, the second pending.
    for job, reserved in zip(sorted(jobs, key=lambda j: j["metadata"]["labels"]["ray-train-eks/run"]), (True, False)):
        api.put({"kind": "Workload", "apiVersion": "kueue.x-k8s.io/v1beta2",
                 "metadata": {"name": f"rayjob-{job['metadata']['name']}-0a1b2", "namespace": NAMESPACE,
                              "labels": {"kueue.x-k8s.io/job-uid": job["metadata"]["uid"]}},
                 "spec": {"queueName": "ray-train-eks"},
                 "status": {"conditions": [{"type": "QuotaReserved", "status": "True" if reserved else "False",
                                            "reason": "QuotaReserved" if reserved else "Pending",
                                            "message": "" if reserved else "couldn't assign flavors to pod set gpu-workers: "
                                            "insufficient unused quota for nvidia.com/gpu in flavor ray-train-eks-nodes, "
                                            "8 more needed"}]}})
        if reserved:
            api.update("rayjobs", NAMESPACE, job["metadata"]["name"], spec={**job["spec"], "suspend": False})
    code, out, _ = cli(capsys, "list", "--kubeconfig", config)
    assert [line.split()[:2] for line in out.splitlines()[1:3]] == [["first", "created"], ["second", "queued"]]
    assert "queued: 1 of 1 in the queue; Pending: couldn't assign flavors to pod set gpu-workers" in out
    code, out, _ = cli(capsys, "status", "--kubeconfig", config, "second")
    assert "8 more needed" in out


def test_with_kueue_a_job_the_quota_never_holds_is_refused(deployed_spec):
    """Kueue's arithmetic (workload/queueing.py, from kueue pkg/controller/jobs/rayjob and
    pkg/workload): the quota holds the GPU nodes' disk, so the 3B model (104448Mi a worker against the
    deployed 1.5B's 63488Mi) is admitted; on a GPU type whose disk the table does not know, the quota
    is the deployed job's, and the larger model is refused before anything is sent, naming the
    resource, both amounts and the fix."""
    import dataclasses

    from ray_train_eks.charts import job_objects
    from ray_train_eks.workload.queueing import job_requests, queue_fit_problems, queue_quota

    platform = dataclasses.replace(deployed_spec, queue_name="ray-train-eks")
    deployed = job_objects(platform)[-1]
    bigger = job_objects(dataclasses.replace(platform, training_args=("--model", "Qwen/Qwen2.5-3B-Instruct")))[-1]
    assert job_requests(deployed)["ephemeral-storage"] == "63488Mi" and job_requests(bigger)["ephemeral-storage"] == "104448Mi"
    # 2 g6.12xlarge x their GB of NVMe x 0.85, in MiB: far above either job.
    from ray_train_eks.instances import INSTANCE_TYPES

    nvme = INSTANCE_TYPES["g6.12xlarge"].instance_store_gb
    assert queue_quota(platform, deployed)["ephemeral-storage"] == f"{int(2 * nvme * 1e9 * 0.85 // 2**20)}Mi"
    assert queue_fit_problems(platform, deployed, bigger) == []
    # Kueue's pod sets: head, 2 workers, the submitter's KubeRay default (500m, 200Mi).
    head = 1000 * (4 // 2)  # m7i.xlarge: 4 vCPUs, half for the head
    assert job_requests(deployed)["cpu"] == f"{head + 2 * (48 - 2) * 1000 + 500}m"
    custom = dataclasses.replace(platform, gpu_instance_type="p9.48xlarge", worker_resources=(190, 1800), gpus_per_worker=8,
                                 efa_per_worker=4)
    (problem,) = queue_fit_problems(custom, job_objects(custom)[-1],
                                    job_objects(dataclasses.replace(custom, training_args=("--model", "Qwen/Qwen2.5-3B-Instruct")))[-1])
    assert "requests 104448Mi of ephemeral-storage in all, more than the 63488Mi the ClusterQueue" in problem
    assert "would block every job queued after it" in problem and "--peft lora" in problem


def test_a_workload_cluster_platform_refuses_submit_with_the_reason(api, deployed_spec, tmp_path, capsys):
    """-c workload=cluster: a submitted job would bring its own cluster beside the standing one."""
    import dataclasses

    from ray_train_eks.charts import spec_settings
    from ray_train_eks.workload.code import SETTINGS_CONFIGMAP

    standing = dataclasses.replace(deployed_spec, workload="cluster", shutdown_after_job_finishes=False,
                                   ttl_seconds_after_finished=0)
    api.update("configmaps", NAMESPACE, SETTINGS_CONFIGMAP,
               data={"bucket": "raytraineks-bucket", "workload": spec_settings(standing)})
    code, _, err = cli(capsys, "submit", "--kubeconfig", kubeconfig(tmp_path, api), "--name", "x", "--", "--max-steps", "5")
    assert code == 1 and "runs a standing RayCluster (-c workload=cluster)" in err and "ray job submit" in err
    assert not jobs_of(api)


def test_list_and_status_show_each_runs_progress_from_its_own_records(api, bucket, tmp_path, capsys):
    """The step of max steps, the last loss and eval loss, tokens/s and an ETA, read from the records
    the training writes into the bucket (its run log, training/telemetry/runlog.py, run here as rank 0
    runs it), beside the RayJob's state; a loss gone NaN (the run log writes null) is said, not a crash."""
    from training.telemetry.runlog import RunLog

    config = kubeconfig(tmp_path, api)
    assert cli(capsys, "submit", "--kubeconfig", config, "--name", "lr-low", "--", "--max-steps", "100")[0] == 0
    kuberay(api, jobs_of(api)[0], jobDeploymentStatus="Running", jobStatus="RUNNING")
    # On a Capacity Block that ends in 2 h 10 min (training/resilience/deadline.py ``record``, in run.json).
    ends = datetime.fromtimestamp(time.time() + (2 * 60 + 10) * 60 + 40, timezone.utc)
    stop = datetime.fromtimestamp(ends.timestamp() - 35 * 60, timezone.utc)
    block = {"stop_before": f"{stop:%Y-%m-%dT%H:%M:%SZ}", "capacity_block": {"id": "cr-0aaa", "ends": f"{ends:%Y-%m-%dT%H:%M:%SZ}"}}
    # Its nodes priced as they are billed (training/telemetry/cost.py): the rate in run.json, each step's figures.
    rate = {"usd_per_hour": 98.32, "basis": "On-Demand", "nodes": 1, "started": 0.0, "earlier_usd": 0.0}
    log = RunLog(f"s3://{bucket}/runs/lr-low", resume_step=0, about={"run_name": "lr-low", "max_steps": 100, **block, "cost": rate},
                 log=lambda _: None)
    for step in range(1, 41):
        log.record({"step": step, "loss": 2.0 - step / 100, "eval_loss": 1.7 if step == 40 else None, "tokens_per_s": 5000.0,
                    "step_seconds": 3.0, "time": 0.0, "cost_usd": step * 0.25, "cost_usd_projected": 25.0})
    log.flush()
    # The run is tracked: the training's record of its MLflow run, beside its checkpoints.
    from training.storage.files import write_text

    app = "arn:aws:sagemaker:us-west-2:123456789012:mlflow-app/app-ABC123"
    write_text(f"s3://{bucket}/runs/lr-low/mlflow_run.json", json.dumps({"tracking_uri": app, "experiment_id": "7", "run_id": "r1"}))
    code, out, _ = cli(capsys, "list", "--kubeconfig", config)
    assert code == 0
    assert out.splitlines()[1].split()[:4] == ["lr-low", "running", "40/100", "1.6000"]
    assert " 10.00 USD " in out.splitlines()[1]  # the last step's figure, not the platform's rate times the job's age
    assert f"lr-low in MLflow: aws sagemaker create-presigned-mlflow-app-url --arn {app} (then experiment 7, run r1)" in out
    code, out, _ = cli(capsys, "status", "--kubeconfig", config, "lr-low")
    assert code == 0
    assert f"  MLflow: aws sagemaker create-presigned-mlflow-app-url --arn {app} (then experiment 7, run r1)" in out
    assert "run lr-low: running, RayJob ray-train/lr-low-" in out
    assert "step 40 of 100, loss 1.6000, eval loss 1.7000, 5,000 tokens/s, about 3 min to go" in out  # 60 steps x 3 s
    assert (f"  capacity block cr-0aaa ends in 2 h 10 min (at {ends:%H:%M} UTC; its nodes go from 40 min "
            f"before): the run checkpoints and stops, resumable, by {stop:%H:%M} UTC\n") in out
    assert f"final model: s3://{bucket}/runs/lr-low/final/" in out
    assert "  cost so far 10.00 USD at 98.32 USD/h (On-Demand); about 25.00 USD at step 100 at this pace\n" in out
    # The best so far (from the steps' records), the latest evaluation's samples; once ended, what was exported,
    # why the run stopped early, and the benchmark against the base (its summary.json beside the metrics).
    log.record({"step": 40, "loss": 1.6, "eval_loss": 1.7, "best_step": 20, "best_eval_loss": 1.5, "tokens_per_s": 5000.0,
                "step_seconds": 3.0, "time": 0.0})
    log.add_samples(20, [{"prompt": "old", "completion": "old", "ended": True}])
    log.add_samples(40, [{"prompt": "Reverse the words: a b", "completion": "b a", "ended": True},
                         {"prompt": "Reverse the words: c d e", "completion": "e d c e d c", "ended": False}])
    log.flush()
    write_text(f"s3://{bucket}/runs/lr-low/summary.json", json.dumps({
        "export": {"which": "best", "step": 20, "reason": "step 20 has the lowest eval loss (1.5000), against 1.7000 at the last step 40"},
        "stopped_early": "early stopping: 2 evaluation(s) without a lower eval loss than 1.5000 at step 20",
        "benchmarks": {"scores": {"gsm8k": {"exact_match/strict-match": 0.5}}, "base": {"gsm8k": {"exact_match/strict-match": 0.375}}},
        "cost": {"usd": 12.3456, "usd_per_hour": 98.32, "hours_this_invocation": 0.1, "basis": "On-Demand", "earlier_usd": 2.5}}))
    code, out, _ = cli(capsys, "status", "--kubeconfig", config, "lr-low")
    assert "  best eval loss 1.5000 at step 20\n" in out
    assert "  sample at step 40: 'Reverse the words: a b' -> 'b a'\n" in out and "old" not in out
    assert "  sample at step 40: 'Reverse the words: c d e' -> 'e d c e d c' (cut at --sample-max-tokens)\n" in out
    assert "  exported step 20 (best): step 20 has the lowest eval loss (1.5000), against 1.7000 at the last step 40\n" in out
    assert "  stopped early: early stopping: 2 evaluation(s) without a lower eval loss than 1.5000 at step 20\n" in out
    assert "  benchmark gsm8k: exact_match/strict-match 0.5000 (base 0.3750, +0.1250)\n" in out
    assert "  cost 12.35 USD (On-Demand: 98.32 USD/h, 2.50 USD of it before the last restart)\n" in out
    log.record({"step": 41, "loss": float("nan"), "eval_loss": None, "tokens_per_s": 5000.0, "step_seconds": 3.0, "time": 0.0})
    log.flush()
    log.close()
    code, out, err = cli(capsys, "status", "--kubeconfig", config, "lr-low")
    assert code == 0, err
    assert "step 41 of 100, loss nan, eval loss 1.7000" in out and "the run is diverging" in out
    code, out, _ = cli(capsys, "list", "--kubeconfig", config)
    assert out.splitlines()[1].split()[:4] == ["lr-low", "running", "41/100", "nan"]


def test_a_running_runs_cost_goes_on_at_its_nodes_rate_after_its_last_step_and_an_ended_ones_stops_there():
    from ray_train_eks.cli.run_records import cost_so_far

    found = {"cost": {"so_far": 10.0, "at": 1000.0, "usd_per_hour": 36.0}}  # a step 10 minutes ago; 36 USD/h
    assert cost_so_far(found, running=True, now=1600.0) == pytest.approx(16.0)
    assert cost_so_far(found, running=False, now=1600.0) == 10.0
    assert cost_so_far({}, running=True) is None


def test_an_elastic_run_says_at_submit_what_it_does_and_status_its_size_and_resizes(api, bucket, tmp_path, capsys):
    """``--min-nodes 1`` on the default two GPU nodes: the worker group keeps both pods (a lost node's pod
    waits Pending for its replacement: what asks for the node back) and says its minimum; submit says what
    elastic means; status reads the size and each resize from the records the training writes."""
    from training.telemetry.runlog import RunLog

    config = kubeconfig(tmp_path, api)
    code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--name", "spot", "--", "--max-steps", "100", "--min-nodes", "1")
    assert code == 0, err
    assert ("  elastic: starts on its 2 GPU nodes and goes on with as few as 1 when nodes are lost, growing back at a "
            "checkpoint when they return") in out and "Kueue" not in out
    (group,) = jobs_of(api)[0]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 2)
    log = RunLog(f"s3://{bucket}/runs/spot", resume_step=0, about={"run_name": "spot", "max_steps": 100, "nodes": 2,
                                                                     "min_nodes": 1, "workers_per_node": 4}, log=lambda _: None)
    for step in range(1, 31):  # shrank after a preemption at step 12, grew back at step 24
        record = {"step": step, "loss": 2.0, "tokens_per_s": 5000.0, "step_seconds": 3.0, "time": 0.0,
                  "workers": 4 if 12 < step <= 24 else 8}
        if step in (13, 25):
            record.update(resume_cause="preemption" if step == 13 else "resize", resized_from_workers=12 - record["workers"])
        log.record(record)
    log.flush()
    log.close()
    code, out, _ = cli(capsys, "status", "--kubeconfig", config, "spot")
    assert ("  on 2 of 2 GPU nodes (elastic, --min-nodes 1); resized 2 time(s), the last: step 13: 2 -> 1 (preemption); "
            "step 25: 1 -> 2 (resize)\n") in out


def later(minutes: int) -> str:
    """A creation time ``minutes`` from now (a submitter pod comes after its RayJob)."""
    from datetime import datetime, timedelta, timezone

    return (datetime.now(timezone.utc) + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


def submitter_pod(api: FakeApiServer, job: str, name: str, created: str, **fields) -> None:
    fields.setdefault("status", {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]})
    api.put({"kind": "Pod", "apiVersion": "v1", **fields,
             "metadata": {"name": f"{job}-{name}", "namespace": NAMESPACE, "creationTimestamp": created,
                          "labels": {"batch.kubernetes.io/job-name": job}}})


def test_logs_print_the_submitter_pods_output(api, bucket, tmp_path, capsys):
    """KubeRay's submitter (a Job of the RayJob's name, K8sJobMode) follows the Ray job's logs: its
    newest pod's log is the training's output, its last lines with --tail, its previous container's
    with --previous."""
    config = kubeconfig(tmp_path, api)
    assert cli(capsys, "submit", "--kubeconfig", config, "--name", "lr-low", "--", "--max-steps", "100")[0] == 0
    job = jobs_of(api)[0]["metadata"]["name"]
    code, _, err = cli(capsys, "logs", "--kubeconfig", config, "lr-low")
    assert code == 1 and "its submitter pod has not started yet" in err
    # A previous job's of the same name (created before this RayJob, not yet collected), a retried one, the newest.
    submitter_pod(api, job, "stale", "2026-12-01T08:00:00Z", log="another job's log\n")
    submitter_pod(api, job, "old", later(1), log="a retried submitter\n", container_state="terminated")
    submitter_pod(api, job, "new", later(2), log="[train] step 1/100 loss 2.0\n[train] step 2/100 loss 1.9\n",
                  previous_log="the container before a restart\n")
    code, out, _ = cli(capsys, "logs", "--kubeconfig", config, "lr-low")
    assert code == 0 and out == "[train] step 1/100 loss 2.0\n[train] step 2/100 loss 1.9\n"
    code, out, _ = cli(capsys, "logs", "--kubeconfig", config, "lr-low", "--tail", "1")
    assert out == "[train] step 2/100 loss 1.9\n"
    code, out, _ = cli(capsys, "logs", "--kubeconfig", config, "lr-low", "--previous")
    assert out == "the container before a restart\n"
    assert ("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{job}-new/log") in api.requests


def test_logs_follow_waits_for_a_late_pod_and_follows_the_retried_one(api, bucket, tmp_path, capsys):
    """logs -f before the submitter pod exists: it says what it waits for; the pod's container starts
    late (the kubelet answers 400 until then); its first pod fails and the Job starts another, whose
    log stream drops once (a proxy, an API server replaced) and is reattached: the log goes on from
    the new pod until the RayJob ends."""
    import threading
    import time

    config = kubeconfig(tmp_path, api)
    assert cli(capsys, "submit", "--kubeconfig", config, "--name", "late", "--", "--max-steps", "100")[0] == 0
    job = jobs_of(api)[0]
    name = job["metadata"]["name"]

    def cluster_events():
        time.sleep(0.5)
        submitter_pod(api, name, "a", later(1), log="", container_state="waiting",
                      status={"phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]})
        time.sleep(0.5)
        api.update("pods", NAMESPACE, f"{name}-a", container_state="running", log="step 1\n",
                   status={"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]})
        time.sleep(0.5)
        api.update("pods", NAMESPACE, f"{name}-a", container_state="terminated", log="step 1\nconnection lost\n",
                   status={"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}]})
        time.sleep(0.3)
        submitter_pod(api, name, "b", later(2), log="step 2\n", container_state="running", drop_follow_once=True,
                      status={"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]})
        time.sleep(1.0)
        kuberay(api, job, jobDeploymentStatus="Complete", jobStatus="SUCCEEDED")
        api.update("pods", NAMESPACE, f"{name}-b", container_state="terminated", log="step 2\ndone\n",
                   status={"phase": "Succeeded", "containerStatuses": [{"state": {"terminated": {"exitCode": 0}}}]})

    events = threading.Thread(target=cluster_events, daemon=True)
    events.start()
    before = len(api.requests)
    code, out, err = cli(capsys, "logs", "--kubeconfig", config, "late", "-f")
    events.join()
    assert code == 0, err
    assert out == "step 1\nconnection lost\nstep 2\ndone\n"
    # Waiting is watching, not polling: a few requests for each change, not hundreds in 3 s.
    assert len(api.requests) - before < 40, len(api.requests) - before
    assert "dropped" in err and "reattaching" in err
    assert "waiting: its submitter pod is not created yet" in err and "is starting (ContainerCreating)" in err
    assert f"the submitter was retried: following its new pod {name}-b" in err


def test_refusals_are_said_with_what_to_do(api, tmp_path, capsys):
    """A token without the permission (403: the verb and resource RBAC lacks), a namespace the stack
    did not deploy, and a run name given among the training options."""
    code, _, err = cli(capsys, "submit", "--kubeconfig", kubeconfig(tmp_path, api, "reader-token"), "--name", "x1", "--",
                       "--max-steps", "5")
    assert code == 1 and "reader may not list rayjobs.ray.io in namespace ray-train (HTTP 403, RBAC)" in err
    assert "ask the cluster's admin for a role that allows it" in err and "Traceback" not in err
    code, _, err = cli(capsys, "list", "--kubeconfig", kubeconfig(tmp_path, api), "--namespace", "elsewhere")
    assert code == 1 and "deploy the stack first" in err
    code, _, err = cli(capsys, "submit", "--kubeconfig", kubeconfig(tmp_path, api), "--name", "x2", "--", "--run-name", "y")
    assert code == 1 and "give it as submit --name NAME" in err
    assert not jobs_of(api)  # nothing was sent


def test_kubeconfig_failures_are_sentences(api, tmp_path, capsys, monkeypatch):
    """No such kubeconfig, an unknown context, an exec plugin that is not installed or fails, an
    endpoint nothing answers: each one line with its fix, no traceback."""
    import socket

    code, _, err = cli(capsys, "list", "--kubeconfig", str(tmp_path / "missing"))
    assert code == 1 and f"no kubeconfig at {tmp_path / 'missing'}: give --kubeconfig PATH" in err
    config = kubeconfig(tmp_path, api)
    code, _, err = cli(capsys, "list", "--kubeconfig", config, "--context", "prod")
    assert code == 1 and "no context 'prod'; its contexts: test" in err
    plugin = tmp_path / "kubeconfig-exec"
    for command in ("aws", str(tmp_path / "failing-plugin")):
        plugin.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "eks",
            "clusters": [{"name": "c", "cluster": {"server": api.url}}],
            "users": [{"name": "u", "user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": command,
                                                       "args": ["eks", "get-token", "--cluster-name", "trainer"]}}}],
            "contexts": [{"name": "eks", "context": {"cluster": "c", "user": "u"}}]}))
        monkeypatch.setenv("PATH", str(tmp_path))
        code, _, err = cli(capsys, "list", "--kubeconfig", str(plugin))
        monkeypatch.undo()
        if command == "aws":
            assert code == 1 and "runs 'aws' for its credentials, which is not installed or not on PATH (install the AWS CLI v2" in err
            (tmp_path / "failing-plugin").write_text("#!/bin/sh\necho 'could not get token: ExpiredToken' >&2\nexit 1\n")
            (tmp_path / "failing-plugin").chmod(0o755)
        else:
            assert code == 1 and "its exec plugin failed: exec: process returned 1. could not get token: ExpiredToken" in err
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    unreachable = tmp_path / "kubeconfig-unreachable"
    unreachable.write_text(Path(config).read_text().replace(api.url, f"http://127.0.0.1:{port}"))
    code, _, err = cli(capsys, "list", "--kubeconfig", str(unreachable))
    assert code == 1 and f"cannot reach the cluster's API server http://127.0.0.1:{port}" in err
    assert "-c endpointAccessCidrs=<your address>/32" in err and "Traceback" not in err


def test_client_certificates_and_the_kubeconfig_ca_over_tls(tmp_path, capsys, deployed_spec):
    """A kubeconfig that authenticates with a client certificate (kind, kubeadm clusters): the server
    here serves HTTPS with a certificate its CA signed and takes the user from the client
    certificate's CN, as the real server's x509 authenticator does; paths relative to the kubeconfig."""
    import time

    from tls import make_ca_and_certificates

    from ray_train_eks.charts import spec_settings
    from ray_train_eks.workload.code import SETTINGS_CONFIGMAP

    files = make_ca_and_certificates(tmp_path, server_name="127.0.0.1", client_name="trainer")
    server = FakeApiServer(tls=(files["server_cert"], files["server_key"], files["ca"]), certificate_users={"trainer": "*"},
                           tokens={})
    try:
        server.put({"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": SETTINGS_CONFIGMAP, "namespace": NAMESPACE},
                    "data": {"bucket": "raytraineks-bucket", "workload": spec_settings(deployed_spec)}})
        path = tmp_path / "kubeconfig-certs"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kind",
            "clusters": [{"name": "c", "cluster": {"server": server.url, "certificate-authority": "ca.pem"}}],
            "users": [{"name": "u", "user": {"client-certificate": "client.pem", "client-key": "client-key.pem"}}],
            "contexts": [{"name": "kind", "context": {"cluster": "c", "user": "u"}}]}))
        code, out, err = cli(capsys, "list", "--kubeconfig", str(path), "--region", "us-west-2")
        assert code == 0, err
        assert out.startswith("RUN")
        # A CA that did not sign the server's certificate: said at once (not retried), with what to check.
        (tmp_path / "other").mkdir()
        other = make_ca_and_certificates(tmp_path / "other", server_name="127.0.0.1", client_name="x")
        wrong = tmp_path / "kubeconfig-wrong-ca"
        wrong.write_text(path.read_text().replace("certificate-authority: ca.pem", f"certificate-authority: {other['ca']}"))
        started = time.monotonic()
        code, _, err = cli(capsys, "list", "--kubeconfig", str(wrong))
        assert code == 1 and f"the API server {server.url} did not prove who it is (certificate verify failed: " in err
        assert time.monotonic() - started < 10
        # Without the certificate the server does not know who calls: 401, said for a kubeconfig.
        path.write_text(path.read_text().replace("client-certificate: client.pem", "token: wrong"))
        code, _, err = cli(capsys, "list", "--kubeconfig", str(path))
        assert code == 1 and "does not know the identity of kubeconfig context 'kind' (HTTP 401)" in err
    finally:
        server.close()


def test_code_that_is_not_the_deployed_code_travels_with_its_job_named_by_its_hash(api, bucket, tmp_path, capsys):
    """The installed package's training code is what a job runs: where the deployed code differs, the
    job's pods mount a copy of their own, its ConfigMaps named by the code's hash (created once, so a
    second job of the same code reuses them)."""
    from ray_train_eks.workload.code import CODE_DIGEST_ANNOTATION, TRAINING_CODE_CONFIGMAP, files_digest
    from ray_train_eks.cli import installed_training_code

    stored = api.objects[("configmaps", NAMESPACE, TRAINING_CODE_CONFIGMAP)]
    api.update("configmaps", NAMESPACE, TRAINING_CODE_CONFIGMAP,
               metadata={**stored["metadata"], "annotations": {CODE_DIGEST_ANNOTATION: "0" * 16}})
    digest = files_digest(installed_training_code())
    code, out, err = cli(capsys, "submit", "--kubeconfig", kubeconfig(tmp_path, api), "--name", "x3", "--", "--max-steps", "5")
    assert code == 0, err
    copy = f"{TRAINING_CODE_CONFIGMAP}-{digest[:8]}"
    assert f"the job carries its own copy ({copy})" in out
    config_maps = {obj["metadata"]["name"]: obj for obj in api.of("configmaps") if obj["metadata"]["name"].startswith(copy)}
    assert copy in config_maps and all(obj["metadata"]["annotations"][CODE_DIGEST_ANNOTATION] == digest
                                       for obj in config_maps.values())
    shipped = {key.replace(".", "/", key.count(".") - 1): content for obj in config_maps.values() for key, content in obj["data"].items()}
    assert shipped == installed_training_code()
    job = jobs_of(api)[0]
    for group in (job["spec"]["rayClusterSpec"]["headGroupSpec"], *job["spec"]["rayClusterSpec"]["workerGroupSpecs"]):
        (volume,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "training-code"]
        assert sorted(source["configMap"]["name"] for source in volume["projected"]["sources"]) == sorted(config_maps)


def test_from_the_stack_with_the_users_aws_identity(api, capsys, monkeypatch):
    """The stack's ClusterName output, the cluster's endpoint and CA, and a token made as ``aws eks
    get-token`` makes it: a presigned STS GetCallerIdentity URL that signs the cluster's name in
    ``x-k8s-aws-id``, which the server here checks as EKS's authenticator would (the IAM side is EKS's)."""
    import boto3
    from botocore.stub import Stubber

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    # A machine booted 30 s ago (a CI runner): the monotonic clock starts near 0, and the first token
    # must be made all the same (it once waited for the clock to pass the 10-minute refresh).
    import time
    import types

    import ray_train_eks.cli.kube as kube_module

    monkeypatch.setattr(kube_module, "time", types.SimpleNamespace(**{**vars(time), "monotonic": lambda: 30.0}))
    seen: list[dict] = []

    def accept(token: str):
        if not token.startswith("k8s-aws-v1."):
            return None
        url = base64.urlsafe_b64decode(token.removeprefix("k8s-aws-v1.") + "==").decode()
        query = {key: values[0] for key, values in parse_qs(urlparse(url).query).items()}
        seen.append({"host": urlparse(url).netloc, **query})
        return ("arn:aws:iam::111122223333:role/trainer", "*") if "x-k8s-aws-id" in query["X-Amz-SignedHeaders"] else None

    api.accept = accept
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nunused over http\n-----END CERTIFICATE-----\n").decode()
    responses = {
        "cloudformation": ("describe_stacks", {"Stacks": [{"StackName": "RayTrainEks", "CreationTime": "2026-12-01T00:00:00Z",
                                                           "StackStatus": "CREATE_COMPLETE",
                                                           "Outputs": [{"OutputKey": "ClusterName", "OutputValue": "trainer"}]}]},
                           {"StackName": "RayTrainEks"}),
        "eks": ("describe_cluster", {"cluster": {"name": "trainer", "endpoint": api.url, "certificateAuthority": {"data": ca}}},
                {"name": "trainer"}),
        "sts": ("get_caller_identity", {"Arn": "arn:aws:sts::111122223333:assumed-role/trainer/me", "Account": "111122223333",
                                        "UserId": "AROA:me"}, {}),
    }
    real_session = boto3.Session

    class StubbedSession(real_session):
        def client(self, name, **kwargs):
            client = super().client(name, **kwargs)
            if name in responses and not (name == "sts" and kwargs.get("region_name")):  # the token's STS client sends nothing
                stubber = Stubber(client)
                method, response, expected = responses[name]
                stubber.add_response(method, response, expected)
                stubber.activate()
            return client

    monkeypatch.setattr(boto3, "Session", StubbedSession)
    code, out, err = cli(capsys, "list", "--region", "us-west-2")
    assert code == 0, err
    assert seen and seen[0]["host"] == "sts.us-west-2.amazonaws.com" and seen[0]["Action"] == "GetCallerIdentity"
    assert seen[0]["X-Amz-Expires"] == "60"
    # An identity the cluster does not map (no access entry): EKS answers 401; the message says which
    # identity, the access entry to add and the stack's admin-role setting.
    api.accept = lambda token: None
    code, _, err = cli(capsys, "list", "--region", "us-west-2")
    assert code == 1 and "HTTP 401" in err
    assert "the cluster trainer does not let arn:aws:sts::111122223333:assumed-role/trainer/me in" in err
    # The access entry takes the role's ARN, not the assumed-role session's.
    assert "-c trainerRoleArns=arn:aws:iam::111122223333:role/trainer" in err
    assert ("aws eks create-access-entry --cluster-name trainer --principal-arn arn:aws:iam::111122223333:role/trainer "
            "--kubernetes-groups ray-train-eks:trainers") in err
    assert "--policy-arn arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy --access-scope type=cluster" in err


def test_the_command_is_installed_with_the_package():
    """pyproject.toml's console script: ``ray-train-eks`` on the venv's PATH runs the module."""
    script = Path(sys.executable).parent / "ray-train-eks"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "submit" in result.stdout and "stop" in result.stdout


def test_the_trainer_role_is_enough_for_every_command(api, bucket, kuberay_finalizer, tmp_path, capsys):
    """A trainer with exactly the Role the stack binds (workload/trainer_access.py TRAINER_RULES),
    enforced verb by verb by the server: submit, list, status, logs, stop and resume all work."""
    from ray_train_eks.workload.trainer_access import TRAINER_RULES

    allowed = {f"{verb} {resource}" for _, resources, verbs in TRAINER_RULES for resource in resources for verb in verbs}
    api.tokens["trainer-token"] = ("trainer", allowed)
    config = kubeconfig(tmp_path, api, "trainer-token")
    assert cli(capsys, "submit", "--kubeconfig", config, "--name", "least", "--", "--max-steps", "5")[0] == 0
    job = jobs_of(api)[0]["metadata"]["name"]
    submitter_pod(api, job, "x", later(1), log="step 1\n")
    for command in (("list",), ("status", "least"), ("logs", "least"), ("stop", "least")):
        code, _, err = cli(capsys, *command, "--kubeconfig", config)
        assert code == 0, (command, err)
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--resume", "least", "--", "--max-steps", "8")
    assert code == 0, err
    assert not [q for q in api.queries if "secrets" in q[1]]  # nothing beyond the Role was even asked


def test_aws_side_failures_are_sentences(capsys, monkeypatch, tmp_path):
    """No region anywhere, no credentials, a stack name that does not exist: one line each with the fix."""
    import boto3
    from botocore.stub import Stubber

    for variable in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    code, _, err = cli(capsys, "list")
    assert code == 1 and "no AWS region: give --region (the stack's), or set AWS_REGION" in err
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    real_session = boto3.Session

    class StubbedSession(real_session):
        def client(self, name, **kwargs):
            client = super().client(name, **kwargs)
            if name == "cloudformation":
                stubber = Stubber(client)
                stubber.add_client_error("describe_stacks", "ValidationError", "Stack with id Nope does not exist", 400)
                stubber.activate()
            return client

    monkeypatch.setattr(boto3, "Session", StubbedSession)
    code, _, err = cli(capsys, "status", "x", "--region", "eu-west-1", "--stack", "Nope")
    assert code == 1 and "no stack Nope in eu-west-1: name the deployed stack with --stack NAME" in err
    assert "Traceback" not in err

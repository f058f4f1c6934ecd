"""``ray-train-eks`` (ray_train_eks/cli.py) against a stand-in API server that refuses what the real
one refuses (tests/fake_apiserver.py: tokens, permissions, namespaces, names, the KubeRay CRD
schemas), with the settings the stack writes into the cluster; the AWS calls (CloudFormation, EKS,
STS) through botocore's Stubber, the token made offline as ``aws eks get-token`` makes it."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
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
    from ray_train_eks.charts.code import CODE_DIGEST_ANNOTATION, SETTINGS_CONFIGMAP, TRAINING_CODE_CONFIGMAP, files_digest
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


def test_two_submits_of_different_options_are_two_jobs_listed_and_one_stopped(api, bucket, tmp_path, capsys):
    """The second waits for the first to end: both would ask for every GPU node and, started together,
    each hold one and wait for the other forever."""
    config = kubeconfig(tmp_path, api)
    for name, rate in (("lr-high", "3e-5"), ("lr-low", "1e-5")):
        code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--name", name, "--", "--learning-rate", rate)
        if name == "lr-low":  # refused while lr-high is active, then taken once it has ended
            assert code == 1 and "the GPU nodes are taken: lr-high-" in err and "(created, run lr-high)" in err
            first = next(obj for key, obj in api.objects.items() if key[0] == "rayjobs")
            first["status"] = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
            code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--name", name, "--", "--learning-rate", rate)
        assert code == 0, err
        assert f"submitted run {name}: RayJob {NAMESPACE}/{name}-" in out and "9.20 USD/hour for its 2 x g6.12xlarge" in out
    jobs = {key[2]: obj for key, obj in api.objects.items() if key[0] == "rayjobs"}
    assert len(jobs) == 2 and {obj["metadata"]["labels"]["ray-train-eks/run"] for obj in jobs.values()} == {"lr-high", "lr-low"}
    policies = [key for key in api.objects if key[0] == "networkpolicies"]
    assert len(policies) == 4  # each job's cluster has its own
    # The same run again (the first one ended too): refused by the server (409), said plainly.
    for obj in [obj for key, obj in api.objects.items() if key[0] == "rayjobs"]:
        obj["status"] = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--name", "lr-low", "--", "--learning-rate", "1e-5")
    assert code == 1 and "exists already" in err
    code, out, _ = cli(capsys, "list", "--kubeconfig", config)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "STATE", "STEP", "LOSS", "AGE", "COST", "SO", "FAR", "RAYJOB"]
    assert [line.split()[0] for line in lines[1:]] == ["lr-high", "lr-low"]
    code, out, _ = cli(capsys, "stop", "--kubeconfig", config, "lr-high")
    assert code == 0 and "stopped run lr-high" in out and "its checkpoints stay" in out
    assert [obj["metadata"]["labels"]["ray-train-eks/run"] for key, obj in api.objects.items() if key[0] == "rayjobs"] == ["lr-low"]
    code, _, err = cli(capsys, "stop", "--kubeconfig", config, "lr-high")
    assert code == 1 and "no run 'lr-high'" in err


def test_list_and_status_show_each_runs_progress_from_its_own_records(api, bucket, tmp_path, capsys):
    """The step of max steps, the last loss and eval loss, tokens/s and an ETA, read from the records
    the training writes into the bucket (its run log, training/telemetry/runlog.py, run here as rank 0
    runs it), beside the RayJob's state."""
    from training.telemetry.runlog import RunLog

    config = kubeconfig(tmp_path, api)
    assert cli(capsys, "submit", "--kubeconfig", config, "--name", "lr-low", "--", "--max-steps", "100")[0] == 0
    job = next(obj for key, obj in api.objects.items() if key[0] == "rayjobs")
    job["status"] = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}  # what KubeRay sets once it runs
    log = RunLog(f"s3://{bucket}/runs/lr-low", resume_step=0, about={"run_name": "lr-low", "max_steps": 100}, log=lambda _: None)
    for step in range(1, 41):
        log.record({"step": step, "loss": 2.0 - step / 100, "eval_loss": 1.7 if step == 40 else None, "tokens_per_s": 5000.0,
                    "step_seconds": 3.0, "time": 0.0})
    log.flush()
    log.close()
    code, out, _ = cli(capsys, "list", "--kubeconfig", config)
    assert code == 0
    assert out.splitlines()[1].split()[:4] == ["lr-low", "running", "40/100", "1.6000"]
    code, out, _ = cli(capsys, "status", "--kubeconfig", config, "lr-low")
    assert code == 0
    assert "run lr-low: running, RayJob ray-train/lr-low-" in out
    assert "step 40 of 100, loss 1.6000, eval loss 1.7000, 5,000 tokens/s, about 3 min to go" in out  # 60 steps x 3 s
    assert f"final model: s3://{bucket}/runs/lr-low/final/" in out


def test_with_kueue_a_second_job_queues_instead_of_being_refused(api, bucket, deployed_spec, tmp_path, capsys):
    """A platform deployed with -c queueing=kueue: each job is labelled with the queue and created
    suspended, and waits for Kueue to admit it whole; list says queued."""
    import dataclasses

    from ray_train_eks.charts import spec_settings
    from ray_train_eks.charts.code import SETTINGS_CONFIGMAP

    queued = dataclasses.replace(deployed_spec, queue_name="ray-train-eks")
    api.objects[("configmaps", NAMESPACE, SETTINGS_CONFIGMAP)]["data"]["workload"] = spec_settings(queued)
    config = kubeconfig(tmp_path, api)
    for name in ("first", "second"):
        code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--name", name, "--", "--max-steps", "50")
        assert code == 0, err
        assert "queued in ray-train-eks (Kueue admits it whole when the GPU nodes are free, oldest first)" in out
    jobs = [obj for key, obj in api.objects.items() if key[0] == "rayjobs"]
    assert {job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] for job in jobs} == {"ray-train-eks"}
    assert all(job["spec"]["suspend"] is True for job in jobs)
    code, out, _ = cli(capsys, "list", "--kubeconfig", config)
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [["first", "queued"], ["second", "queued"]]


def test_stop_then_resume_submits_the_run_again_with_its_options(api, bucket, tmp_path, capsys):
    """submit keeps the run's options beside its checkpoints; after stop (the RayJob is gone),
    submit --resume submits the same run (the same --run-name, so the training resumes from its last
    checkpoint: tests/training/test_end_to_end.py runs that entrypoint) with them, and what is given
    now changes them."""
    config = kubeconfig(tmp_path, api)
    assert cli(capsys, "submit", "--kubeconfig", config, "--name", "dolly", "--", "--learning-rate", "1e-5", "--max-steps", "100")[0] == 0
    first = next(obj for key, obj in api.objects.items() if key[0] == "rayjobs")["spec"]["entrypoint"]
    assert cli(capsys, "stop", "--kubeconfig", config, "dolly")[0] == 0
    code, out, err = cli(capsys, "submit", "--kubeconfig", config, "--resume", "dolly", "--", "--max-steps", "200")
    assert code == 0, err
    again = next(obj for key, obj in api.objects.items() if key[0] == "rayjobs")["spec"]["entrypoint"]
    assert again == first.replace("--max-steps 100 --run-name dolly", "--max-steps 100 --max-steps 200 --run-name dolly")
    code, _, err = cli(capsys, "submit", "--kubeconfig", config, "--resume", "never-submitted")
    assert code == 1 and "the run was not submitted by ray-train-eks" in err


def test_logs_print_the_submitter_pods_output(api, bucket, tmp_path, capsys):
    """KubeRay's submitter (a Job of the RayJob's name, K8sJobMode) follows the Ray job's logs: its
    newest pod's log is the training's output."""
    config = kubeconfig(tmp_path, api)
    assert cli(capsys, "submit", "--kubeconfig", config, "--name", "lr-low", "--", "--max-steps", "100")[0] == 0
    job = next(obj for key, obj in api.objects.items() if key[0] == "rayjobs")["metadata"]["name"]
    code, _, err = cli(capsys, "logs", "--kubeconfig", config, "lr-low")
    assert code == 1 and "its submitter pod has not started yet" in err
    for name, created, text in (("old", "2026-12-03T08:00:00Z", "a retried submitter\n"),
                                ("new", "2026-12-03T09:00:00Z", "[train] step 1/100 loss 2.0\n[train] step 2/100 loss 1.9\n")):
        api.put({"kind": "Pod", "apiVersion": "v1", "log": text,
                 "metadata": {"name": f"{job}-{name}", "namespace": NAMESPACE, "creationTimestamp": created,
                              "labels": {"batch.kubernetes.io/job-name": job}}})
    code, out, _ = cli(capsys, "logs", "--kubeconfig", config, "lr-low", "-f")
    assert code == 0 and out == "[train] step 1/100 loss 2.0\n[train] step 2/100 loss 1.9\n"
    assert ("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{job}-new/log") in api.requests


def test_refusals_are_said_with_what_to_do(api, tmp_path, capsys):
    """A token without the permission (403), a namespace the stack did not deploy, training code
    that is not the deployed code, and a run name given among the training options."""
    code, _, err = cli(capsys, "submit", "--kubeconfig", kubeconfig(tmp_path, api, "reader-token"), "--name", "x1", "--",
                       "--max-steps", "5")
    assert code == 1 and 'HTTP 403 rayjobs is forbidden: User "reader" cannot list resource "rayjobs"' in err
    assert "ask the cluster's admin for access" in err
    code, _, err = cli(capsys, "list", "--kubeconfig", kubeconfig(tmp_path, api), "--namespace", "elsewhere")
    assert code == 1 and "deploy the stack first" in err
    code, _, err = cli(capsys, "submit", "--kubeconfig", kubeconfig(tmp_path, api), "--name", "x2", "--", "--run-name", "y")
    assert code == 1 and "give it as submit --name NAME" in err
    assert not [key for key in api.objects if key[0] == "rayjobs"]  # nothing was sent


def test_code_that_is_not_the_deployed_code_travels_with_its_job_named_by_its_hash(api, bucket, tmp_path, capsys):
    """The installed package's training code is what a job runs: where the deployed code differs, the
    job's pods mount a copy of their own, its ConfigMaps named by the code's hash (created once, so a
    second job of the same code reuses them)."""
    from ray_train_eks.charts.code import CODE_DIGEST_ANNOTATION, TRAINING_CODE_CONFIGMAP, files_digest
    from ray_train_eks.cli import installed_training_code

    api.objects[("configmaps", NAMESPACE, TRAINING_CODE_CONFIGMAP)]["metadata"]["annotations"][CODE_DIGEST_ANNOTATION] = "0" * 16
    digest = files_digest(installed_training_code())
    code, out, err = cli(capsys, "submit", "--kubeconfig", kubeconfig(tmp_path, api), "--name", "x3", "--", "--max-steps", "5")
    assert code == 0, err
    copy = f"{TRAINING_CODE_CONFIGMAP}-{digest[:8]}"
    assert f"the job carries its own copy ({copy})" in out
    config_maps = {key[2]: obj for key, obj in api.objects.items() if key[0] == "configmaps" and key[2].startswith(copy)}
    assert copy in config_maps and all(obj["metadata"]["annotations"][CODE_DIGEST_ANNOTATION] == digest
                                       for obj in config_maps.values())
    shipped = {key.replace(".", "/", key.count(".") - 1): content for obj in config_maps.values() for key, content in obj["data"].items()}
    assert shipped == installed_training_code()
    job = next(obj for key, obj in api.objects.items() if key[0] == "rayjobs")
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
            if name in responses and "endpoint_url" not in kwargs:  # the token's STS client sends nothing
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
    assert "the cluster does not let arn:aws:sts::111122223333:assumed-role/trainer/me in" in err
    assert "aws eks create-access-entry --cluster-name trainer" in err and "-c adminRoleArn=" in err


def test_the_command_is_installed_with_the_package():
    """pyproject.toml's console script: ``ray-train-eks`` on the venv's PATH runs the module."""
    script = Path(sys.executable).parent / "ray-train-eks"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "submit" in result.stdout and "stop" in result.stdout

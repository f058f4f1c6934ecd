"""The tracker as the network and the server fail it, against the real MLflow server the tests run
(tests/training/mlflow_server.py), each failure injected by a proxy between them
(tests/training/fault_proxy.py): a server that accepts and never answers, a 503 with ``Retry-After``,
an answer that comes after the client's timeout though the server did the work, a 403 with IAM's
words. The run's end stays within its wait in all; nothing is created or logged twice; a resume that
cannot read its MLflow run makes no second one; a refusal names the role and the action."""

from __future__ import annotations

import json
import time

import pytest
from fault_proxy import Fault, FaultProxy

from training.config import ConfigError, parse_config
from training.telemetry import tracker_calls, tracking

#: One request's timeout here, and the pause between tries (the defaults, 10 s and 2 s, scaled down).
TIMEOUT_S, BACKOFF_S = "1", 0.2


@pytest.fixture
def proxy(mlflow_server):
    """The proxy in front of the MLflow server."""
    found = FaultProxy(mlflow_server.url)
    yield found
    found.close()


def short_requests(monkeypatch) -> None:
    """From here on a request times out after 1 s and a call is tried again after 0.2 s (set only around
    the fault: on a loaded machine the server's real answers may take longer)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", TIMEOUT_S)
    monkeypatch.setattr(tracker_calls, "BACKOFF_S", BACKOFF_S)


def fault_over(proxy, monkeypatch) -> None:
    """The fault gone and requests back to MLflow's 10 s timeout, for the test's own look at the server."""
    proxy.clear()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def _config(tmp_path, uri: str, name: str, *extra: str):
    return parse_config(["--preset", "tiny-cpu", "--storage-path", str(tmp_path), "--run-name", name, "--tracking-uri", uri,
                         "--experiment-name", "faults", *extra])


def _steps(tmp_path, name: str, count: int) -> None:
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss": 1.0 / step, "time": 1.0}) + "\n"
                                                           for step in range(1, count + 1)))


def _loss_steps(mlflow_server, run_id: str) -> list[int]:
    return sorted(metric.step for metric in mlflow_server.client().get_metric_history(run_id, "loss"))


def _timed_finish(opened, run_folder, *, steps: int, register_as: str) -> tuple[dict, float, list[str]]:
    """The run's end as the driver calls it: what it returned, the seconds it took and what it said."""
    said: list[str] = []
    started = time.monotonic()
    outcome = opened.finish("FINISHED", run_folder=str(run_folder), summary={"final_model": "s3://b/final", "steps": steps},
                            register_as=register_as, log=said.append)
    return outcome, time.monotonic() - started, said


@pytest.mark.parametrize("fault", [Fault("stall"), Fault("status", status=503, headers={"Retry-After": "25"})],
                         ids=["accepts-and-never-answers", "503-retry-after-25"])
def test_the_runs_end_against_a_tracker_that_does_not_answer_stays_within_its_wait_in_all(
        proxy, mlflow_server, tmp_path, monkeypatch, fault):
    """The backfill, the artifacts, the registered model and the status share one wait (here 4 s, 60 s by
    default), not one each; a 503's Retry-After is not slept; what was not logged is said once."""
    monkeypatch.setattr(tracking, "FINISH_WAIT_S", 4)
    config = _config(tmp_path, proxy.url, f"end-{fault.how}", "--register-model", "never")
    opened = tracking.RunTracking.open(config, str(tmp_path / config.run_name))
    _steps(tmp_path, config.run_name, 3)
    short_requests(monkeypatch)
    proxy.add(fault)
    _, took, said = _timed_finish(opened, tmp_path / config.run_name, steps=3, register_as="never")
    print(f"the run's end against a tracker that {fault.how}s: {took:.1f} s (wait 4 s, requests 1 s)")
    assert took < 4 + 3, said  # the wait, and a margin for a loaded machine (it took 15 s and more before)
    assert any(f"the tracker did not answer within 4 s: MLflow run {opened.run_id}" in line for line in said), said
    fault_over(proxy, monkeypatch)
    assert mlflow_server.client().get_run(opened.run_id).info.status == "RUNNING"  # left as it was


def test_the_runs_end_against_a_slow_tracker_with_a_backlog_of_steps_stays_within_its_wait(
        proxy, mlflow_server, tmp_path, monkeypatch):
    """A tracker that answers every request, each in 0.5 s (under the 1 s timeout: each answer comes), and 30
    batches of steps rank 0 could not log (here a step a batch; a run whose tracker was away has tens of
    batches of 1,000 metrics): the backfill stops between batches at the end's wait (here 3 s), no request
    goes out that could not end in it, and the registry's wait for a version is the time left."""
    monkeypatch.setattr(tracking, "FINISH_WAIT_S", 3)
    monkeypatch.setattr(tracking, "MAX_METRICS", 1)
    config = _config(tmp_path, proxy.url, "slow-end", "--register-model", "slow")
    opened = tracking.RunTracking.open(config, str(tmp_path / config.run_name))
    _steps(tmp_path, config.run_name, 30)
    short_requests(monkeypatch)
    proxy.add(Fault("late", delay_s=0.5))
    outcome, took, said = _timed_finish(opened, tmp_path / config.run_name, steps=30, register_as="slow")
    print(f"the run's end against a tracker that answers in 0.5 s, 30 batches behind: {took:.1f} s (wait 3 s)")
    assert took < 3 + 1, said  # the wait, and a margin for a loaded machine (15 s and more before)
    assert any("no time left for LogBatch" in line for line in said), said
    fault_over(proxy, monkeypatch)
    assert 0 < len(_loss_steps(mlflow_server, opened.run_id)) < 30, outcome  # some logged, the rest left in metrics.jsonl


def test_the_runs_end_waits_for_a_presigned_upload_that_never_ends_only_until_its_wait(mlflow_server, tmp_path, monkeypatch):
    """sagemaker-mlflow PUTs an artifact to its presigned URL through MLflow's ``cloud_storage_http_request``
    (no timeout, 5 retries: MLflow's HTTP settings do not reach it). Here the upload stands in as a call that
    does not return for 30 s: the end waits for it until its wait (3 s) is spent, says so, and ends."""
    import threading

    monkeypatch.setattr(tracking, "FINISH_WAIT_S", 3)
    config = _config(tmp_path, mlflow_server.url, "presigned-hangs")
    opened = tracking.RunTracking.open(config, str(tmp_path / config.run_name))
    (tmp_path / config.run_name / "run.json").write_text("{}")
    opened.presigned_uploads = True
    short_requests(monkeypatch)
    monkeypatch.setattr(opened.client, "log_artifact", lambda *args: threading.Event().wait(30))
    said = []
    started = time.monotonic()
    opened.finish("FINISHED", run_folder=str(tmp_path / config.run_name), summary=None, log=said.append)
    took = time.monotonic() - started
    assert took < 3 + 1, said
    assert any("LogArtifact had not ended at the deadline" in line for line in said), said


def test_a_create_answered_after_the_timeout_makes_one_mlflow_run(proxy, mlflow_server, tmp_path, monkeypatch):
    """The server makes the run but its answer comes after the client's timeout (a slow but successful
    create): the run is looked for by its tag before a second create, so the experiment has one run, the
    one mlflow_run.json names."""
    short_requests(monkeypatch)
    proxy.add(Fault("late", method="POST", path="/runs/create$", delay_s=1.6, times=1))
    config = _config(tmp_path, proxy.url, "late-create")
    opened = tracking.RunTracking.open(config, str(tmp_path / config.run_name))
    fault_over(proxy, monkeypatch)
    made = [run for run in mlflow_server.runs("faults") if run.data.tags.get("ray-train-eks.run_folder") == str(tmp_path / "late-create")]
    assert [run.info.run_id for run in made] == [opened.run_id]
    assert json.loads((tmp_path / "late-create" / tracking.RUN_RECORD).read_text())["run_id"] == opened.run_id


def test_a_create_a_gateway_gave_up_on_while_the_server_made_it_makes_one_mlflow_run(proxy, mlflow_server, tmp_path,
                                                                                      monkeypatch):
    """A load balancer in front of the tracker (SageMaker's MLflow, most self-hosted servers) answers the create
    with a 504 while the server is still making the run (here it reaches the server 1.5 s later): the create
    was sent and its answer never came, so the run is looked for until it shows, never created again. One
    create, one run, the one mlflow_run.json names. (502 and 408 are read alike: tests/training/test_tracking.py.)"""
    short_requests(monkeypatch)
    proxy.add(Fault("gateway", method="POST", path="/runs/create$", status=504, delay_s=1.5, times=1))
    config = _config(tmp_path, proxy.url, "gateway")
    opened = tracking.RunTracking.open(config, str(tmp_path / config.run_name))
    fault_over(proxy, monkeypatch)
    assert [path for _, path in proxy.seen].count("/api/2.0/mlflow/runs/create") == 1  # (before: 2, two runs)
    made = [run for run in mlflow_server.runs("faults") if run.data.tags.get("ray-train-eks.run_folder") ==
            str(tmp_path / config.run_name)]
    assert [run.info.run_id for run in made] == [opened.run_id]


def test_a_batch_of_steps_answered_after_the_timeout_is_not_logged_twice(proxy, mlflow_server, tmp_path, monkeypatch):
    """At the end the driver logs the steps rank 0 could not; the server logs the batch but answers too
    late: the tracker is asked whether it took the steps before they are sent again. Each step once, in one
    request (MLflow's sqlite store drops a repeated identical metric, so the requests are what is counted)."""
    config = _config(tmp_path, proxy.url, "late-batch")
    opened = tracking.RunTracking.open(config, str(tmp_path / config.run_name))
    _steps(tmp_path, config.run_name, 6)
    short_requests(monkeypatch)
    proxy.add(Fault("late", method="POST", path="/runs/log-batch$", delay_s=1.6, times=1))
    before = len(proxy.seen)
    outcome = opened.finish("FINISHED", run_folder=str(tmp_path / config.run_name), summary=None)
    fault_over(proxy, monkeypatch)
    assert outcome["steps_logged_late"] == 6 and "tracking_errors" not in outcome, outcome
    assert [path for method, path in proxy.seen[before:] if path.endswith("/runs/log-batch")] == ["/api/2.0/mlflow/runs/log-batch"]
    assert _loss_steps(mlflow_server, opened.run_id) == [1, 2, 3, 4, 5, 6]


def test_replayed_steps_are_not_logged_twice_when_rank_0_cannot_read_which_the_tracker_has(proxy, mlflow_server, tmp_path,
                                                                                           monkeypatch):
    """A restart from step 4's checkpoint after an attempt that logged steps 1 to 6: the tracker cannot say
    which steps it has (503) when rank 0 starts; rank 0 sends nothing until it can, then steps 7 and 8
    only. Each step once, though 5 and 6 were trained twice."""
    config = _config(tmp_path, mlflow_server.url, "replayed")
    opened = tracking.RunTracking.open(config, str(tmp_path / config.run_name))
    from mlflow.entities import Metric

    mlflow_server.client().log_batch(opened.run_id, metrics=[Metric("loss", 1.0 / step, 0, step) for step in range(1, 7)])
    proxy.add(Fault("status", method="GET", path="/metrics/get-history", status=503))
    said = []
    sender = tracking.StepTracker(tracking.client_for(proxy.url), opened.run_id, after_step=4, ask_tracker=True,
                                      uri=proxy.url, log=said.append, ask_again_s=0.3)
    for step in range(5, 9):
        sender.step({"step": step, "loss": 0.5 / step, "time": 2.0})
    time.sleep(1.0)  # the question fails meanwhile
    fault_over(proxy, monkeypatch)
    sender.close(timeout_s=10)
    assert _loss_steps(mlflow_server, opened.run_id) == list(range(1, 9))
    assert said and "no step is logged from rank 0 until it answers" in said[0]


def test_a_resume_whose_mlflow_run_cannot_be_read_goes_on_untracked_and_keeps_its_record(proxy, mlflow_server, tmp_path,
                                                                                         monkeypatch):
    """mlflow_run.json names the run; reopening it meets a 503 (not "does not exist"): no second MLflow
    run, the record untouched, the line says why. A run the tracker says does not exist is made anew."""
    config = _config(tmp_path, proxy.url, "resumed")
    first = tracking.RunTracking.open(config, str(tmp_path / config.run_name))
    record = (tmp_path / "resumed" / tracking.RUN_RECORD).read_text()
    short_requests(monkeypatch)
    monkeypatch.setattr(tracking, "OPEN_WAIT_S", 3)  # 20 s by default
    proxy.add(Fault("status", method="GET", path="/runs/get", status=503))
    said = []
    assert tracking.RunTracking.open(config, str(tmp_path / config.run_name), log=said.append) is None
    fault_over(proxy, monkeypatch)
    assert (tmp_path / "resumed" / tracking.RUN_RECORD).read_text() == record
    assert [r.info.run_id for r in mlflow_server.runs("faults") if r.data.tags.get("ray-train-eks.run_folder") ==
            str(tmp_path / "resumed")] == [first.run_id]
    assert "no tracking" in said[-1] and "GetRun" in said[-1]
    mlflow_server.client().delete_run(first.run_id)
    monkeypatch.setattr(tracking, "OPEN_WAIT_S", 20)  # room again for a 10 s request
    again = tracking.RunTracking.open(config, str(tmp_path / config.run_name), log=said.append)
    assert again.run_id != first.run_id and "was deleted: a new one" in said[-2]


#: What IAM says when it refuses a call (IAM User Guide, "Troubleshoot access denied error messages"),
#: as SageMaker's MLflow endpoint answers a SigV4 request whose role lacks the action.
IAM_DENIAL = ("User: arn:aws:sts::123456789012:assumed-role/ray-pods/botocore-session-1 is not authorized to perform: "
              "sagemaker:CallMlflowAppApi on resource: arn:aws:sagemaker:us-west-2:123456789012:mlflow-app/app-x "
              "because no identity-based policy allows the sagemaker:CallMlflowAppApi action")


@pytest.mark.parametrize("body, arn, expected", [
    (json.dumps({"message": IAM_DENIAL}).encode(), "arn:aws:sagemaker:us-west-2:123456789012:mlflow-app/app-x",
     "permission denied: arn:aws:sts::123456789012:assumed-role/ray-pods/botocore-session-1 may not "
     "sagemaker:CallMlflowAppApi on arn:aws:sagemaker:us-west-2:123456789012:mlflow-app/app-x (GetExperimentByName)"),
    (b"Forbidden", "arn:aws:sagemaker:us-west-2:123456789012:mlflow-tracking-server/team",
     "permission denied: arn:aws:iam::123456789012:role/ray-pods may not sagemaker-mlflow:GetExperimentByName on "
     "arn:aws:sagemaker:us-west-2:123456789012:mlflow-tracking-server/team (GetExperimentByName)"),
], ids=["app-with-iams-words", "tracking-server-bare-403"])
def test_a_refusal_is_said_as_a_permission_naming_the_role_and_the_action(proxy, tmp_path, monkeypatch, body, arn, expected):
    """The pods reach SageMaker's MLflow through the sagemaker-mlflow plugin (SigV4); the proxy answers
    every call 403 as SageMaker's endpoint does for a role without the action
    (``SAGEMAKER_MLFLOW_CUSTOM_ENDPOINT``: the plugin's own override of the endpoint). Where the answer
    does not name the identity, the pod's role is read from its environment (IRSA's AWS_ROLE_ARN)."""
    for key, value in {"SAGEMAKER_MLFLOW_CUSTOM_ENDPOINT": proxy.url, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ROLE_ARN": "arn:aws:iam::123456789012:role/ray-pods"}.items():
        monkeypatch.setenv(key, value)
    short_requests(monkeypatch)
    proxy.add(Fault("status", status=403, body=body, headers={"Content-Type": "application/json"}))
    said = []
    assert tracking.RunTracking.open(_config(tmp_path, arn, "refused"), str(tmp_path / "refused"), log=said.append) is None
    assert said[-1].startswith("the tracker refused the run: ") and expected in said[-1], said


def test_a_local_run_tracks_to_mlflows_default_store_and_a_cluster_run_refuses_one_on_the_drivers_disk(
        tmp_path, monkeypatch):
    """sqlite:///mlflow.db is MLflow 3.17's default store (mlflow/store/tracking/__init__.py
    DEFAULT_TRACKING_URI): a local run takes it (relative to where it starts, made absolute for the
    workers); a run whose workers are elsewhere (several nodes, or a Kubernetes pod) is refused before
    Ray starts, naming what it can reach."""
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, "sqlite:///mlflow.db", "local")
    opened = tracking.RunTracking.open(config, str(tmp_path / "local"))
    assert opened is not None and opened.uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert tracking.client_for(opened.uri).get_run(opened.run_id).info.run_name == "local"
    with pytest.raises(ConfigError) as spans:
        _config(tmp_path, "sqlite:///mlflow.db", "two-nodes", "--workers-per-node", "1")
    assert ("tracking_uri='sqlite:///mlflow.db' is a store on this machine's disk, but num_workers(2) / "
            "workers_per_node(1) spans 2 nodes") in str(spans.value)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.100.0.1")
    with pytest.raises(ConfigError) as pod:
        _config(tmp_path, "sqlite:///mlflow.db", "pod")
    assert "this runs in a Kubernetes pod: rank 0 logs each step from its own node" in str(pod.value)


@pytest.mark.parametrize("uri", ["postgresql://mlflow@db.internal:5432/mlflow", "mysql+pymysql://mlflow@db.internal/mlflow"])
def test_a_database_store_is_refused_before_ray_starts_where_rank_0_runs_on_another_node(tmp_path, monkeypatch, uri):
    """A database URI is fine for the driver (it has sqlalchemy and alembic), but rank 0, on its own node, has
    only MLflow's client in its runtime env: refused for a run on several nodes or in a pod, saying what to give."""
    with pytest.raises(ConfigError) as spans:
        _config(tmp_path, uri, "db-two-nodes", "--workers-per-node", "1")
    assert (f"tracking_uri={uri!r} is a database MLflow reaches directly, but num_workers(2) / workers_per_node(1) spans "
            "2 nodes") in str(spans.value) and "mlflow server --backend-store-uri" in str(spans.value)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.100.0.1")
    with pytest.raises(ConfigError) as pod:
        _config(tmp_path, uri, "db-pod")
    assert "but this runs in a Kubernetes pod: rank 0 logs each step from its own node" in str(pod.value)


def test_an_artifact_store_outside_the_training_bucket_is_written_through_presigned_urls_the_tracker_gives(
        proxy, mlflow_server, s3_server, tmp_path, monkeypatch):
    """A SageMaker MLflow App or tracking server (``-c mlflowTrackingUri=``) whose artifact store is another
    bucket, which the pods' role may not write: the driver says so before Ray starts and turns on
    sagemaker-mlflow's presigned uploads, so run.json and the summary go up through URLs the tracker
    presigns. The proxy answers the presign call as SageMaker's endpoint does (MLflow's own
    ``/api/2.0/mlflow/artifacts/presigned-upload-url``), presigning for moto's S3."""
    import boto3

    from mlflow.tracking import MlflowClient

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="mlflow-elsewhere")
    server = MlflowClient(tracking_uri=mlflow_server.url)  # the server's own view (not the process's tracking URI,
    server.create_experiment("elsewhere", artifact_location="s3://mlflow-elsewhere/mlflow")  # which the plugin signs for)

    def presign(method, path, body):
        asked = json.loads(body)
        artifacts = server.get_run(asked["run_id"]).info.artifact_uri
        key = f"{artifacts.removeprefix('s3://mlflow-elsewhere/')}/{asked['path']}"
        url = s3.generate_presigned_url("put_object", Params={"Bucket": "mlflow-elsewhere", "Key": key}, ExpiresIn=300)
        return 200, {"Content-Type": "application/json"}, json.dumps({"presigned_url": url, "headers": {}}).encode()

    proxy.add(Fault("answer", method="POST", path="/artifacts/presigned-upload-url$", respond=presign))
    monkeypatch.setenv("SAGEMAKER_MLFLOW_CUSTOM_ENDPOINT", proxy.url)
    monkeypatch.setenv(tracking.PRESIGNED_UPLOAD_ENV, "")  # restored (unset) after the test
    arn = "arn:aws:sagemaker:us-east-1:123456789012:mlflow-app/app-elsewhere"
    config = parse_config(["--preset", "tiny-cpu", "--storage-path", str(tmp_path), "--run-name", "elsewhere",
                           "--tracking-uri", arn, "--experiment-name", "elsewhere"])
    said = []
    opened = tracking.RunTracking.open(config, str(tmp_path / "elsewhere"), log=said.append)
    assert "outside the training bucket: artifacts upload through presigned URLs the tracker gives" in said[-1], said
    # Rank 0, a process of its own (the driver's environment is not its), logs an evaluation's samples so too.
    monkeypatch.setenv(tracking.PRESIGNED_UPLOAD_ENV, "")
    sender = tracking.step_tracker(opened.for_workers(), start_step=0)
    sender.samples(2, [{"prompt": "Reverse the words: a b", "completion": "b a"}])
    sender.close(timeout_s=30)
    (tmp_path / "elsewhere" / "run.json").write_text("{}")
    outcome = opened.finish("FINISHED", run_folder=str(tmp_path / "elsewhere"), summary={"steps": 0}, log=said.append)
    assert "tracking_errors" not in outcome, outcome
    keys = {o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects_v2(Bucket="mlflow-elsewhere")["Contents"]}
    assert keys == {"step-000002.jsonl", "run.json", "summary.json"}
    assert [path for _, path in proxy.seen].count("/api/2.0/mlflow/artifacts/presigned-upload-url") == 3

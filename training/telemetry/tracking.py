"""Experiment tracking with MLflow: one MLflow run per training run, whatever happens to it.

On when a tracking URI is given (``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, which the Ray pods
get from the stack: SageMaker's managed MLflow by its ARN, reached through the ``sagemaker-mlflow``
plugin with the pods' own AWS credentials; or any MLflow server; locally any store MLflow takes, its
default ``sqlite:///mlflow.db`` included). Who does what:

- **The driver** (:class:`RunTracking`) opens the MLflow run before Ray Train starts, in the
  platform's experiment (``--experiment-name``, else ``RAY_TRAIN_EKS_MLFLOW_EXPERIMENT``, one per
  stack), named as the run; its id is kept beside the checkpoints (``<run folder>/mlflow_run.json``),
  so Ray Train's restarts (failures, preemptions, hardware faults) and ``ray-train-eks submit
  --resume`` continue the same MLflow run (a new one only where the tracker says the recorded one does
  not exist; a tracker that cannot say leaves this invocation untracked, said, the record kept). It
  logs the training options and the plan's choices as parameters and the platform as tags; at the end
  it logs the steps the tracker lacks (from ``metrics.jsonl``, the record of truth), the curves,
  ``run.json`` and the summary as artifacts, registers the final model (``--register-model``: a version
  whose source is the model's folder in the bucket, nothing uploaded again), and ends the run FINISHED,
  FAILED or KILLED, all within :data:`FINISH_WAIT_S`.
- **Rank 0** (training/telemetry/step_tracker.py) logs each step's metrics with the step number from a
  thread of its own: a slow or unreachable tracker never holds a step, and no step is logged twice.

A tracker is a view of the run, never part of it: no call here raises into the training. MLflow's own
HTTP retries are off and each request is bounded; the retries are made here, none blindly
(training/telemetry/tracker_calls.py).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, Callable

from .step_tracker import (CLOSE_TIMEOUT_S, MAX_METRICS, QUEUE_STEPS, STEP_KEYS, StepTracker,  # noqa: F401 - public here
                           logged_steps, metrics_of, say, step_tracker)
from .tracker_calls import (PRESIGNED_UPLOAD_ENV, Calls, TrackerUnanswered, client_for, denied, describe,  # noqa: F401
                            not_found, request_timeout_s, unreachable)

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
EXPERIMENT_ENV = "RAY_TRAIN_EKS_MLFLOW_EXPERIMENT"
#: What the stack knows of the platform (instance type, node count, GPU type, image, code digest),
#: as JSON in the Ray pods' environment: the run's tags.
PLATFORM_ENV = "RAY_TRAIN_EKS_PLATFORM"
DEFAULT_EXPERIMENT = "ray-train-eks"
RUN_RECORD = "mlflow_run.json"
#: How long the driver's end may talk to the tracker, in all (the backfill, the artifacts, the registered
#: model, the status): a tracker away (a restart) is waited for that long; the job's GPU nodes are
#: released only after.
FINISH_WAIT_S = 60
#: How long opening the run may take before the run goes on untracked.
OPEN_WAIT_S = 20
#: A tag of each MLflow run this code creates, unique to the create: a create whose answer did not come is
#: looked for by it before it is tried again (no orphan run).
OPEN_TAG = "ray-train-eks.open_id"
#: MLflow takes at most 100 params per ``log_batch`` (its REST API's limits).
MAX_PARAMS = 100


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """Where a person sees the run: the server's UI page, or for SageMaker's managed MLflow the
    command that opens its UI (a presigned URL, valid for minutes)."""
    if uri.startswith("arn:"):
        kind = "app" if ":mlflow-app/" in uri else "tracking-server"
        name = uri.rsplit("/", 1)[-1]
        how = (f"aws sagemaker create-presigned-mlflow-app-url --arn {uri}" if kind == "app"
               else f"aws sagemaker create-presigned-mlflow-tracking-server-url --tracking-server-name {name}")
        return f"{how} (then experiment {experiment_id}, run {run_id})"
    if uri.startswith(("file:", "sqlite:")):
        return f"{uri} (experiment {experiment_id}, run {run_id}): make mlflow-ui"
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def platform_tags(environ=None) -> dict[str, str]:
    """The platform as tags: the stack's (``PLATFORM_ENV``) and this process's Ray and torch."""
    environ = os.environ if environ is None else environ
    tags = {f"platform.{key}": str(value) for key, value in json.loads(environ.get(PLATFORM_ENV) or "{}").items()}
    tags["platform.code_digest"] = code_digest()
    try:
        import ray
        import torch

        tags.update({"platform.ray": ray.__version__, "platform.torch": torch.__version__})
    except ImportError:
        pass
    return tags


def code_digest() -> str:
    """sha256 (16 hex digits) of the training package's Python files as this process runs them:
    which code trained, whatever shipped it (the ConfigMap, a runtime env, a local checkout)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _params(values: dict[str, Any]) -> dict[str, str]:
    """Training options as MLflow params (values as text, at most 6000 characters: MLflow's limit)."""
    return {key: (json.dumps(value) if not isinstance(value, str) else value)[:6000]
            for key, value in sorted(values.items()) if not key.startswith("_")}


class RunTracking:
    """The driver's side (see the module's text): open, hand to the workers, finish."""

    def __init__(self, client, uri: str, experiment_id: str, run_id: str, *, continued: bool,
                 artifact_uri: str | None = None) -> None:
        self.client, self.uri, self.experiment_id, self.run_id, self.continued = client, uri, experiment_id, run_id, continued
        self.url, self.artifact_uri = run_url(uri, experiment_id, run_id), artifact_uri
        #: Artifacts go up through presigned URLs (an artifact store outside the training bucket): :func:`artifact_route`.
        self.presigned_uploads = False

    @classmethod
    def open(cls, config, run_folder: str, *, log: Callable[[str], None] = say) -> "RunTracking | None":
        """The run's MLflow run, continued from ``<run_folder>/mlflow_run.json`` or new; None without
        a tracker, or when it cannot be used (said; the run goes on untracked)."""
        uri = local_store_uri(config.tracking_uri)
        if not uri:
            return None
        calls = Calls(time.monotonic() + OPEN_WAIT_S, log)
        try:
            client = client_for(uri)
            name = config.experiment_name or DEFAULT_EXPERIMENT
            experiment = calls.call("GetExperimentByName", lambda: client.get_experiment_by_name(name))
            experiment_id = experiment.experiment_id if experiment else _create_experiment(client, name, calls)
            tracking = (_continued(client, uri, run_folder, calls, log, config)
                        or _created(client, uri, experiment_id, run_folder, calls, config))
        except Exception as error:  # noqa: BLE001 - a tracker that cannot be used: the run goes on untracked
            why = describe(error, uri=uri, operation=calls.operation)
            log((f"the tracker refused the run: {why}" if denied(error) else
                 f"no tracking: the tracker at {uri} cannot be used ({why})") +
                "; the run goes on untracked, and metrics.jsonl keeps every step")
            return None
        log(f"MLflow run {tracking.run_id} ({'continued' if tracking.continued else 'new'}): {tracking.url}")
        tracking.presigned_uploads = artifact_route(tracking.artifact_uri, uri, config.storage_path, log) == "presigned"
        if tracking.presigned_uploads:
            client_for(uri, presigned_uploads=True)
        return tracking

    def for_workers(self) -> dict:
        """What rank 0 needs to log to the run (training/telemetry/step_tracker.py ``step_tracker``)."""
        return {"uri": self.uri, "run_id": self.run_id, "presigned_uploads": self.presigned_uploads}

    def finish(self, status: str, *, run_folder: str, summary: dict | None = None, register_as: str | None = None,
               log: Callable[[str], None] = say) -> dict:
        """End the MLflow run as ``status`` (FINISHED, FAILED, KILLED), after the steps it lacks, the
        artifacts and the registered model (not for KILLED: the job is being stopped, seconds count), all
        within :data:`FINISH_WAIT_S` (a KILLED run: one try of its status). Returns what the summary says
        of the tracking."""
        said: dict[str, Any] = {"mlflow_run_id": self.run_id, "mlflow_url": self.url}
        # KILLED: room for one try (and a second for the call's own work), none for another.
        calls = Calls(time.monotonic() + (request_timeout_s() + 1 if status == "KILLED" else FINISH_WAIT_S), log)
        parts = [] if status == "KILLED" else [self._backfill, self._artifacts, self._outcome, self._register]
        for part in [*parts, self._status]:
            try:
                said.update(part(run_folder=run_folder, summary=summary, register_as=register_as, calls=calls,
                                 status=status) or {})
            except Exception as error:  # noqa: BLE001 - the run's outputs stand whatever the tracker does
                problems = said.setdefault("tracking_errors", [])
                problems.append(f"{part.__name__.strip('_')}: {describe(error, uri=self.uri, operation=calls.operation)}")
                if calls.unanswered and not calls.room_for_a_request():
                    problems.append(f"the tracker did not answer within {FINISH_WAIT_S} s: MLflow run {self.run_id} is left "
                                    f"as it was; metrics.jsonl, the curves and summary.json in {run_folder} have it all")
                    break
        for problem in said.get("tracking_errors", []):
            log(f"MLflow run {self.run_id}: {problem}")
        return said

    def _status(self, *, calls: Calls, status: str, **_) -> dict:
        calls.call("UpdateRun", lambda: self.client.set_terminated(self.run_id, status))
        return {}

    def _backfill(self, *, run_folder: str, calls: Calls, **_) -> dict:
        """The steps of metrics.jsonl the tracker lacks (rank 0 could not send them), logged now, a batch of
        whole steps at a time; a batch whose answer did not come is looked for before it is sent again."""
        from ..storage.files import read_text
        from .runlog import METRICS_FILE, parse_lines

        have = calls.call("GetMetricHistory", lambda: logged_steps(self.client, self.run_id))
        missing = [record for record in parse_lines(read_text(f"{run_folder}/{METRICS_FILE}")) if record["step"] not in have]
        for batch in whole_steps(missing):
            steps = {metric.step for metric in batch}
            calls.call("LogBatch", lambda batch=batch: self.client.log_batch(self.run_id, metrics=batch),
                       landed=("GetMetricHistory", lambda steps=steps: steps <= logged_steps(self.client, self.run_id) or None))
        return {"steps_logged_late": len(missing)} if missing else {}

    def _artifacts(self, *, run_folder: str, summary: dict | None, calls: Calls, **_) -> dict:
        """run.json, curves.png and the summary (small files; the model is registered, not uploaded)."""
        import tempfile

        from ..storage.files import read_bytes
        from .runlog import CURVES_FILE, RUN_FILE

        with tempfile.TemporaryDirectory() as folder:
            for name in (RUN_FILE, CURVES_FILE):
                data = read_bytes(f"{run_folder}/{name}")
                if data:
                    with open(os.path.join(folder, name), "wb") as handle:
                        handle.write(data)
                    calls.call("LogArtifact", lambda name=name: self.client.log_artifact(self.run_id, os.path.join(folder, name)),
                               unbounded=self.presigned_uploads)
        if summary is not None:
            calls.call("LogArtifact", lambda: self.client.log_dict(self.run_id, summary, "summary.json"),
                       unbounded=self.presigned_uploads)
        return {}

    def _outcome(self, *, summary: dict | None, calls: Calls, **_) -> dict:
        """What was exported and why, why the run stopped early, the benchmark's scores against the base's,
        and what the run cost."""
        from mlflow.entities import RunTag

        if not summary:
            return {}
        tags, metrics = outcome_figures(summary)
        calls.call("LogBatch", lambda: self.client.log_batch(self.run_id, metrics=metrics[:MAX_METRICS],
                                                              tags=[RunTag(k, v[:5000]) for k, v in tags.items()]))
        return {}

    def _register(self, *, summary: dict | None, register_as: str | None, calls: Calls, **_) -> dict:
        """``--register-model NAME``: a new version of NAME whose source is the final model's folder (one:
        a create whose answer did not come is looked for first)."""
        if not register_as or not summary or not summary.get("final_model"):
            return {}
        from mlflow.exceptions import MlflowException

        def create_model():
            try:
                self.client.create_registered_model(register_as)
            except MlflowException as error:
                if error.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise

        def ours():
            found = self.client.search_model_versions(f"name='{register_as}' and run_id='{self.run_id}'")
            return next((v for v in found if v.source == summary["final_model"]), None)

        calls.call("CreateRegisteredModel", create_model)
        version = calls.call("CreateModelVersion", lambda: self.client.create_model_version(  # its wait for READY within the end's
            register_as, source=summary["final_model"], run_id=self.run_id, await_creation_for=await_for(calls)),
            landed=("SearchModelVersions", ours))
        return {"registered_model": f"{register_as} version {version.version}"}


#: How long the registry is waited for a new version to be READY (MLflow's ``await_creation_for``).
AWAIT_CREATION_S = 30


def await_for(calls: Calls) -> int:
    """The registry's wait for a new version (MLflow polls until then: ``mlflow/store/model_registry/
    abstract_store.py`` ``_await_model_version_creation_impl``), within what the end has left after the
    create's own request: at most :data:`AWAIT_CREATION_S`."""
    return max(0, min(AWAIT_CREATION_S, int(calls.deadline - time.monotonic() - request_timeout_s())))


def outcome_figures(summary: dict) -> tuple[dict, list]:
    """The summary's tags and metrics for the tracker: the export and its reason, an early stop, the
    benchmark against the base, the run's cost."""
    from mlflow.entities import Metric

    now, tags, metrics = int(time.time() * 1000), {}, []
    export = summary.get("export") or {}
    if export:
        tags.update({"export.which": export["which"], "export.step": str(export["step"]), "export.reason": export["reason"]})
        if export.get("eval_loss") is not None:
            metrics.append(Metric("exported_eval_loss", float(export["eval_loss"]), now, int(export["step"])))
    if summary.get("stopped_early"):
        tags["stopped_early"] = summary["stopped_early"]
    bench = summary.get("benchmarks") or {}
    if bench.get("error"):
        tags["benchmark.error"] = bench["error"][:5000]
    for prefix, table in (("bench", bench.get("scores")), ("bench_vs_base", bench.get("difference"))):
        for task, values in (table or {}).items():
            metrics += [Metric(metric_name(f"{prefix}.{task}.{name}"), float(value), now, 0) for name, value in values.items()]
    cost = summary.get("cost") or {}
    if cost.get("usd") is not None:
        metrics.append(Metric("cost_usd_final", float(cost["usd"]), now, int(summary.get("steps") or 0)))
        tags["cost.basis"] = cost.get("basis") or ""
    return tags, metrics


def whole_steps(records: list[dict]) -> list[list]:
    """metrics.jsonl records as ``log_batch`` batches of at most :data:`MAX_METRICS` metrics, no step split
    across two (a batch is logged whole or not at all: whether a step is in the tracker is one question)."""
    batches, batch = [], []
    for record in records:
        metrics = metrics_of(record)
        if batch and len(batch) + len(metrics) > MAX_METRICS:
            batches.append(batch)
            batch = []
        batch += metrics
    return batches + ([batch] if batch else [])


def metric_name(text: str) -> str:
    """``text`` as an MLflow metric name (letters, digits, ``_ - . / :`` and spaces; the rest become ``_``)."""
    import re

    return re.sub(r"[^A-Za-z0-9_\-./: ]", "_", text)


def local_store_uri(uri: str | None) -> str | None:
    """``uri`` with a relative local store (``file:mlruns``, ``sqlite:///mlflow.db``) made absolute: the
    workers' working directory is not the driver's."""
    if not uri:
        return None
    if ":" not in uri:  # a folder: MLflow's file store
        return "file:" + os.path.abspath(uri)
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file:" + os.path.abspath(uri[len("file:"):])
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////") and uri != "sqlite:///:memory:":
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    return uri


def artifact_route(artifact_uri: str | None, uri: str, storage_path: str, log: Callable[[str], None]) -> str | None:
    """How the run's artifacts reach a store outside the training bucket, said before Ray starts: through
    presigned URLs the tracker gives (a SageMaker MLflow App or tracking server, sagemaker-mlflow's
    :data:`PRESIGNED_UPLOAD_ENV`), else with the pods' own S3 access, which may not reach it. None where the
    store is the training bucket's, or not on S3."""
    if not artifact_uri or not artifact_uri.startswith("s3://"):
        return None
    bucket = artifact_uri[len("s3://"):].split("/", 1)[0]
    if storage_path.startswith(f"s3://{bucket}/") or storage_path == f"s3://{bucket}":
        return None
    if uri.startswith("arn:"):
        log(f"the tracker's artifact store {artifact_uri} is outside the training bucket: artifacts upload through "
            "presigned URLs the tracker gives, not with the pods' own S3 access")
        return "presigned"
    log(f"the tracker's artifact store {artifact_uri} is outside the training bucket: the run's artifacts (run.json, "
        f"curves, summary) upload with this process's own S3 access, which may not reach s3://{bucket}; serve "
        "artifacts through the server (mlflow server --serve-artifacts) or grant that access (metrics, params and "
        "the registered model are logged either way)")
    return "own access"


def _create_experiment(client, name: str, calls: Calls) -> str:
    """Create the experiment; another run may have made it meanwhile (two users at once)."""
    from mlflow.exceptions import MlflowException

    try:
        return calls.call("CreateExperiment", lambda: client.create_experiment(name),
                          landed=("GetExperimentByName", lambda: getattr(client.get_experiment_by_name(name), "experiment_id", None)))
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return calls.call("GetExperimentByName", lambda: client.get_experiment_by_name(name)).experiment_id


def _created(client, uri: str, experiment_id: str, run_folder: str, calls: Calls, config) -> "RunTracking":
    """A new MLflow run with the options as params, recorded beside the checkpoints; made once (a create
    whose answer did not come is looked for by its :data:`OPEN_TAG` before it is tried again)."""
    from ..storage.files import write_text

    opened = uuid.uuid4().hex
    tags = {**platform_tags(), "ray-train-eks.run_folder": run_folder, OPEN_TAG: opened}

    def made():
        found = client.search_runs([experiment_id], filter_string=f"tags.`{OPEN_TAG}` = '{opened}'", max_results=1)
        return found[0] if found else None

    run = calls.call("CreateRun", lambda: client.create_run(experiment_id, run_name=config.run_name, tags=tags),
                     landed=("SearchRuns", made))
    _log_params(client, run.info.run_id, _params(config.to_dict()), calls)
    write_text(f"{run_folder}/{RUN_RECORD}", json.dumps({"tracking_uri": uri, "experiment_id": experiment_id,
                                                          "run_id": run.info.run_id}, indent=2))
    return RunTracking(client, uri, experiment_id, run.info.run_id, continued=False, artifact_uri=run.info.artifact_uri)


def _continued(client, uri: str, run_folder: str, calls: Calls, log: Callable[[str], None], config) -> "RunTracking | None":
    """The MLflow run ``<run_folder>/mlflow_run.json`` names, reopened (RUNNING, a resume's new option values
    as tags: MLflow's params never change); None for a new one: no record, another tracker, or a run the
    tracker says does not exist or was deleted. Any other failure raises (the run goes on untracked, the
    record kept: one training run, one MLflow run)."""
    from ..storage.files import read_text

    record = json.loads(read_text(f"{run_folder}/{RUN_RECORD}") or "{}")
    if not record:
        return None
    if record.get("tracking_uri") != uri:
        log(f"the run was tracked at {record.get('tracking_uri')} (MLflow run {record.get('run_id')}); this invocation's "
            f"tracker is {uri}: a new MLflow run there")
        return None
    try:
        run = calls.call("GetRun", lambda: client.get_run(record["run_id"]))
    except Exception as error:  # noqa: BLE001 - sorted: only "does not exist" makes a new run
        if not not_found(error):
            raise
        log(f"MLflow run {record['run_id']} no longer exists on {uri}: a new one")
        return None
    if run.info.lifecycle_stage != "active":
        log(f"MLflow run {record['run_id']} was deleted: a new one")
        return None
    params = _params(config.to_dict())
    calls.call("UpdateRun", lambda: client.update_run(run.info.run_id, status="RUNNING"))
    _log_params(client, run.info.run_id, {k: v for k, v in params.items() if k not in run.data.params}, calls)
    for key, value in params.items():
        if key in run.data.params and run.data.params[key] != value:
            calls.call("SetTag", lambda key=key, value=value: client.set_tag(run.info.run_id, f"resumed_with.{key}", value[:5000]))
    return RunTracking(client, uri, run.info.experiment_id, run.info.run_id, continued=True,
                       artifact_uri=run.info.artifact_uri)


def _log_params(client, run_id: str, params: dict[str, str], calls: Calls) -> None:
    """Params in batches (logging one again with the same value is allowed: retried freely)."""
    from mlflow.entities import Param

    items = [Param(key, value) for key, value in params.items()]
    for start in range(0, len(items), MAX_PARAMS):
        calls.call("LogBatch", lambda start=start: client.log_batch(run_id, params=items[start:start + MAX_PARAMS]))

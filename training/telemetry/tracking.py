"""Experiment tracking with MLflow: one MLflow run per training run, whatever happens to it.

On when a tracking URI is given (``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, which the Ray pods
get from the stack: SageMaker's managed MLflow by its ARN, reached through the ``sagemaker-mlflow``
plugin with the pods' own AWS credentials; or any MLflow server). Who does what:

- **The driver** (:class:`RunTracking`) opens the MLflow run before Ray Train starts, in the
  platform's experiment (``--experiment-name``, else ``RAY_TRAIN_EKS_MLFLOW_EXPERIMENT``, one per
  stack), named as the run; its id is kept beside the checkpoints (``<run folder>/mlflow_run.json``),
  so Ray Train's restarts (failures, preemptions, hardware faults) and ``ray-train-eks submit
  --resume`` continue the same MLflow run. It logs the training options and the plan's choices
  as parameters and the platform as tags; at the end it logs the steps the tracker missed (from
  ``metrics.jsonl``, the record of truth), the curves, ``run.json`` and the summary as artifacts,
  registers the final model (``--register-model``: a version whose source is the model's folder
  in the bucket, nothing uploaded again), and ends the run FINISHED, FAILED or KILLED.
- **Rank 0** (:class:`StepTracker`) logs each step's metrics with the step number from a thread of
  its own through a bounded queue: a slow or unreachable tracker never holds a step, its failures
  are said once and counted, and steps an earlier attempt logged already are not logged again.

A tracker is a view of the run, never part of it: no call here raises into the training. MLflow's
own HTTP retries (7, about four minutes per request by default) are cut to a few seconds.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import sys
import threading
import time
from typing import Any, Callable

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
EXPERIMENT_ENV = "RAY_TRAIN_EKS_MLFLOW_EXPERIMENT"
#: What the stack knows of the platform (instance type, node count, GPU type, image, code digest),
#: as JSON in the Ray pods' environment: the run's tags.
PLATFORM_ENV = "RAY_TRAIN_EKS_PLATFORM"
DEFAULT_EXPERIMENT = "ray-train-eks"
RUN_RECORD = "mlflow_run.json"
#: The step metrics logged, as the loop names them (metrics.jsonl's keys).
STEP_KEYS = ("loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_s", "mfu", "step_seconds", "peak_memory_gib",
             "slowest_gpu_share", "best_eval_loss", "sample_seconds", "rewards/chosen", "rewards/rejected",
             "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "eval_rewards/accuracies",
             "eval_rewards/margins", "workers")
#: Steps the rank-0 queue holds while the tracker is slow or away; past it a step is not logged live
#: (the driver logs it at the end, from metrics.jsonl).
QUEUE_STEPS = 2000
#: MLflow's REST client: a request gives up within seconds (MLflow's environment variables, read per request).
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
CLOSE_TIMEOUT_S = 20
#: How long the driver waits, at the run's end, for a tracker that is away (a restart) before it
#: gives up logging the run's end there (the job's GPU nodes are released only after).
FINISH_WAIT_S = 60
#: What MLflow's client says when the tracker cannot be reached (as opposed to refusing a request).
_UNREACHABLE = re.compile(r"Max retries exceeded|Connection refused|timed out|Connection aborted|RemoteDisconnected|"
                          r"\b50[234]\b")


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` says the tracker was not reached (worth another try), not that it refused."""
    return bool(_UNREACHABLE.search(str(error)))
#: MLflow takes at most 1000 metrics and 100 params per ``log_batch`` (its REST API's limits).
MAX_METRICS, MAX_PARAMS = 1000, 100


def _say(line: str) -> None:
    print(f"[tracking] {line}", file=sys.stderr, flush=True)


def client_for(uri: str):
    """An ``MlflowClient`` for ``uri`` with short HTTP retries; a ``file:`` store (the demo's) allowed."""
    for key, value in HTTP_SETTINGS.items():
        os.environ.setdefault(key, value)
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it in maintenance mode
    if not uri.startswith("arn:"):  # the sagemaker-mlflow plugin's header provider warns on every other URI
        logging.getLogger("mlflow.tracking.request_header.registry").setLevel(logging.ERROR)
    import mlflow
    from mlflow.tracking import MlflowClient

    # The sagemaker-mlflow plugin signs for the process's tracking URI, not the client's
    # (auth_provider.py, mlflow_sagemaker_request_header_provider.py: mlflow.get_tracking_uri()).
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri)


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """Where a person sees the run: the server's UI page, or for SageMaker's managed MLflow the
    command that opens its UI (a presigned URL, valid for minutes)."""
    if uri.startswith("arn:"):
        kind = "app" if ":mlflow-app/" in uri else "tracking-server"
        name = uri.rsplit("/", 1)[-1]
        how = (f"aws sagemaker create-presigned-mlflow-app-url --arn {uri}" if kind == "app"
               else f"aws sagemaker create-presigned-mlflow-tracking-server-url --tracking-server-name {name}")
        return f"{how} (then experiment {experiment_id}, run {run_id})"
    if uri.startswith("file:"):
        return f"{uri} (experiment {experiment_id}, run {run_id}): make mlflow-ui"
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def _metrics_of(record: dict) -> list:
    from mlflow.entities import Metric

    when = int(float(record.get("time") or time.time()) * 1000)
    return [Metric(key, float(record[key]), when, int(record["step"])) for key in STEP_KEYS
            if isinstance(record.get(key), (int, float)) and record.get(key) is not None]


def logged_steps(client, run_id: str) -> set[int]:
    """The steps of the run's ``loss`` in the tracker (every step logs a loss)."""
    return {int(metric.step) for metric in client.get_metric_history(run_id, "loss")}


class StepTracker:
    """Rank 0's steps to the tracker, from a thread of its own (see the module's text).

    :param after_step: steps up to it are in the tracker already (an earlier attempt's): not logged again.
    """

    def __init__(self, client, run_id: str, *, after_step: int, log: Callable[[str], None] = _say,
                 ask_tracker: bool = False) -> None:
        self.client, self.run_id, self.after_step, self.log = client, run_id, after_step, log
        self.failed, self.not_logged = False, 0
        #: ``ask_tracker``: the sender first asks the tracker which steps it has (an earlier attempt's),
        #: in its own thread, so an unreachable tracker never holds the first step.
        self.ask_tracker = ask_tracker
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_STEPS)
        self._sender = threading.Thread(target=self._send_loop, name="mlflow-sender", daemon=True)
        self._sender.start()

    def step(self, record: dict) -> None:
        """One step's record (metrics.jsonl's keys): queued, never waited for."""
        if int(record["step"]) <= self.after_step:
            return
        try:
            self._queue.put_nowait(_metrics_of(record))
        except queue.Full:
            self.not_logged += 1

    def samples(self, step: int, entries: list[dict]) -> None:
        """An evaluation's samples (training/evaluation/samples.py): ``samples/step-<step>.jsonl`` in the
        run's artifacts, queued like a step."""
        if step <= self.after_step:
            return
        text = "".join(json.dumps({"step": step, **entry}, sort_keys=True) + "\n" for entry in entries)
        try:
            self._queue.put_nowait(("text", f"samples/step-{step:06d}.jsonl", text, step))
        except queue.Full:
            self.not_logged += 1

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued, waiting at most ``timeout_s``."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._sender.join(timeout_s)
        left = self._queue.qsize()
        if left or self.not_logged:
            self.log(f"{self.not_logged + left} step(s) not logged to the tracker from rank 0; the driver logs them "
                     "from metrics.jsonl at the run's end")

    def _send_loop(self) -> None:
        if self.ask_tracker:
            try:
                self.after_step = max(self.after_step, max(logged_steps(self.client, self.run_id), default=0))
            except Exception as error:  # noqa: BLE001 - the driver logs what is missing at the end
                self.log(f"cannot read the tracker's steps ({type(error).__name__}: {str(error)[:200]}); logging on")
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            if isinstance(batch, tuple):
                self._send(batch)
                continue
            while len(batch) < MAX_METRICS - len(STEP_KEYS):  # what else waits, in one call
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                if isinstance(more, tuple):
                    self._send(more)
                    continue
                batch += more
            batch = [metric for metric in batch if metric.step > self.after_step]  # not an earlier attempt's
            if not batch:
                continue
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as error:  # noqa: BLE001 - a tracker never stops a run
                self.not_logged += len({m.step for m in batch})
                self._failed(error)

    def _send(self, item: tuple) -> None:
        """A text artifact (an evaluation's samples), unless an earlier attempt logged its step."""
        _, name, text, step = item
        if step <= self.after_step:
            return
        try:
            self.client.log_text(self.run_id, text, name)
        except Exception as error:  # noqa: BLE001 - a tracker never stops a run
            self._failed(error)

    def _failed(self, error: Exception) -> None:
        if not self.failed:
            self.log(f"logging steps to the tracker failed, training goes on (further failures are counted, "
                     f"not logged): {type(error).__name__}: {str(error)[:300]}")
        self.failed = True


def step_tracker(settings: dict | None, start_step: int) -> StepTracker | None:
    """Rank 0's tracker for the driver's run (``settings``: :meth:`RunTracking.for_workers`), or None."""
    if not settings:
        return None
    try:
        client = client_for(settings["uri"])
    except Exception as error:  # noqa: BLE001
        _say(f"no tracking from rank 0 ({type(error).__name__}: {str(error)[:300]}); the driver logs the steps at the end")
        return None
    return StepTracker(client, settings["run_id"], after_step=start_step, ask_tracker=True)


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

    def __init__(self, client, uri: str, experiment_id: str, run_id: str, *, continued: bool) -> None:
        self.client, self.uri, self.experiment_id, self.run_id, self.continued = client, uri, experiment_id, run_id, continued
        self.url = run_url(uri, experiment_id, run_id)

    @classmethod
    def open(cls, config, run_folder: str, *, log: Callable[[str], None] = _say) -> "RunTracking | None":
        """The run's MLflow run, continued from ``<run_folder>/mlflow_run.json`` or new; None without
        a tracker, or when it cannot be reached (said; the run goes on untracked)."""
        from ..storage.files import read_text, write_text

        uri = config.tracking_uri
        if not uri:
            return None
        if uri.startswith("file:") and not uri.startswith("file:/"):  # the workers' working directory is not ours
            uri = "file:" + os.path.abspath(uri[len("file:"):])
        try:
            client = client_for(uri)
            name = config.experiment_name or DEFAULT_EXPERIMENT
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else _create_experiment(client, name)
            record = json.loads(read_text(f"{run_folder}/{RUN_RECORD}") or "{}")
            run = _continued_run(client, record, uri, log)
            params = _params(config.to_dict())
            if run is None:
                tags = {**platform_tags(), "ray-train-eks.run_folder": run_folder}
                run = client.create_run(experiment_id, run_name=config.run_name, tags=tags)
                _log_params(client, run.info.run_id, params)
                write_text(f"{run_folder}/{RUN_RECORD}", json.dumps({"tracking_uri": uri, "experiment_id": experiment_id,
                                                                      "run_id": run.info.run_id}, indent=2))
                tracking = cls(client, uri, experiment_id, run.info.run_id, continued=False)
            else:
                client.update_run(run.info.run_id, status="RUNNING")
                _log_params(client, run.info.run_id, {k: v for k, v in params.items() if k not in run.data.params})
                for key, value in params.items():  # MLflow's params never change: a resume's new values as tags
                    if key in run.data.params and run.data.params[key] != value:
                        client.set_tag(run.info.run_id, f"resumed_with.{key}", value[:5000])
                tracking = cls(client, uri, run.info.experiment_id, run.info.run_id, continued=True)
        except Exception as error:  # noqa: BLE001 - an unreachable tracker: the run goes on untracked
            log(f"no tracking: the tracker at {uri} cannot be used ({type(error).__name__}: {str(error)[:300]}); the run "
                "goes on, and metrics.jsonl keeps every step")
            return None
        log(f"MLflow run {tracking.run_id} ({'continued' if tracking.continued else 'new'}): {tracking.url}")
        return tracking

    def for_workers(self) -> dict:
        return {"uri": self.uri, "run_id": self.run_id}

    def finish(self, status: str, *, run_folder: str, summary: dict | None = None, register_as: str | None = None,
               log: Callable[[str], None] = _say) -> dict:
        """End the MLflow run as ``status`` (FINISHED, FAILED, KILLED), after the steps it lacks, the
        artifacts and the registered model (not for KILLED: the job is being stopped, seconds count).
        Returns what the summary says of the tracking."""
        said: dict[str, Any] = {"mlflow_run_id": self.run_id, "mlflow_url": self.url}
        # A tracker away (restarting) is waited for, a bounded while; a KILLED job has seconds left.
        deadline = time.monotonic() + (0 if status == "KILLED" else FINISH_WAIT_S)
        parts = [] if status == "KILLED" else [self._backfill, self._artifacts, self._outcome, self._register]
        for part in [*parts, lambda **_: self.client.set_terminated(self.run_id, status)]:
            while True:
                try:
                    said.update(part(run_folder=run_folder, summary=summary, register_as=register_as) or {})
                    break
                except Exception as error:  # noqa: BLE001 - the run's outputs stand whatever the tracker does
                    if unreachable(error) and time.monotonic() < deadline:
                        if "waited" not in said:
                            log(f"the tracker is unreachable; waiting up to {FINISH_WAIT_S} s to end MLflow run {self.run_id}")
                            said["waited"] = True
                        time.sleep(2)
                        continue
                    name = getattr(part, "__name__", "").strip("_")
                    said.setdefault("tracking_errors", []).append(
                        f"{name if name != '<lambda>' else 'status ' + status}: {type(error).__name__}: {str(error)[:300]}")
                    break
        said.pop("waited", None)
        for problem in said.get("tracking_errors", []):
            log(f"MLflow run {self.run_id}: {problem}")
        return said

    def _backfill(self, *, run_folder: str, **_) -> dict:
        """The steps of metrics.jsonl the tracker lacks (rank 0 could not reach it), logged now."""
        from ..storage.files import read_text
        from .runlog import METRICS_FILE, parse_lines

        have = logged_steps(self.client, self.run_id)
        missing = [record for record in parse_lines(read_text(f"{run_folder}/{METRICS_FILE}")) if record["step"] not in have]
        metrics = [metric for record in missing for metric in _metrics_of(record)]
        for start in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + MAX_METRICS])
        return {"steps_logged_late": len(missing)} if missing else {}

    def _artifacts(self, *, run_folder: str, summary: dict | None, **_) -> dict:
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
                    self.client.log_artifact(self.run_id, os.path.join(folder, name))
        if summary is not None:
            self.client.log_dict(self.run_id, summary, "summary.json")
        return {}

    def _outcome(self, *, summary: dict | None, **_) -> dict:
        """What was exported and why, why the run stopped early, and the benchmark's scores against the base's."""
        from mlflow.entities import Metric, RunTag

        if not summary:
            return {}
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
        self.client.log_batch(self.run_id, metrics=metrics[:MAX_METRICS], tags=[RunTag(k, v[:5000]) for k, v in tags.items()])
        return {}

    def _register(self, *, summary: dict | None, register_as: str | None, **_) -> dict:
        """``--register-model NAME``: a new version of NAME whose source is the final model's folder."""
        if not register_as or not summary or not summary.get("final_model"):
            return {}
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(register_as)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = self.client.create_model_version(register_as, source=summary["final_model"], run_id=self.run_id,
                                                   await_creation_for=30)
        return {"registered_model": f"{register_as} version {version.version}"}


def metric_name(text: str) -> str:
    """``text`` as an MLflow metric name (letters, digits, ``_ - . / :`` and spaces; the rest become ``_``)."""
    import re

    return re.sub(r"[^A-Za-z0-9_\-./: ]", "_", text)


def _create_experiment(client, name: str) -> str:
    """Create the experiment; another run may have made it meanwhile (two users at once)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def _continued_run(client, record: dict, uri: str, log: Callable[[str], None]):
    """The MLflow run the run folder names, where it is on this tracker and not deleted; else None."""
    if not record:
        return None
    if record.get("tracking_uri") != uri:
        log(f"the run was tracked at {record.get('tracking_uri')} (MLflow run {record.get('run_id')}); this invocation's "
            f"tracker is {uri}: a new MLflow run there")
        return None
    try:
        run = client.get_run(record["run_id"])
    except Exception as error:  # noqa: BLE001 - deleted, or a store that was reset
        log(f"MLflow run {record['run_id']} cannot be continued ({type(error).__name__}: {str(error)[:200]}): a new one")
        return None
    return run if run.info.lifecycle_stage == "active" else None


def _log_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(key, value) for key, value in params.items()]
    for start in range(0, len(items), MAX_PARAMS):
        client.log_batch(run_id, params=items[start:start + MAX_PARAMS])

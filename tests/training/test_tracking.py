"""The driver's side of tracking (training/telemetry/tracking.py) against a real MLflow server, without
Ray: the MLflow run ends as the training run did (FINISHED, FAILED, KILLED for the SIGTERM of ``ray job
stop``, which Ray's driver handler turns into SystemExit), a tracker that cannot be reached at the
start leaves the run untracked with one line, two runs of one experiment created at once both get it,
and rank 0's queue never waits. (The runs that train and log are tests/training/test_end_to_end.py's.)"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from training.config import parse_config
from training.telemetry import tracking


def _config(tmp_path, uri: str, name: str = "tracked", *extra: str):
    return parse_config(["--preset", "tiny-cpu", "--storage-path", str(tmp_path), "--run-name", name,
                         "--tracking-uri", uri, *extra])


class _Trainer:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def fit(self):
        raise self.error


@pytest.mark.parametrize("error, status", [(SystemExit(15), "KILLED"), (RuntimeError("a worker failed past the budget"), "FAILED"),
                                           (KeyboardInterrupt(), "KILLED")])
def test_the_mlflow_run_ends_as_the_training_run_did(mlflow_server, tmp_path, monkeypatch, error, status):
    """training.train.run: Ray Train's fit ends with the error (SystemExit: SIGTERM through Ray's driver
    handler, ray/_private/worker.py ``sigterm_handler``), which goes on up; the MLflow run has the status."""
    from training import train

    monkeypatch.setattr(train, "start_ray", lambda config: None)
    monkeypatch.setattr(train, "stop_ray", lambda: None)
    monkeypatch.setattr(train, "build_trainer", lambda config, **kwargs: _Trainer(error))
    config = _config(tmp_path, mlflow_server.url, f"ends-{status.lower()}-{type(error).__name__}")
    with pytest.raises(type(error)):
        train.run(config)
    record = json.loads((tmp_path / config.run_name / tracking.RUN_RECORD).read_text())
    assert mlflow_server.client().get_run(record["run_id"]).info.status == status


def test_an_unreachable_tracker_at_the_start_leaves_the_run_untracked_with_one_line(tmp_path, capsys, monkeypatch):
    """Nothing listens where the tracker should be: tried again for the open's wait (20 s by default, 2 here),
    then the run goes on untracked."""
    from local_s3 import free_port

    monkeypatch.setattr(tracking, "OPEN_WAIT_S", 2)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "0.5")  # room in the 2 s for tries (no request that cannot end in it)
    started = time.monotonic()
    assert tracking.RunTracking.open(_config(tmp_path, f"http://127.0.0.1:{free_port()}"), str(tmp_path / "r")) is None
    assert time.monotonic() - started < 2 + 10  # the wait, and MLflow's retries cut (its default: minutes)
    said = capsys.readouterr().err
    assert "[tracking] no tracking: the tracker at http://127.0.0.1:" in said and "metrics.jsonl keeps every step" in said


def test_two_runs_opened_at_once_share_the_experiment(mlflow_server, tmp_path):
    """Two users' first runs on a new stack create its experiment at the same moment: one creates
    it, the other finds it (RESOURCE_ALREADY_EXISTS), both runs land in it."""
    opened = {}

    def open_run(name):
        config = dataclasses.replace(_config(tmp_path, mlflow_server.url, name), experiment_name="two-at-once")
        opened[name] = tracking.RunTracking.open(config, str(tmp_path / name))

    threads = [threading.Thread(target=open_run, args=(f"user-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert {t.experiment_id for t in opened.values()} == {mlflow_server.client().get_experiment_by_name("two-at-once").experiment_id}
    assert len({t.run_id for t in opened.values()}) == 2


def test_rank_0s_queue_never_waits_and_says_what_it_dropped(capsys):
    """A tracker that hangs: each step is queued in microseconds; past the queue's bound a step is
    counted, not waited for; close gives up after its timeout and says how many were not logged."""
    hang = threading.Event()

    class Hanging:
        def log_batch(self, run_id, metrics=(), params=()):
            hang.wait(30)

    said = []
    tracker = tracking.StepTracker(Hanging(), "r", after_step=0, log=said.append)
    started = time.perf_counter()
    for step in range(1, tracking.QUEUE_STEPS + 1101):
        tracker.step({"step": step, "loss": 1.0, "time": 0.0})
    assert time.perf_counter() - started < 2.0
    # One batch (up to 991 one-metric steps) is in the hanging call, the queue full behind it.
    assert tracker.not_logged >= 50
    tracker.close(timeout_s=0.5)
    hang.set()
    assert said and "not logged to the tracker from rank 0" in said[-1]


def test_steps_an_earlier_attempt_logged_are_not_logged_again():
    sent = []

    class Recording:
        def log_batch(self, run_id, metrics=(), params=()):
            sent.extend(metrics)

    tracker = tracking.StepTracker(Recording(), "r", after_step=6)
    for step in range(5, 9):
        tracker.step({"step": step, "loss": 1.0 / step, "eval_loss": None, "time": 1.0})
    tracker.close()
    assert sorted({m.step for m in sent}) == [7, 8] and {m.key for m in sent} == {"loss"}


def test_rank_0_asks_the_tracker_which_steps_it_has_from_its_sender_thread():
    """A restart from step 4's checkpoint after an attempt that logged up to step 6: rank 0 starts at
    once (the question is the sender thread's) and logs 7 and 8 only."""
    from types import SimpleNamespace

    sent, asked = [], threading.Event()

    class EarlierAttempt:
        def get_metric_history(self, run_id, key):
            asked.set()
            return [SimpleNamespace(step=step) for step in range(1, 7)]

        def log_batch(self, run_id, metrics=(), params=()):
            sent.extend(metrics)

    tracker = tracking.StepTracker(EarlierAttempt(), "r", after_step=4, ask_tracker=True)
    for step in range(5, 9):
        tracker.step({"step": step, "loss": 1.0 / step, "time": 1.0})
    tracker.close()
    assert asked.is_set() and sorted(m.step for m in sent) == [7, 8]


def test_a_finished_run_tells_the_tracker_what_it_exported_why_it_stopped_and_its_benchmark(mlflow_server, tmp_path):
    """What the summary says of the export, an early stop and the benchmark against the base, as the MLflow
    run's tags and metrics (the names MLflow takes: a metric's filter after a slash)."""
    config = _config(tmp_path, mlflow_server.url, "outcome")
    opened = tracking.RunTracking.open(config, str(tmp_path / "outcome"))
    summary = {"export": {"which": "best", "step": 4, "eval_loss": 4.74, "last_step": 10, "last_eval_loss": 6.6,
                          "reason": "step 4 has the lowest eval loss (4.7400), against 6.6000 at the last step 10"},
               "stopped_early": "early stopping: 3 evaluation(s) without a lower eval loss than 4.7400 at step 4",
               "benchmarks": {"scores": {"gsm8k": {"exact_match/strict-match": 0.5}}, "base": {"gsm8k": {"exact_match/strict-match": 0.25}},
                              "difference": {"gsm8k": {"exact_match/strict-match": 0.25}}}}
    said = opened.finish("FINISHED", run_folder=str(tmp_path / "outcome"), summary=summary)
    assert "tracking_errors" not in said, said
    run = mlflow_server.client().get_run(opened.run_id)
    assert (run.data.tags["export.which"], run.data.tags["export.step"]) == ("best", "4")
    assert run.data.tags["export.reason"] == summary["export"]["reason"]
    assert run.data.tags["stopped_early"] == summary["stopped_early"]
    assert run.data.metrics["exported_eval_loss"] == 4.74
    assert run.data.metrics["bench.gsm8k.exact_match/strict-match"] == 0.5
    assert run.data.metrics["bench_vs_base.gsm8k.exact_match/strict-match"] == 0.25


#: What MLflow 3.17 raises for a status in its transient list with its own retries off (measured against a
#: server that answers the code: mlflow/utils/request_utils.py's urllib3 ``Retry`` with ``total=0``).
STATUS_SAID = ("API request to http://127.0.0.1:5000/api/2.0/mlflow/runs/create failed with exception "
               "HTTPConnectionPool(host='127.0.0.1', port=5000): Max retries exceeded with url: /api/2.0/mlflow/runs/create "
               "(Caused by ResponseError('too many {code} error responses'))")


@pytest.mark.parametrize("code, sent_unanswered", [(504, True), (502, True), (408, True), (500, False), (503, False)])
def test_a_gateways_timeout_is_read_as_a_request_sent_and_unanswered_and_a_servers_own_error_as_its_answer(
        code, sent_unanswered):
    """A 504, 502 or 408 comes from the load balancer in front of the tracker, which gave up while the server
    may still be creating: a create is then looked for until found, never sent again
    (tests/training/test_tracker_faults.py: a 504 through a proxy). A 500 or 503 is the server's own answer.
    Either is worth another try of a call that changes nothing."""
    from training.telemetry import tracker_calls

    error = RuntimeError(STATUS_SAID.format(code=code))
    assert tracker_calls.unreachable(error)
    assert tracker_calls.sent_unanswered(error) is sent_unanswered


def test_a_request_timeout_from_the_environment_is_capped_so_the_runs_end_keeps_room_for_its_tries(tmp_path, monkeypatch):
    """MLFLOW_HTTP_REQUEST_TIMEOUT=120 (MLflow's own default) in the pod's environment would let one request take
    twice the end's whole wait: it is capped, where MLflow reads it, and said."""
    import os

    from training.telemetry import tracker_calls

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    tracker_calls.client_for(f"file:{tmp_path}/mlruns")
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == str(tracker_calls.MAX_TIMEOUT_S)
    assert tracker_calls.request_timeout_s() == tracker_calls.MAX_TIMEOUT_S == 10


class _Registry:
    """Stands in for MLflow's client at registration: records what the version's create was asked."""

    def __init__(self) -> None:
        self.asked: dict = {}

    def create_registered_model(self, name):
        pass

    def create_model_version(self, name, **asked):
        self.asked = asked
        return type("Version", (), {"version": "1"})()


def test_the_registrys_wait_for_a_new_version_is_what_the_runs_end_has_left(monkeypatch):
    """``create_model_version`` polls until the version is READY for ``await_creation_for`` seconds (30 s asked
    before, whatever was left): with 14 s left of the end's wait and a 10 s request, it may wait 4 s at most."""
    from training.telemetry.tracker_calls import Calls

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    registry = _Registry()
    tracked = tracking.RunTracking(registry, "http://127.0.0.1:1", "1", "run-1", continued=False)
    said = tracked._register(summary={"final_model": "s3://b/final"}, register_as="m",
                             calls=Calls(time.monotonic() + 14, print))
    assert said == {"registered_model": "m version 1"}
    assert 3 <= registry.asked["await_creation_for"] <= 4

"""Rank 0's steps to the run's MLflow run (:class:`StepTracker`), from a thread of its own through a
bounded queue: a slow or unreachable tracker never holds a step, its failures are said once and
counted, and no step is logged twice.

A restarted attempt trains again the steps after its checkpoint, some of which the attempt before
logged: the sender first asks the tracker which steps it has, and sends nothing until it knows (a
tracker that cannot say is asked again; the steps wait in the queue, and what does not fit is left
to the driver, which logs what the tracker lacks from metrics.jsonl at the run's end). A batch whose
answer did not come is not sent again (it may have been logged): the driver's end logs the steps the
tracker lacks, after asking which it has."""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from typing import Callable

from .tracker_calls import client_for, describe

#: The step metrics logged, as the loop names them (metrics.jsonl's keys).
STEP_KEYS = ("loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_s", "mfu", "step_seconds", "peak_memory_gib",
             "slowest_gpu_share", "best_eval_loss", "sample_seconds", "rewards/chosen", "rewards/rejected",
             "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "eval_rewards/accuracies",
             "eval_rewards/margins", "workers", "cost_usd", "cost_usd_projected")
#: Steps the rank-0 queue holds while the tracker is slow or away; past it a step is not logged live
#: (the driver logs it at the end, from metrics.jsonl).
QUEUE_STEPS = 2000
CLOSE_TIMEOUT_S = 20
#: Seconds between questions to a tracker that could not say which steps it has.
ASK_AGAIN_S = 5.0
#: MLflow takes at most 1000 metrics per ``log_batch`` (its REST API's limit).
MAX_METRICS = 1000


def say(line: str) -> None:
    """A line of the tracking code in the job log."""
    print(f"[tracking] {line}", file=sys.stderr, flush=True)


def metrics_of(record: dict) -> list:
    """One metrics.jsonl record as MLflow metrics, with its step and time."""
    from mlflow.entities import Metric

    when = int(float(record.get("time") or time.time()) * 1000)
    return [Metric(key, float(record[key]), when, int(record["step"])) for key in STEP_KEYS
            if isinstance(record.get(key), (int, float)) and record.get(key) is not None]


def logged_steps(client, run_id: str) -> set[int]:
    """The steps of the run's ``loss`` in the tracker (every step logs a loss, in the same batch as its
    other metrics)."""
    return {int(metric.step) for metric in client.get_metric_history(run_id, "loss")}


class StepTracker:
    """Rank 0's steps to the tracker, from a thread of its own (see the module's text).

    :param after_step: steps up to it are in the tracker already (an earlier attempt's): not logged again.
    :param ask_tracker: the sender first asks the tracker which steps it has (an earlier attempt's), in
        its own thread, so an unreachable tracker never holds the first step.
    :param uri: the tracker (for what a refusal says).
    """

    def __init__(self, client, run_id: str, *, after_step: int, log: Callable[[str], None] = say,
                 ask_tracker: bool = False, uri: str = "", ask_again_s: float = ASK_AGAIN_S) -> None:
        self.client, self.run_id, self.after_step, self.log, self.uri = client, run_id, after_step, log, uri
        self.failed, self.not_logged = False, 0
        self.ask_tracker, self.ask_again_s = ask_tracker, ask_again_s
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_STEPS)
        self._closing = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="mlflow-sender", daemon=True)
        self._sender.start()

    def step(self, record: dict) -> None:
        """One step's record (metrics.jsonl's keys): queued, never waited for."""
        if int(record["step"]) <= self.after_step:
            return
        try:
            self._queue.put_nowait(metrics_of(record))
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
        self._closing.set()
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._sender.join(timeout_s)
        left = self._queue.qsize()
        if left or self.not_logged:
            self.log(f"{self.not_logged + left} step(s) not logged to the tracker from rank 0; the driver logs them "
                     "from metrics.jsonl at the run's end")

    def _ask(self) -> bool:
        """Which steps the tracker has (an earlier attempt's), asked until it says, once more when the
        tracker closes; False when it never said (nothing is sent then: the driver logs the steps at the end)."""
        while True:
            closing = self._closing.is_set()
            try:
                self.after_step = max(self.after_step, max(logged_steps(self.client, self.run_id), default=0))
                return True
            except Exception as error:  # noqa: BLE001 - a tracker never stops a run
                if not self.failed:
                    self.log(f"cannot read the tracker's steps ({describe(error, uri=self.uri, operation='GetMetricHistory')}); "
                             "no step is logged from rank 0 until it answers, so none is logged twice")
                self.failed = True
            if closing:
                return False
            self._closing.wait(self.ask_again_s)

    def _send_loop(self) -> None:
        if self.ask_tracker and not self._ask():
            return
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
                self._failed(error, "LogBatch")

    def _send(self, item: tuple) -> None:
        """A text artifact (an evaluation's samples), unless an earlier attempt logged its step."""
        _, name, text, step = item
        if step <= self.after_step:
            return
        try:
            self.client.log_text(self.run_id, text, name)
        except Exception as error:  # noqa: BLE001 - a tracker never stops a run
            self._failed(error, "LogArtifact")

    def _failed(self, error: Exception, operation: str) -> None:
        if not self.failed:
            self.log(f"logging steps to the tracker failed, training goes on (further failures are counted, not "
                     f"logged): {describe(error, uri=self.uri, operation=operation)}")
        self.failed = True


def step_tracker(settings: dict | None, start_step: int) -> StepTracker | None:
    """Rank 0's tracker for the driver's run (``settings``: ``RunTracking.for_workers``), or None."""
    if not settings:
        return None
    try:
        client = client_for(settings["uri"], presigned_uploads=bool(settings.get("presigned_uploads")))
    except Exception as error:  # noqa: BLE001
        say(f"no tracking from rank 0 ({type(error).__name__}: {str(error)[:300]}); the driver logs the steps at the end")
        return None
    return StepTracker(client, settings["run_id"], after_step=start_step, ask_tracker=True, uri=settings["uri"])

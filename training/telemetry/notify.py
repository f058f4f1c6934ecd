"""A run's events, to the people who watch it: the stack's SNS topic (the idle-GPU alarm's, whose
subscription is ``-c alarmEmail=``), one message an event, written to be read at 3 a.m.: the run,
what happened and why, the last loss and step, the cost so far, where the model or the checkpoint
is, and the command to run.

Events: the run's end, from the driver (training/train.py: finished, failed, stopped, out of
budget, stopped before its capacity block ends); a preemption, from rank 0 at the checkpoint at its
notice (training/reporting.py); an elastic run's resize, from rank 0 at its first step at the new size
(training/resizing.py); a node taken out of the run (a hardware fault, a node condition, a
straggler), from the worker or the NCCL log follower that takes it out
(training/resilience/faults.py), once a node.

On only where ``RAY_TRAIN_EKS_NOTIFY_TOPIC_ARN`` is set on the driver (the Ray pods take it from the
stack's settings ConfigMap, ``notify_topic_arn``): elsewhere nothing is sent and boto3 is never
imported. The driver hands the workers what a message needs (:meth:`Notifier.for_workers`); a
worker keeps it in its environment (:data:`CONTEXT_ENV`), which the processes it starts inherit.

Publishing never fails a run: short timeouts and one retry, every error caught and said in one
line of the log. The client's region is the topic's (from its ARN).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

#: The topic's ARN (the Ray pods: from the settings ConfigMap's ``notify_topic_arn``, optional).
TOPIC_ENV = "RAY_TRAIN_EKS_NOTIFY_TOPIC_ARN"
#: The platform the pods run on (ray_train_eks/workload/pods.py): its ``gpu_usd_per_hour``, the GPU
#: nodes' on-demand price per hour together, gives the cost so far.
PLATFORM_ENV = "RAY_TRAIN_EKS_PLATFORM"
#: A worker's copy of the driver's :class:`Notifier`, for the code and processes of that worker.
CONTEXT_ENV = "RAY_TRAIN_EKS_NOTIFY_CONTEXT"
#: SNS's limits on a Subject: at most 100 characters, ASCII, no line break (Publish API reference).
SUBJECT_MAX = 100
#: botocore settings: a publish gives up within seconds (the driver's at a stop: within Ray's
#: 3 s between the SIGTERM and the SIGKILL of ``ray job stop``, RAY_JOB_STOP_WAIT_TIME_S).
CLIENT_TIMEOUTS = {"connect_timeout": 2, "read_timeout": 3, "retries": {"total_max_attempts": 2, "mode": "standard"}}
QUICK_TIMEOUTS = {"connect_timeout": 1, "read_timeout": 2, "retries": {"total_max_attempts": 1, "mode": "standard"}}

#: Each event's words in the subject, and what the reader does about it ({name}: the run's name).
EVENTS = {
    "finished": ("finished", "The model is ready. Nothing to do."),
    "failed": ("FAILED", "Its log says why: ray-train-eks logs {name}. The checkpoints stay: once fixed, "
                         "ray-train-eks submit --resume {name} continues from the last one."),
    "stopped": ("stopped", "Stopped on purpose; the checkpoints stay: ray-train-eks submit --resume {name} continues "
                           "from the last one."),
    "out of budget": ("stopped, out of budget", "It gave up after more faults than its budget allows (reason above). "
                                                "The checkpoints stay: ray-train-eks submit --resume {name} continues "
                                                "from the last one once the cause is dealt with."),
    "stop time": ("stopped before its stop time", "Checkpointed and stopped in time (before EC2 "
                                                                   "reclaims a capacity block's instances): resume with "
                                                                   "ray-train-eks submit --resume {name} on new capacity."),
    "preempted": ("preempted, resuming", "Nothing to do: the run resumes from this checkpoint once Ray Train has "
                                         "nodes again (ray-train-eks status {name})."),
    "resized": ("resized", "Nothing to do: an elastic run (--min-nodes) trains on at this size; ray-train-eks status "
                           "{name} shows its size."),
    "node taken out": ("node taken out, resuming", "Nothing to do unless it repeats: the node is tainted and drained, "
                                                   "and the run resumes on a new node from its last checkpoint. "
                                                   "ray-train-eks status {name} shows where it is."),
}


@dataclass(frozen=True)
class Notifier:
    """What every message of one job says besides the event: the topic, the run, its folder, when
    the job started and what its GPU nodes cost an hour (None: not known)."""

    topic_arn: str
    run_name: str
    run_folder: str
    started: float
    usd_per_hour: float | None = None

    @classmethod
    def from_env(cls, *, run_name: str, run_folder: str, environ=None, started: float | None = None) -> "Notifier | None":
        """The driver's notifier, or None where no topic is set (nothing is ever sent)."""
        environ = os.environ if environ is None else environ
        topic = (environ.get(TOPIC_ENV) or "").strip()
        if not topic:
            return None
        try:
            price = json.loads(environ.get(PLATFORM_ENV) or "{}").get("gpu_usd_per_hour")
        except (ValueError, AttributeError):
            price = None
        return cls(topic_arn=topic, run_name=run_name, run_folder=run_folder.rstrip("/"),
                   started=time.time() if started is None else started,
                   usd_per_hour=float(price) if isinstance(price, (int, float)) else None)

    def for_workers(self) -> dict:
        return asdict(self)

    def message(self, event: str, reason: str, *, step: int | None = None, max_steps: int | None = None,
                loss: float | None = None, model: str | None = None, checkpoint: str | None = None,
                now: float | None = None) -> tuple[str, str]:
        """The subject (SNS's rules: :func:`subject_text`) and the text of one event."""
        now = time.time() if now is None else now
        said, todo = EVENTS[event]
        figures = loss_text(loss, step, max_steps)
        subject = subject_text(f"ray-train-eks: {self.run_name} {said}" + (f", {figures}" if figures else ""))
        lines = [f"Run {self.run_name}: {said}.", "", f"What happened: {reason}",
                 f"Last reported: {figures or 'no step yet'}",
                 f"Cost so far: {self.cost_text(now)}"]
        if model:
            lines.append(f"Model: {model}")
        lines.append(f"Checkpoint: {checkpoint or self.run_folder + '/checkpoint_*'}")
        lines += [f"Run folder: {self.run_folder}/ (metrics.jsonl, curves.png, summary.json)", "",
                  todo.format(name=self.run_name), "",
                  f"  ray-train-eks status {self.run_name}", f"  ray-train-eks logs {self.run_name}", "",
                  f"Sent {datetime.fromtimestamp(now, timezone.utc):%Y-%m-%d %H:%M:%S} UTC by the run's training "
                  f"(host {os.uname().nodename})."]
        return subject, "\n".join(lines) + "\n"

    def cost_text(self, now: float) -> str:
        minutes = max(0.0, now - self.started) / 60
        if self.usd_per_hour is None:
            return (f"not known ({minutes:.0f} min since this job started; the GPU type is not in ray-train-eks's price "
                    "table)")
        return (f"{self.usd_per_hour * minutes / 60:.2f} USD: the GPU nodes at {self.usd_per_hour:.2f} USD/hour (on-demand "
                f"price; Spot and Capacity Blocks bill otherwise) for the {minutes:.0f} min since this job started")

    def publish(self, event: str, reason: str, *, quick: bool = False, client=None, **figures) -> bool:
        """Send one event; True once SNS took it. Never raises: a failure is one line on stderr."""
        try:
            subject, text = self.message(event, reason, **figures)
            client = client or sns_client(self.topic_arn, quick=quick)
            client.publish(TopicArn=self.topic_arn, Subject=subject, Message=text)
        except Exception as error:  # noqa: BLE001 - a notification is never worth a run
            print(f"[notify] could not publish {event!r} for run {self.run_name} to {self.topic_arn} "
                  f"({type(error).__name__}: {first_line(error)}); the run goes on", file=sys.stderr, flush=True)
            return False
        print(f"[notify] {event}: published to {self.topic_arn}", flush=True)
        return True


def sns_client(topic_arn: str, *, quick: bool = False):
    """A boto3 SNS client in the topic's region, with short timeouts."""
    import boto3
    from botocore.config import Config

    parts = topic_arn.split(":")
    if len(parts) < 6 or parts[2] != "sns":
        raise ValueError(f"{TOPIC_ENV}={topic_arn!r} is not an SNS topic ARN (arn:aws:sns:<region>:<account>:<name>)")
    return boto3.client("sns", region_name=parts[3], config=Config(**(QUICK_TIMEOUTS if quick else CLIENT_TIMEOUTS)))


def subject_text(text: str) -> str:
    """``text`` as SNS takes a Subject: printable ASCII on one line, at most 100 characters."""
    text = re.sub(r"\s+", " ", text.encode("ascii", "replace").decode()).strip()
    text = "".join(c if " " <= c <= "~" else "?" for c in text)
    return text if len(text) <= SUBJECT_MAX else text[:SUBJECT_MAX - 3] + "..."


def loss_text(loss: float | None, step: int | None, max_steps: int | None) -> str:
    """``loss 1.2345 at step 7 of 20``, or what of it is known."""
    if step is None:
        return "" if loss is None else f"loss {loss:.4f}"
    at = f"step {step}" + (f" of {max_steps}" if max_steps else "")
    return f"at {at}" if loss is None else f"loss {loss:.4f} at {at}"


def first_line(error: BaseException) -> str:
    """The line of an error that says what it was: the first non-empty line of its message, or, for
    a Ray Train error that wraps others, the wrapped one's (a worker's traceback: its last line)."""
    inner = getattr(error, "controller_failure", None)
    if inner is not None:
        return first_line(inner)
    for rank, failure in sorted((getattr(error, "worker_failures", None) or {}).items()):
        lines = [line.strip() for line in str(failure).splitlines() if line.strip()]
        return f"rank {rank}: {lines[-1] if lines else type(failure).__name__}"[:500]
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:500]


# ---------------------------------------------------------------------- in a worker


def keep_for_this_worker(values: dict | None) -> "Notifier | None":
    """The driver's notifier in this worker (None: none), kept in its environment for what it starts."""
    if not values:
        os.environ.pop(CONTEXT_ENV, None)
        return None
    os.environ[CONTEXT_ENV] = json.dumps(values)
    return Notifier(**values)


def current() -> "Notifier | None":
    """This worker's notifier (:func:`keep_for_this_worker`; a process it started inherits it), or None."""
    text = os.environ.get(CONTEXT_ENV)
    if not text:
        return None
    try:
        return Notifier(**json.loads(text))
    except (TypeError, ValueError):
        return None

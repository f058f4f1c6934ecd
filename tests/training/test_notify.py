"""A run's events to the stack's SNS topic (training/telemetry/notify.py, training/telemetry/run_end.py), without
Ray: what each message says, that a failure to publish never reaches the run, that without the topic
nothing is sent (and boto3 is not even imported), and the Ray pods' environment that carries the topic.
The messages of a real run, preempted and finished, are read back in test_preemption.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from local_s3 import free_port
from training.telemetry.notify import EVENTS, SUBJECT_MAX, Notifier, first_line, subject_text

TOPIC = "arn:aws:sns:eu-west-1:123456789012:ray-train-eks-alarms"


def _notifier(**changes) -> Notifier:
    values = {"topic_arn": TOPIC, "run_name": "dolly-lr1e5", "run_folder": "s3://bucket/runs/dolly-lr1e5", "started": 1_000.0,
              "usd_per_hour": 9.2032, **changes}
    return Notifier(**values)


class Recorder:
    def __init__(self) -> None:
        self.sent = []

    def publish(self, **call):
        self.sent.append(call)
        return {"MessageId": "1"}


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_every_event_says_the_run_what_happened_the_loss_the_cost_and_what_to_run(event):
    subject, text = _notifier().message(event, "rank 1: RuntimeError: CUDA error: uncorrectable ECC error encountered",
                                        step=37, max_steps=120, loss=1.23456, model="s3://bucket/runs/dolly-lr1e5/final",
                                        now=1_000.0 + 30 * 60)
    assert len(subject) <= SUBJECT_MAX and subject.isascii() and "\n" not in subject
    assert subject.startswith(f"ray-train-eks: dolly-lr1e5 {EVENTS[event][0]}") and "loss 1.2346 at step 37 of 120" in subject
    assert text.startswith(f"Run dolly-lr1e5: {EVENTS[event][0]}.\n")
    assert "What happened: rank 1: RuntimeError: CUDA error: uncorrectable ECC error encountered\n" in text
    assert "Last reported: loss 1.2346 at step 37 of 120\n" in text
    # Half an hour of two g6.12xlarge at their on-demand price.
    assert "Cost so far: 4.60 USD: the GPU nodes at 9.20 USD/hour (on-demand price" in text and "for the 30 min" in text
    assert "Model: s3://bucket/runs/dolly-lr1e5/final\n" in text
    assert "Checkpoint: s3://bucket/runs/dolly-lr1e5/checkpoint_*\n" in text
    assert "  ray-train-eks status dolly-lr1e5\n  ray-train-eks logs dolly-lr1e5\n" in text
    if event in ("failed", "stopped", "out of budget", "stop time"):
        assert "ray-train-eks submit --resume dolly-lr1e5" in text


def test_what_is_not_known_is_said_so_and_the_subject_keeps_to_snss_rules():
    subject, text = _notifier(usd_per_hour=None, run_name="r" * 120).message("failed", "boom", now=1_060.0)
    assert len(subject) == SUBJECT_MAX and subject.endswith("...")
    assert "Last reported: no step yet" in text
    assert "Cost so far: not known (1 min since this job started; the GPU type is not in ray-train-eks's price table)" in text
    assert subject_text("ray-train-eks: café\nrun\t\u2013 done") == "ray-train-eks: caf? run ? done"
    _, text = _notifier().message("finished", "x", step=3, loss=float("nan"))
    assert "Last reported: loss nan at step 3\n" in text


def test_a_publish_that_fails_never_raises_and_says_so_once(capsys, monkeypatch):
    """SNS refuses (no sns:Publish on the pods' role), or cannot be reached: the publish returns False
    with one line in the log, and nothing is raised into the run."""
    from botocore.stub import Stubber

    from training.telemetry.notify import sns_client

    client = sns_client(TOPIC)
    with Stubber(client) as stub:
        stub.add_client_error("publish", service_error_code="AuthorizationError", http_status_code=403,
                              service_message="User: arn:aws:sts::123456789012:assumed-role/pods is not authorized to "
                                              "perform: SNS:Publish")
        assert _notifier().publish("finished", "done", client=client) is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"[notify] could not publish 'finished' for run dolly-lr1e5 to {TOPIC} (AuthorizationErrorException: An error "
                          "occurred (AuthorizationError)") and err.endswith("the run goes on\n")
    # Nothing listens there: refused at once, one try, within the quick timeouts.
    for key, value in {"AWS_ENDPOINT_URL_SNS": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    assert _notifier().publish("preempted", "notice", quick=True) is False
    assert "(EndpointConnectionError: Could not connect to the endpoint URL" in capsys.readouterr().err
    # A topic that is no SNS ARN is said, not raised.
    assert _notifier(topic_arn="my-topic").publish("failed", "x") is False
    assert "is not an SNS topic ARN" in capsys.readouterr().err


def test_without_the_topic_nothing_is_sent_and_boto3_is_never_imported():
    script = ("import sys, os; os.environ.pop('RAY_TRAIN_EKS_NOTIFY_TOPIC_ARN', None)\n"
              "from training.telemetry.notify import Notifier, current, keep_for_this_worker\n"
              "from training.telemetry import run_end\n"
              "assert Notifier.from_env(run_name='r', run_folder='/tmp/r') is None\n"
              "assert keep_for_this_worker(None) is None and current() is None\n"
              "from training.resilience.faults import _notify_node_out, Fault\n"
              "_notify_node_out(Fault('gpu error', 'x'), invocation_id='i', node='n', gcs=None, notice_s=0)\n"
              "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules, 'boto3 imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_driver_says_how_the_run_ended(tmp_path):
    """Finished (an early stop counts), stopped before its stop time, out of a budget, failed with the
    error's first line, stopped from outside (SIGTERM: one quick try)."""
    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    from training.config import PRESETS, TrainConfig
    from training.resilience.preemption import FailureBudgetSpent, HardwareBudgetSpent
    from training.telemetry.run_end import notify_end, notify_error, out_of_budget

    config = TrainConfig(**{**PRESETS["tiny-cpu"], "preset": "tiny-cpu", "storage_path": str(tmp_path), "max_steps": 20})
    folder = tmp_path / "tiny-cpu-sft"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10}) + "\n" for s in (1, 2, 3)))
    sent = []

    class Notes(Notifier):
        def publish(self, event, reason, **figures):
            sent.append((event, reason, figures))
            return True

    notes = Notes(topic_arn=TOPIC, run_name="tiny-cpu-sft", run_folder=str(folder), started=0.0)
    notify_end(notes, {"steps": 12, "final_loss": 1.5, "final_model": f"{folder}/final", "checkpoint": f"{folder}/checkpoint_x",
                       "stopped_early": "early stopping: 2 evaluations without a lower eval loss",
                       "export": {"step": 8, "which": "best", "reason": "step 8 has the lowest eval loss"}}, config)
    notify_end(notes, {"steps": 9, "final_loss": 1.7, "stopped_before": "the capacity block cr-1 ends at ..."}, config)
    hardware = ControllerError(HardwareBudgetSpent("3 hardware faults, more than --max-hardware-faults=2 allows: ..."))
    assert out_of_budget(hardware) and out_of_budget(ControllerError(FailureBudgetSpent("4 failures")))
    notify_error(notes, hardware, config, str(folder), killed=False)
    failed = WorkerGroupError("rank 1 failed", {1: RuntimeError("Traceback (most recent call last):\n  ...\nValueError: bad row 7")})
    assert not out_of_budget(failed)
    notify_error(notes, failed, config, str(folder), killed=False)
    notify_error(notes, SystemExit(), config, str(folder), killed=True)
    assert [event for event, _, _ in sent] == ["finished", "stop time", "out of budget", "failed", "stopped"]
    assert sent[0][1] == ("stopped early: early stopping: 2 evaluations without a lower eval loss; the model is step 8's "
                          "(best): step 8 has the lowest eval loss")
    assert sent[0][2] == {"step": 12, "loss": 1.5, "max_steps": 20, "checkpoint": f"{folder}/checkpoint_x",
                          "model": f"{folder}/final"}
    assert sent[2][1] == "3 hardware faults, more than --max-hardware-faults=2 allows: ..."
    assert sent[2][2] == {"step": 3, "loss": pytest.approx(2.7), "max_steps": 20}  # the run's last recorded step
    assert sent[3][1] == "WorkerGroupError: rank 1: ValueError: bad row 7"
    assert sent[4][2] == {"quick": True, "max_steps": 20} and "SIGTERM" in sent[4][1]
    assert first_line(ValueError("\n  first\nsecond")) == "first"


def test_the_ray_pods_take_the_topic_and_the_blocks_from_the_settings_and_the_price_from_the_platform():
    from ray_train_eks.charts import RayWorkloadSpec
    from ray_train_eks.workload.pods import head_group_spec, worker_group_spec

    for group in (head_group_spec(RayWorkloadSpec()), worker_group_spec(RayWorkloadSpec())):
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        for name, key in (("RAY_TRAIN_EKS_NOTIFY_TOPIC_ARN", "notify_topic_arn"),
                          ("RAY_TRAIN_EKS_CAPACITY_BLOCK_IDS", "capacity_block_ids")):
            assert env[name]["valueFrom"] == {"configMapKeyRef": {"name": "ray-train-eks-settings", "key": key, "optional": True}}
        platform = json.loads(env["RAY_TRAIN_EKS_PLATFORM"]["value"])
        assert platform["gpu_usd_per_hour"] == pytest.approx(2 * 4.6016)  # two g6.12xlarge on demand
        notifier = Notifier.from_env(run_name="r", run_folder="s3://b/runs/r/", started=0.0,
                                     environ={"RAY_TRAIN_EKS_NOTIFY_TOPIC_ARN": TOPIC,
                                              "RAY_TRAIN_EKS_PLATFORM": env["RAY_TRAIN_EKS_PLATFORM"]["value"]})
        assert (notifier.usd_per_hour, notifier.run_folder) == (platform["gpu_usd_per_hour"], "s3://b/runs/r")

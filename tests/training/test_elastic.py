"""An elastic run (``--min-nodes``, training/resilience/elastic.py), without a Ray cluster: its options
refused before Ray starts, its sizes and micro-batch, the size a resize is said from (the retry
counter's record of the group before, the restore), the memory plan at both ends, the GPU-hours bench,
and the workers' side of a growth on the real training loop (one gloo rank; Ray Train's report, its
notice and the key-value store stood in by recorders: a growth asked after a checkpoint went to upload,
while a DPO reference is computed, a store that fails a moment, and a notice while the workers wait).
The controller's side (the scaling policy) is in test_elastic_policy.py; the resizes themselves, on a
multi-node Ray, in test_preemption.py."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from elastic_standins import FakeKV, Group

from training.config import ConfigError, TrainConfig, parse_config
from training.resilience import elastic
from training.resilience.elastic import ElasticSizes


def _parse(*args: str) -> TrainConfig:
    return parse_config(["--preset", "tiny-cpu", "--storage-path", "s3://bucket-x/runs", *args])


def _problems(*args: str) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        _parse(*args)
    return refused.value.problems


def test_an_elastic_run_is_off_by_default_and_takes_whole_nodes_from_the_minimum_up():
    assert TrainConfig.min_nodes is None and _parse().worker_counts == (2,)
    assert ElasticSizes.of(_parse()) is None
    config = _parse("--num-workers", "12", "--workers-per-node", "4", "--min-nodes", "1", "--global-batch-size", "48",
                    "--micro-batch-size", "1")
    assert config.worker_counts == (4, 8, 12)
    assert ElasticSizes.of(config) == ElasticSizes(min_nodes=1, max_nodes=3, workers_per_node=4, settle_s=60.0)
    # --min-nodes equal to the run's nodes: a fixed-size run.
    assert _parse("--num-workers", "8", "--workers-per-node", "4", "--min-nodes", "2", "--global-batch-size", "32"
                  ).worker_counts == (8,)


@pytest.mark.parametrize("args, said", [
    (("--min-nodes", "0"), "min_nodes=0 must be at least 1 (or none: a fixed-size run that waits for a replacement)"),
    (("--num-workers", "8", "--workers-per-node", "4", "--min-nodes", "3"),
     "min_nodes=3 is more than the run's 2 node(s) (num_workers(8) / workers_per_node(4)); use 1 to 2"),
    (("--num-workers", "6", "--workers-per-node", "4", "--min-nodes", "1", "--global-batch-size", "24"),
     "min_nodes=1 resizes in whole nodes, but num_workers(6) is not a multiple of workers_per_node(4); use a multiple, e.g. 4"),
    (("--num-workers", "12", "--workers-per-node", "4", "--min-nodes", "2", "--global-batch-size", "36",
      "--micro-batch-size", "1"),
     "global_batch_size(36) does not split evenly at every size --min-nodes 2 allows: 8 workers x micro_batch_size(1); "
     "the global batch stays the same at every size, so use a multiple of 24, e.g. 48"),
    (("--num-workers", "12", "--workers-per-node", "4", "--min-nodes", "1", "--global-batch-size", "48", "--micro-batch-size",
      "1", "--hsdp-shard-size", "6"), "hsdp_shard_size(6) does not divide every size --min-nodes 1 allows (4, 8 workers); drop it"),
    (("--num-workers", "2", "--workers-per-node", "1", "--min-nodes", "1", "--inject-failure-at-step", "3"),
     "inject_failure_at_step(3) kills worker 1, which a run of --min-nodes 1 (1 worker) may not have; use --min-nodes 2 or more"),
    (("--num-workers", "2", "--workers-per-node", "1", "--min-nodes", "1", "--elastic-settle-s", "-1"),
     "elastic_settle_s=-1.0 must be 0 or more"),
])
def test_min_nodes_a_run_cannot_resize_with_is_refused_before_ray_starts_with_the_field_the_value_and_the_fix(args, said):
    assert any(problem.startswith(said) for problem in _problems(*args)), _problems(*args)


def test_the_micro_batch_left_open_divides_the_global_batch_per_worker_at_every_size():
    """24 sequences on 12 or 8 workers: 2 or 3 each, so a micro-batch of 1 (a fixed-size run of 12 takes 2)."""
    elastic_run = _parse("--num-workers", "12", "--workers-per-node", "4", "--min-nodes", "2", "--global-batch-size", "24",
                         "--micro-batch-size", "none")
    fixed = replace(elastic_run, min_nodes=None)
    assert (elastic_run.sequences_per_worker, fixed.sequences_per_worker) == (1, 2)
    assert (elastic_run.with_defaults().micro_batch_size, fixed.with_defaults().micro_batch_size) == (1, 2)


def test_a_growth_is_no_failure_and_tells_the_next_worker_group_it_resized():
    from ray.train.v2._internal.execution.controller.state import ResizingState, RunningState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    from training.resilience.preemption import retry_counter

    counter = retry_counter("inv", max_failures=0, grace_s=0)
    counter.after_controller_state_update(RunningState(), ResizingState(
        scaling_decision=ResizeDecision(num_workers=8, resources_per_worker={"GPU": 1})))
    assert counter.counts["last"] == "resize" and counter.counts["failures"] == counter.counts["preemptions"] == 0


def test_a_resize_is_said_from_the_size_the_run_trained_at_before_not_the_size_of_its_checkpoint(monkeypatch):
    """Four 8-GPU nodes lose one (restarted on 3 from the 32-worker checkpoint), then another before the
    first checkpoint at 3: that resize is 3 -> 2, not 4 -> 2. Then a failure while both nodes are back
    restarts on 4 from a 16-worker checkpoint: 2 -> 4, said. Ray Train's retry counter tells each new
    worker group the size of the one before (``RETRIES_ENV``, set here as its ``execute`` sets it on a worker)."""
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.execution.controller.state import RestartingState, RunningState
    from ray.train.v2.api.exceptions import WorkerGroupError

    from training.resilience import faults
    from training.resilience.preemption import RETRIES_ENV, retries_seen, retry_counter
    from training.resizing import resized_from

    monkeypatch.delenv(RETRIES_ENV, raising=False)
    monkeypatch.setattr(faults, "faults_recorded", lambda invocation: {})
    monkeypatch.setattr(faults, "followed", lambda invocation: False)
    config = _parse("--num-workers", "32", "--workers-per-node", "8", "--min-nodes", "2", "--global-batch-size", "96",
                    "--micro-batch-size", "1")
    counter = retry_counter("inv", grace_s=0)
    lost = RestartingState(training_failed_error=WorkerGroupError("rank 9 died", {9: ActorDiedError()}))
    said = []
    for workers in (32, 24, 16, 32):
        counter.after_worker_group_start(Group(range(workers)))
        said.append(resized_from(config, workers, retries_seen()["workers_before"]))
        counter.after_controller_state_update(RunningState(), lost)
    assert said == [None, 32, 24, 16]


def _restored(monkeypatch, capsys, config: TrainConfig, *, world: int, saved_by: int, invocation: str,
              workers_before: int | None) -> tuple[int | None, str]:
    """training/prepare.py ``restore`` on rank 0 of a group of ``world`` workers, from a checkpoint that
    ``saved_by`` workers wrote in invocation ``invocation`` (this one is "inv"), after a group of
    ``workers_before`` in this invocation (the retry counter's ``RETRIES_ENV``, as its ``execute`` sets it on a
    worker); Ray Train's checkpoint and DCP's load are stood in (the resharding itself: test_lora.py).
    What the worker says it resized from, and its restore line."""
    import ray.train
    import torch

    from training import prepare
    from training.resilience.preemption import RETRIES_ENV
    from training.worker import Worker

    state = {"step": 40, "workers": saved_by, "invocation_id": invocation, "first_loss": 2.0, "resumed_from_step": None,
             "preemptions": 0, "failures": 1, "hardware_faults": 0, "earlier": {}}
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: SimpleNamespace(path="s3://bucket-x/runs/checkpoint_40"))
    monkeypatch.setattr(prepare, "load_checkpoint", lambda *args, **kwargs: dict(state))
    monkeypatch.setattr(prepare, "continue_schedule", lambda worker, state: None)
    monkeypatch.setenv(RETRIES_ENV, json.dumps({"last": "failure", "workers_before": workers_before}))
    worker = Worker(config=config, rank=0, world=world, invocation_id="inv", device=torch.device("cpu"))
    prepare.restore(worker)
    return worker.resized_from, capsys.readouterr().out


def test_a_resize_is_said_at_the_restore_from_the_previous_groups_size_and_a_new_run_at_another_size_is_none(
        monkeypatch, capsys):
    """An elastic run restarted on 16 workers from a checkpoint of 32, after a group of 24 (a second node
    lost before the first checkpoint at 3 nodes), resized from 24; restarted on 32 from a checkpoint of 32
    after a group of 24 (a failure once the node was back), from 24 too. A run submitted again with
    ``--resume`` at another size, elastic or not, is no resize (no ``resized_from_workers``, no
    notification): its restore says it resharded."""
    elastic_run = _parse("--num-workers", "32", "--workers-per-node", "8", "--min-nodes", "2", "--global-batch-size", "96",
                         "--micro-batch-size", "1")
    fixed = replace(elastic_run, min_nodes=None)
    assert _restored(monkeypatch, capsys, elastic_run, world=16, saved_by=32, invocation="inv", workers_before=24)[0] == 24
    assert _restored(monkeypatch, capsys, elastic_run, world=32, saved_by=32, invocation="inv", workers_before=24)[0] == 24
    for config in (fixed, elastic_run):
        resized, said = _restored(monkeypatch, capsys, config, world=16, saved_by=32, invocation="earlier", workers_before=None)
        assert resized is None
        assert ("[train] restored step 40 from s3://bucket-x/runs/checkpoint_40, saved by 32 workers, resharded onto 16 "
                "(resumed at another size)") in said


def test_the_memory_plan_is_checked_at_the_smallest_size_too(monkeypatch, capsys):
    """Qwen2.5-7B on 12 L4s fits only with its states spread over all 12 (full sharding): on 8, after a
    node is lost, it would not; LoRA's 7B fits 4 as 8 (HSDP: a node's shard group holds the same)."""
    from training import train

    monkeypatch.setattr(train, "start_ray", lambda config: pytest.fail("Ray started"))
    seven_b = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
               "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
    full = parse_config(["--preset", "qwen2.5-7b-l4x12", "--min-nodes", "2", "--gpu-type", "L4"],
                        storage_path="s3://bucket/runs")
    with pytest.raises(ConfigError, match=r"memory at the smallest size --min-nodes 2 allows: Qwen/Qwen2\.5-7B does not "
                                          r"fit 8 x L4: 23\.9 GiB"):
        train.plan_memory(full, seven_b)
    assert train.plan_memory(replace(full, min_nodes=None), seven_b).micro_batch_size == 1  # fixed at 12: fits
    capsys.readouterr()
    lora = parse_config(["--preset", "qwen2.5-7b-lora-l4x8", "--min-nodes", "1", "--gpu-type", "L4"],
                        storage_path="s3://bucket/runs")
    train.plan_memory(lora, seven_b)
    tables = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory plan: ")]
    assert [table.split(" on ")[1].split(" x ")[0] for table in tables] == ["8", "4"]


def test_the_gpu_hours_simulation_prints_its_assumptions_and_both_ways_for_each_set_up_and_replacement(capsys):
    from bench.elastic_gpu_hours import ASSUMPTIONS, SETUPS, main

    assert main(["--trials", "200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("assumptions:\n") and all(what in out for what in ASSUMPTIONS)
    rows = [line for line in out.splitlines() if line.startswith(tuple(SETUPS))]
    assert len(rows) == len(SETUPS) * len(ASSUMPTIONS)
    waiting, elastic = zip(*((float(line.split()[-3]), float(line.split()[-2])) for line in rows))
    assert all(w > 0 and e > 0 for w, e in zip(waiting, elastic))


def test_the_gpu_hours_simulation_charges_the_growths_checkpoint_and_a_new_nodes_download_and_stops_every_unreplaced_loss(
        monkeypatch):
    """The growth's synchronous checkpoint (every GPU waits for its upload) is the elastic column's; the
    model's download onto a new node (its pod's cache is empty) is both columns'; a loss never replaced
    waits the replacement deadline whatever took the node, as the code does: the first 15-minute start
    timeout past 25 minutes, from the code's own constants."""
    import random

    from bench import elastic_gpu_hours as bench

    assert bench.NO_REPLACEMENT_MIN == 30.0
    nodes, gpus, parameters_b = 4, 8, 7.616
    rng = random.Random(1)
    rng.uniform(*bench.GPU_RESTART_S)
    download = parameters_b * 2 / rng.uniform(*bench.MODEL_DOWNLOAD_GBPS) / 60
    checkpoint = parameters_b * bench.STATE_BYTES_PER_PARAMETER / nodes / rng.uniform(*bench.UPLOAD_GBPS) / 60
    charged = bench.lost_gpu_hours(nodes, gpus, parameters_b, 7.0, random.Random(1))
    monkeypatch.setattr(bench, "MODEL_DOWNLOAD_GBPS", (1e12, 1e12))
    monkeypatch.setattr(bench, "UPLOAD_GBPS", (1e12, 1e12))
    free = bench.lost_gpu_hours(nodes, gpus, parameters_b, 7.0, random.Random(1))
    assert charged[0] - free[0] == pytest.approx(nodes * gpus * download / 60, rel=1e-6)
    assert charged[1] - free[1] == pytest.approx(nodes * gpus * (download + checkpoint) / 60, rel=1e-6)
    assert 15 < checkpoint * 60 < 46 and 24 < download * 60 < 75  # seconds, 22.8 GB a node and 15.2 GB of weights


def test_the_size_goes_to_the_tracker_with_each_step():
    from training.telemetry.tracking import metrics_of

    logged = {metric.key: metric.value for metric in metrics_of({"step": 9, "loss": 1.5, "workers": 4, "time": 0})}
    assert logged == {"loss": 1.5, "workers": 4.0}


# ---------------------------------------------------------------------- the workers' side, on the real loop

class Held(Exception):
    """The workers wait to be replaced (training/resilience/preemption.py ``hold_until_replaced``)."""


def _elastic_loop(tiny_loop, monkeypatch, kv: FakeKV, reports: list, *, after_report=None, wait_to_grow: bool = False,
                  **options) -> None:
    """The loop as one worker of a shrunk elastic run (``--min-nodes 1`` of two one-worker nodes, training
    on one): Ray Train's reports into ``reports`` (and the store's events; ``after_report`` is called after
    each), the wait for the restart a ``Held`` (``wait_to_grow``: the wait for a growth's restart runs as it is)."""
    from training import loop, reporting

    def report(metrics, checkpoint=None, **upload):
        kv.events.append(("report", metrics["step"], checkpoint is not None, upload.get("checkpoint_upload_mode")))
        reports.append(metrics)
        if after_report:
            after_report(metrics, checkpoint)

    held = lambda *args: (_ for _ in ()).throw(Held())  # noqa: E731
    monkeypatch.setattr(loop, "hold_until_replaced", held)
    monkeypatch.setattr(reporting, "hold_until_replaced", held)
    if not wait_to_grow:
        monkeypatch.setattr(loop, "hold_for_growth", held)
    with pytest.raises(Held):
        tiny_loop(report, num_workers=2, workers_per_node=1, min_nodes=1, checkpoint_every=2, max_steps=8, **options)


def test_a_growth_asked_after_a_checkpoint_went_to_upload_reports_it_then_its_own_step_with_the_upload_waited_for(
        tiny_loop, monkeypatch, kv):
    """The ask comes after step 2's checkpoint was reported for a background upload: at step 4, the next
    checkpoint step, the workers report step 2's first, then write step 4's and report it with the upload
    waited for (``SYNC``), and only then answer; nothing after step 4 trains. Ray Train's report is a
    recorder here, so nothing uploads: what is checked is the order and the upload modes the workers ask of
    Ray. That a synchronous report returns only after every earlier upload is Ray's (its reports are kept in
    order: ray/train/v2/_internal/execution/context.py ``_wait_then_report``), not run here."""
    import ray.train

    asks = iter([None, json.dumps({"generation": 3, "nodes": 2})])
    real_get = kv._internal_kv_get
    monkeypatch.setattr(kv, "_internal_kv_get", lambda key, namespace=None: next(asks, None) if key.endswith("/ask")
                        else real_get(key, namespace))
    reports: list = []
    _elastic_loop(tiny_loop, monkeypatch, kv, reports)
    async_, sync = ray.train.CheckpointUploadMode.ASYNC, ray.train.CheckpointUploadMode.SYNC
    checkpoints = [event for event in kv.events if event[0] == "report" and event[2]]
    assert checkpoints == [("report", 2, True, async_), ("report", 4, True, sync)]
    assert kv.events[-1] == ("put", "test/ready", {"generation": 3, "step": 4})
    assert max(metrics["step"] for metrics in reports) == 4


def test_a_preemption_notice_while_the_workers_wait_to_grow_releases_their_nodes_at_once(tiny_loop, monkeypatch, kv):
    """Once the workers answered the growth's ask they wait for the restart; a notice meanwhile puts Ray
    Train's controller in its preempting state, where it waits for the notice's deadline (up to 270 s, every
    GPU idle) rather than for the growth. So the waiting workers ask for notices as the loop does, and rank 0
    releases the nodes at once (the drain's deadline now: training/resilience/preemption.py ``release``): the
    checkpoint they wrote for the growth is the one the run resumes from. Ray Train's notice is stood in
    (none at the first look of the wait, then one for another node), as is the release."""
    import ray.train
    from ray.train import PreemptionInfo

    from training import reporting

    notice = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"node-b": [1]})
    looks = iter([None, notice])
    released: list = []
    monkeypatch.setattr(reporting, "release", released.append)

    def after_report(metrics, checkpoint):
        if checkpoint is not None and metrics["step"] == 2:  # the growth's checkpoint: the notices of the wait from here
            monkeypatch.setattr(ray.train, "get_preemption_info", lambda: next(looks))

    elastic.ask_to_grow("test", 1, 2)
    _elastic_loop(tiny_loop, monkeypatch, kv, [], after_report=after_report, wait_to_grow=True)
    assert kv.events[-1] == ("put", "test/ready", {"generation": 1, "step": 2})
    assert released == [notice]


def test_workers_that_cannot_read_the_ask_or_answer_it_train_on_and_answer_at_a_later_checkpoint(tiny_loop, monkeypatch, kv):
    """Rank 0 reads the ask from Ray's key-value store at each checkpoint step and answers there: a read
    that fails is no ask (read again at the next checkpoint); an answer is tried three times a moment
    apart, and if the GCS still does not take it the workers train on (waiting would be for a restart the
    controller never learns of) and answer at a later checkpoint, where the ask still stands. Here the
    read fails at step 2 and the answer at step 4; step 6 answers."""
    monkeypatch.setattr(elastic, "ANSWER_PAUSE_S", 0.0)
    elastic.ask_to_grow("test", 1, 2)  # the controller's ask, written before the store fails
    failures = {"/ask": iter([RuntimeError("GCS RPC timed out")]), "/ready": iter([RuntimeError("GCS unavailable")] * 3)}
    gets, puts = kv._internal_kv_get, kv._internal_kv_put

    def failing(key: str):
        failure = next(failures.get(key[key.rindex("/"):], iter(())), None)
        if failure:
            raise failure

    def get(key, namespace=None):
        failing(key)
        return gets(key, namespace)

    def put(key, value, overwrite=True, namespace=None):
        failing(key)
        puts(key, value, overwrite, namespace)

    monkeypatch.setattr(kv, "_internal_kv_get", get)
    monkeypatch.setattr(kv, "_internal_kv_put", put)
    reports: list = []
    _elastic_loop(tiny_loop, monkeypatch, kv, reports)
    assert kv.events[-1] == ("put", "test/ready", {"generation": 1, "step": 6})
    assert sorted({metrics["step"] for metrics in reports}) == [1, 2, 3, 4, 5, 6]  # trained on to step 6, no further


def test_a_growth_asked_during_a_dpo_reference_precompute_comes_at_the_first_checkpoint_after_it(tiny_loop, monkeypatch, kv,
                                                                                                 tmp_path):
    """A full fine-tune's DPO reference is computed before the first step; a growth asked meanwhile never
    cuts it short: the table is written, steps 1 and 2 train against it, and the workers answer at step 2's
    checkpoint. (A node lost during the precompute ends the worker group before any checkpoint: the new one
    computes the table again, at its own size, the same table: tests/training/test_lora.py.)"""
    from training.modeling.reference import REFERENCE_FILE

    elastic.ask_to_grow("test", 1, 2)  # before the run starts
    kv.events.clear()
    reports: list = []
    _elastic_loop(tiny_loop, monkeypatch, kv, reports, objective="dpo", dataset="tiny:reverse-words-pairs", max_samples=24,
                  eval_fraction=0.1)
    assert (tmp_path / "runs" / "tiny-cpu-sft" / REFERENCE_FILE).exists()
    assert [metrics["step"] for metrics in reports] == [1, 2] and reports[0]["rewards/margins"] == 0.0
    assert kv.events[-1] == ("put", "test/ready", {"generation": 1, "step": 2})

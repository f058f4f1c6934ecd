"""An elastic run (``--min-nodes``, training/resilience/elastic.py), without a Ray cluster: its options
refused before Ray starts, its sizes and micro-batch, how the policy counts whole nodes (Ray's own
``ray.nodes()`` and draining records, as dicts), when it grows (settle time, the checkpoint handshake), the
policy as Ray Train 2.58's controller calls it (its decision classes), below its minimum the
replacement deadline of a fixed-size run, the memory plan at both ends, and the workers' side of a growth
on the real training loop (one gloo rank: a growth asked while a checkpoint uploads, and while a DPO
reference is computed). The resizes themselves, on a multi-node Ray, are in test_preemption.py."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from training.config import ConfigError, TrainConfig, parse_config
from training.resilience import elastic, elastic_policy
from training.resilience.elastic import ElasticSizes, Growth, whole_nodes


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


def _node(node_id: str, *, alive: bool = True, cpus: float = 4, gpus: float = 4) -> dict:
    """One entry of ``ray.nodes()`` (Ray 2.58 ``_private/state.py`` ``node_table``), its fields as Ray names them."""
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus, f"node:10.0.0.{len(node_id)}": 1.0},
            "NodeManagerAddress": "10.0.0.1", "NodeManagerPort": 1}


def test_whole_nodes_are_alive_not_draining_and_hold_a_whole_nodes_workers():
    nodes = [_node("a"), _node("b", alive=False), _node("c"), _node("d", gpus=2), _node("head", cpus=8, gpus=0), _node("e", gpus=8)]
    found = whole_nodes(nodes, draining={"c"}, per_worker={"GPU": 1.0}, workers_per_node=4)
    # b is dead, c drained (a preemption notice, or taken out), d has half a node's GPUs, the head none;
    # e has room for two nodes' workers and is one node.
    assert found == ["a", "e"]
    assert whole_nodes(nodes, draining=set(), per_worker={"CPU": 1.0}, workers_per_node=8) == ["head"]


def test_nodes_that_join_are_asked_for_once_they_settled_and_the_restart_waits_for_the_workers_answer():
    sizes = ElasticSizes(min_nodes=1, max_nodes=3, workers_per_node=4, settle_s=60)
    growth = Growth(sizes)
    assert growth.decide(now=0, running=1, usable=1, ready=False) == ("wait", 0)
    assert growth.decide(now=10, running=1, usable=2, ready=False) == ("wait", 0)  # joined at 10 s: settling
    assert growth.decide(now=69, running=1, usable=2, ready=False) == ("wait", 0)
    assert growth.decide(now=70, running=1, usable=2, ready=False) == ("ask", 2)
    assert growth.decide(now=71, running=1, usable=2, ready=False) == ("wait", 0)  # asked once
    assert growth.decide(now=72, running=1, usable=5, ready=False) == ("ask", 3)  # more came: at most the run's 3
    # The workers answered at their checkpoint: one more look (the controller's poll takes the report), then the restart.
    assert growth.decide(now=80, running=1, usable=3, ready=True) == ("wait", 0)
    assert growth.decide(now=81, running=1, usable=3, ready=True) == ("resize", 3)


def test_nodes_that_leave_before_the_checkpoint_withdraw_the_ask_and_a_flapping_node_settles_again():
    growth = Growth(ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=1, settle_s=5))
    growth.decide(now=0, running=1, usable=2, ready=False)
    assert growth.decide(now=5, running=1, usable=2, ready=False) == ("ask", 2)
    assert growth.decide(now=6, running=1, usable=1, ready=False) == ("withdraw", 0)
    assert growth.decide(now=7, running=1, usable=2, ready=False) == ("wait", 0)  # back: settles again from 7 s
    assert growth.decide(now=11, running=1, usable=2, ready=False) == ("wait", 0)
    assert growth.decide(now=12, running=1, usable=2, ready=False) == ("ask", 2)
    # Answered after all, the node gone again: the workers wait, so they restart on what there is.
    growth.decide(now=13, running=1, usable=1, ready=True)
    assert growth.decide(now=14, running=1, usable=1, ready=True) == ("resize", 1)


class FakeKV:
    """Ray's internal key-value store (``ray.experimental.internal_kv``) as the handshake uses it."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], str] = {}
        self.events: list = []

    def _internal_kv_put(self, key, value, overwrite=True, namespace=None):
        self.values[(namespace, key)] = value
        self.events.append(("put", key, json.loads(value)))

    def _internal_kv_get(self, key, namespace=None):
        return self.values.get((namespace, key))

    def _internal_kv_del(self, key, namespace=None):
        self.values.pop((namespace, key), None)


@pytest.fixture
def kv(monkeypatch) -> FakeKV:
    store = FakeKV()
    monkeypatch.setattr(elastic, "_kv", lambda: store)
    return store


def _policy(monkeypatch, usable: list[int], sizes: ElasticSizes):
    """The policy as Ray Train's controller holds it (built by the trainer, its coordinator requests
    aside), each look at the cluster finding the next of ``usable`` whole nodes."""
    from ray.train import ScalingConfig

    looks = iter(usable)
    monkeypatch.setattr(elastic_policy, "usable_nodes", lambda *a, **k: ["node"] * next(looks))
    monkeypatch.setattr(elastic_policy, "LOOK_EVERY_S", 0.0)
    policy = elastic_policy.elastic_policy(ScalingConfig(num_workers=(sizes.workers(sizes.min_nodes),
                                                                      sizes.workers(sizes.max_nodes))), sizes, "inv")
    policy._maybe_send_resource_request = lambda: None
    return policy


def test_the_policy_starts_on_the_whole_nodes_there_are_and_grows_only_after_the_workers_checkpointed(monkeypatch, kv):
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

    sizes = ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=4, settle_s=0)
    policy = _policy(monkeypatch, [1, 2, 2, 2, 2], sizes)
    started = policy.make_decision_for_non_running_worker_group()
    assert started == ResizeDecision(num_workers=4, resources_per_worker={"CPU": 1.0})  # one node of two
    running = SimpleNamespace(num_workers=4)
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)  # a node joined: asked
    assert elastic.growth_asked("inv") == {"generation": 1, "nodes": 2}
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)  # no answer yet
    elastic.say_ready("inv", 1, step=40)  # rank 0, once every rank's checkpoint of step 40 is uploaded
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)  # the report's poll
    grown = policy.make_decision_for_running_worker_group(running, None)
    assert grown == ResizeDecision(num_workers=8, resources_per_worker={"CPU": 1.0})
    # The new worker group starts with nothing asked of it; an answer of the old one is not its own.
    assert elastic.growth_asked("inv") is None and not elastic.ready_for("inv", 2)


def test_below_its_minimum_an_elastic_run_waits_for_a_replacement_and_its_deadline_as_a_fixed_size_run(monkeypatch, kv):
    """Ray's own elastic policy returns ``NoopDecision`` there, and its controller loops on it with no
    wait and no deadline. Ours asks for the minimum: Ray Train's placement group waits for it (its start
    timeout), and at the timeout past the replacement bound the run stops as a fixed-size one does."""
    import time

    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState, RestartingState, RunningState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision
    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    from training.resilience import faults
    from training.resilience.preemption import NoReplacement, retry_counter

    policy = _policy(monkeypatch, [1], ElasticSizes(min_nodes=2, max_nodes=3, workers_per_node=4, settle_s=0))
    assert policy.make_decision_for_non_running_worker_group() == ResizeDecision(num_workers=8,
                                                                                 resources_per_worker={"CPU": 1.0})
    now = time.time()
    ledger = {"raynode-b": {"kind": "gpu error", "node_name": "ip-10-0-1-7", "ray_node": "raynode-b", "time": now - 1800}}
    monkeypatch.setattr(faults, "faults_recorded", lambda invocation: dict(ledger))
    monkeypatch.setattr(faults, "followed", lambda invocation: False)
    counter = retry_counter("inv", max_failures=0, grace_s=0, replacement_timeout_s=1500)
    counter.after_controller_state_update(RunningState(), RestartingState(
        training_failed_error=WorkerGroupError("rank 1 failed", {1: ActorDiedError()})))
    timed_out = ReschedulingState(training_failed_error=ControllerError(WorkerGroupStartupTimeoutError(num_workers=8)))
    with pytest.raises(NoReplacement, match="taken out of the run 30 min ago"):
        counter.after_controller_state_update(RunningState(), timed_out)


def test_a_growth_is_no_failure_and_tells_the_next_worker_group_it_resized():
    from ray.train.v2._internal.execution.controller.state import ResizingState, RunningState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision

    from training.resilience.preemption import retry_counter

    counter = retry_counter("inv", max_failures=0, grace_s=0)
    counter.after_controller_state_update(RunningState(), ResizingState(
        scaling_decision=ResizeDecision(num_workers=8, resources_per_worker={"GPU": 1})))
    assert counter.counts["last"] == "resize" and counter.counts["failures"] == counter.counts["preemptions"] == 0


def test_the_trainer_builds_our_policy_for_an_elastic_run_only_where_ray_builds_its_own():
    """Pins Ray 2.58's private names the policy goes in by: ``fit`` calls the module's
    ``create_scaling_policy`` (ray/train/v2/api/data_parallel_trainer.py); Ray's ``ScalingPolicy`` and
    ``ResizeDecision`` in ``_internal/execution/scaling_policy``."""
    import inspect

    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy, ScalingPolicy
    from ray.train.v2.api import data_parallel_trainer

    assert "scaling_policy=create_scaling_policy(self.scaling_config)" in inspect.getsource(
        data_parallel_trainer.DataParallelTrainer.fit)
    ray_own = data_parallel_trainer.create_scaling_policy
    sizes = ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=1, settle_s=0)
    with elastic_policy.installed(sizes, "inv"):
        ours = data_parallel_trainer.create_scaling_policy(ScalingConfig(num_workers=(1, 2)))
        fixed = data_parallel_trainer.create_scaling_policy(ScalingConfig(num_workers=2))
    assert isinstance(ours, ScalingPolicy) and type(ours).__name__ == "WholeNodePolicy"
    assert isinstance(fixed, FixedScalingPolicy)
    assert data_parallel_trainer.create_scaling_policy is ray_own  # a fixed-size run's fit is Ray's own
    with elastic_policy.installed(None, "inv"):
        assert data_parallel_trainer.create_scaling_policy is ray_own


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


def test_the_size_goes_to_the_tracker_with_each_step():
    from training.telemetry.tracking import metrics_of

    logged = {metric.key: metric.value for metric in metrics_of({"step": 9, "loss": 1.5, "workers": 4, "time": 0})}
    assert logged == {"loss": 1.5, "workers": 4.0}


# ---------------------------------------------------------------------- the workers' side, on the real loop

class Held(Exception):
    """The workers wait to be replaced (training/resilience/preemption.py ``hold_until_replaced``)."""


def _elastic_loop(tiny_loop, monkeypatch, kv: FakeKV, reports: list, **options) -> None:
    """The loop as one worker of a shrunk elastic run (``--min-nodes 1`` of two one-worker nodes, training
    on one): Ray Train's reports into ``reports`` (and the store's events), the wait for the restart a ``Held``."""
    import ray.train

    from training import loop

    def report(metrics, checkpoint=None, **upload):
        kv.events.append(("report", metrics["step"], checkpoint is not None, upload.get("checkpoint_upload_mode")))
        reports.append(metrics)

    monkeypatch.setattr(loop, "hold_until_replaced", lambda: (_ for _ in ()).throw(Held()))
    with pytest.raises(Held):
        tiny_loop(report, num_workers=2, workers_per_node=1, min_nodes=1, checkpoint_every=2, max_steps=8, **options)


def test_a_growth_asked_while_a_checkpoint_uploads_waits_for_it_and_checkpoints_its_own_step_first(tiny_loop, monkeypatch, kv):
    """The ask comes after step 2's checkpoint went to upload in the background: at step 4, the next
    checkpoint step, the workers report step 2's (its upload in flight), then write step 4's and report it
    with its upload waited for (Ray keeps reports in order: step 2's is done first), and only then answer;
    nothing after step 4 trains, so the restart on more nodes loses nothing."""
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

"""An elastic run (``--min-nodes``, training/resilience/elastic.py), without a Ray cluster: its options
refused before Ray starts, its sizes and micro-batch, how the policy counts whole nodes (Ray's own
``ray.nodes()`` and draining records, as dicts; raylets as real sockets), when it grows (settle time, the
checkpoint handshake, the registration of the growth's checkpoint through Ray Train's report handler),
the policy as Ray Train 2.58's controller calls it (its decision classes) and when a look at the cluster
fails, its start timeouts, below its minimum the replacement deadline of a fixed-size run, the size a
resize is said from, the memory plan at both ends, and the workers' side of a growth on the real
training loop (one gloo rank; Ray Train's report, its notice and the key-value store stood in by
recorders: a growth asked after a checkpoint went to upload, while a DPO reference is computed, and a
notice while the workers wait). The resizes themselves, on a multi-node Ray, are in test_preemption.py."""

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


def _node(node_id: str, *, alive: bool = True, cpus: float = 4, gpus: float = 4, port: int = 1) -> dict:
    """One entry of ``ray.nodes()`` (Ray 2.58 ``_private/state.py`` ``node_table``), its fields as Ray names them."""
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus, f"node:10.0.0.{len(node_id)}": 1.0},
            "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port}


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
    assert growth.decide(now=0, running=1, usable=1) == ("wait", 0)
    assert growth.decide(now=10, running=1, usable=2) == ("wait", 0)  # joined at 10 s: settling
    assert growth.decide(now=69, running=1, usable=2) == ("wait", 0)
    assert growth.decide(now=70, running=1, usable=2) == ("ask", 2)
    assert growth.decide(now=71, running=1, usable=2) == ("wait", 0)  # asked once
    assert growth.decide(now=72, running=1, usable=5) == ("ask", 3)  # more came: at most the run's 3
    # The workers answered at their checkpoint of step 40: the restart once Ray Train registered it.
    assert growth.decide(now=80, running=1, usable=3, ready=40, registered=38) == ("wait", 0)
    assert growth.decide(now=81, running=1, usable=3, ready=40, registered=40) == ("resize", 3)


def test_nodes_that_leave_before_the_checkpoint_withdraw_the_ask_and_a_flapping_node_settles_again():
    growth = Growth(ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=1, settle_s=5))
    growth.decide(now=0, running=1, usable=2)
    assert growth.decide(now=5, running=1, usable=2) == ("ask", 2)
    assert growth.decide(now=6, running=1, usable=1) == ("withdraw", 0)
    assert growth.decide(now=7, running=1, usable=2) == ("wait", 0)  # back: settles again from 7 s
    assert growth.decide(now=11, running=1, usable=2) == ("wait", 0)
    assert growth.decide(now=12, running=1, usable=2) == ("ask", 2)
    # Answered after all, the node gone again: the workers wait, so they restart on what there is.
    assert growth.decide(now=14, running=1, usable=1, ready=6, registered=6) == ("resize", 1)


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


def _policy(monkeypatch, usable: list, sizes: ElasticSizes, *, count: bool = True):
    """The policy as Ray Train's controller holds it (built by the trainer, its coordinator requests
    aside), each look at the cluster finding the next of ``usable`` whole nodes (an exception: the look
    fails); ``count=False``: its own count, of whatever ``ray.nodes()`` says. The driver's start timeout
    is training/train.py's; the policy's changes to it are undone after the test."""
    from ray.train import ScalingConfig

    looks = iter(usable)

    def look(*args, **kwargs):
        found = next(looks)
        if isinstance(found, Exception):
            raise found
        return ["node"] * found

    if count:
        monkeypatch.setattr(elastic_policy, "usable_nodes", look)
    monkeypatch.setattr(elastic_policy, "LOOK_EVERY_S", 0.0)
    monkeypatch.setenv(elastic_policy.START_TIMEOUT_ENV, "900")
    policy = elastic_policy.elastic_policy(ScalingConfig(num_workers=(sizes.workers(sizes.min_nodes),
                                                                      sizes.workers(sizes.max_nodes))), sizes, "inv")
    policy._maybe_send_resource_request = lambda: None
    return policy


class Group(list):
    """A started worker group as Ray Train's callbacks see it: one entry a rank, ``execute`` run here."""

    def execute(self, fn, *args, **kwargs):
        return [fn(*args, **kwargs)]


def _report_handler(invocation: str, ranks: int):
    """Ray Train's report handler (the controller's, ray/train/v2/_internal/execution/checkpoint/report_handler.py)
    with the run's growth report callback, for a worker group of ``ranks`` just started, and how a poll hands
    it each rank's report of a checkpoint of some step (``{rank: step}``)."""
    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.checkpoint.report_handler import ReportCallbackHandler
    from ray.train.v2._internal.execution.training_report import _TrainingReport
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus

    reports = elastic_policy.growth_reports(invocation)
    handler, group = ReportCallbackHandler(report_callbacks=[reports]), Group(range(ranks))
    handler.after_worker_group_start(group)
    reports.after_worker_group_start(group)

    def poll(steps: dict[int, int]) -> None:
        handler.after_worker_group_poll_status(WorkerGroupPollStatus(worker_statuses={
            rank: WorkerStatus(running=True, training_report=_TrainingReport(
                checkpoint=Checkpoint(f"/runs/checkpoint_{steps[rank]}"), metrics={"step": steps[rank]}, validation=False)
                if rank in steps else None) for rank in range(ranks)}))

    return poll


def test_the_policy_starts_on_the_whole_nodes_there_are_and_grows_once_ray_train_registered_the_workers_checkpoint(
        monkeypatch, kv):
    """The restart comes once Ray Train's report handler has every rank's report of the growth's checkpoint
    (its checkpoint manager registers it then, and the new group resumes from it), not at a timed look:
    the controller drops the reports it holds when it stops the old group."""
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision

    sizes = ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=4, settle_s=0)
    policy = _policy(monkeypatch, [1, 2, 2, 2, 2, 2, 2], sizes)
    started = policy.make_decision_for_non_running_worker_group()
    assert started == ResizeDecision(num_workers=4, resources_per_worker={"CPU": 1.0})  # one node of two
    poll = _report_handler("inv", ranks=4)
    running = SimpleNamespace(num_workers=4)
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)  # a node joined: asked
    assert elastic.growth_asked("inv") == {"generation": 1, "nodes": 2}
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)  # no answer yet
    poll({rank: 38 for rank in range(4)})  # an earlier checkpoint, registered
    elastic.say_ready("inv", 1, step=40)  # rank 0, once every rank's checkpoint of step 40 is uploaded and queued
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)  # not registered
    poll({0: 40, 1: 40, 2: 40})  # rank 3's report missed this poll: the handler waits for it
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)
    poll({3: 40})
    grown = policy.make_decision_for_running_worker_group(running, None)
    assert grown == ResizeDecision(num_workers=8, resources_per_worker={"CPU": 1.0})
    # The new worker group starts with nothing asked of it; an answer of the old one is not its own.
    assert elastic.growth_asked("inv") is None and elastic.ready_step("inv", 2) is None


def test_a_growth_checkpoint_ray_train_never_registers_restarts_the_workers_after_a_bound_and_says_so(
        monkeypatch, kv, capsys):
    """The workers wait (their GPUs idle) until the restart: the policy waits ``REGISTERED_WAIT_S`` for the
    registration, then restarts them anyway, from the checkpoint before (the log says the steps since are
    trained again)."""
    growth = Growth(ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=1, settle_s=0))
    assert growth.decide(now=100, running=1, usable=2, ready=40, registered=38) == ("wait", 0)
    assert growth.decide(now=129.9, running=1, usable=2, ready=40, registered=38) == ("wait", 0)
    assert growth.decide(now=130, running=1, usable=2, ready=40, registered=38) == ("resize unregistered", 2)
    assert elastic.REGISTERED_WAIT_S == 30.0

    monkeypatch.setattr(elastic, "REGISTERED_WAIT_S", 0.0)
    policy = _policy(monkeypatch, [1, 2, 2], ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=1, settle_s=0))
    policy.make_decision_for_non_running_worker_group()
    running = SimpleNamespace(num_workers=1)
    policy.make_decision_for_running_worker_group(running, None)  # asked
    elastic.say_ready("inv", 1, step=40)
    assert policy.make_decision_for_running_worker_group(running, None).num_workers == 2
    assert ("[elastic] Ray Train has not registered the checkpoint of step 40 in 0 s: restarting on 2 nodes (2 workers) "
            "from the checkpoint before it (the steps since are trained again)") in capsys.readouterr().out


def test_the_growths_restart_counts_only_the_nodes_whose_raylet_answers(monkeypatch, kv):
    """A node that died a moment before the restart is still alive to the GCS (until its health checks
    fail): counted, the new group's placement would wait for it the whole start timeout. The raylets here
    are real sockets: two listen, the third's port is closed."""
    import socket

    import ray
    from ray._private.state import state

    raylets = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    with socket.create_server(("127.0.0.1", 0)) as gone:
        dead_port = gone.getsockname()[1]
    nodes = [_node("a", port=raylets[0].getsockname()[1])]
    monkeypatch.setattr(ray, "nodes", lambda: list(nodes))
    monkeypatch.setattr(state, "get_draining_nodes", lambda: {})
    policy = _policy(monkeypatch, [], ElasticSizes(min_nodes=1, max_nodes=3, workers_per_node=4, settle_s=0), count=False)
    assert policy.make_decision_for_non_running_worker_group().num_workers == 4
    nodes += [_node("b", port=raylets[1].getsockname()[1]), _node("cc", port=dead_port)]
    running = SimpleNamespace(num_workers=4)
    policy.make_decision_for_running_worker_group(running, None)
    assert elastic.growth_asked("inv") == {"generation": 1, "nodes": 3}  # asked from the GCS's count
    elastic.say_ready("inv", 1, step=8)
    elastic_policy.note_registered("inv", 8)
    assert policy.make_decision_for_running_worker_group(running, None).num_workers == 8  # a and b: cc's raylet is gone
    for raylet in raylets:
        raylet.close()


def test_a_start_on_nodes_that_are_there_has_ray_trains_own_start_timeout_and_a_wait_below_the_minimum_the_long_one(
        monkeypatch, kv):
    """Ray Train's ``WorkerGroup`` reads its start timeout from the controller's environment when it is
    built, at each start; the driver's 900 s (training/train.py) is a wait for a replacement. On nodes that
    are there the policy gives Ray Train's own default (60 s), so a node that went after the count costs a
    minute before the policy counts again, not 15."""
    import inspect
    import os

    from ray.train.v2._internal import constants
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    assert constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR == elastic_policy.START_TIMEOUT_ENV
    assert constants.DEFAULT_WORKER_GROUP_START_TIMEOUT_S == elastic_policy.START_ON_NODES_THERE_S == 60.0
    assert "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR" in inspect.getsource(WorkerGroup.__init__)
    policy = _policy(monkeypatch, [1, 2, 3], ElasticSizes(min_nodes=2, max_nodes=3, workers_per_node=4, settle_s=0))
    assert policy.make_decision_for_non_running_worker_group().num_workers == 8  # 1 node: waits for a second
    assert os.environ[elastic_policy.START_TIMEOUT_ENV] == "900"
    assert policy.make_decision_for_non_running_worker_group().num_workers == 8  # 2 nodes, the minimum: there
    assert os.environ[elastic_policy.START_TIMEOUT_ENV] == "60"
    assert policy.make_decision_for_non_running_worker_group().num_workers == 12
    assert os.environ[elastic_policy.START_TIMEOUT_ENV] == "60"


def test_a_look_at_the_cluster_that_fails_while_the_group_trains_is_no_controller_error_and_is_taken_again(
        monkeypatch, kv, capsys):
    """Ray Train's controller wraps whatever a policy raises in a ``ControllerError``, which its failure
    policy does not retry (shown with Ray's own ``DefaultFailurePolicy``): the policy looks at the GCS every
    second for the whole run, so a call that fails a moment must not end it. The look answers
    ``NoopDecision``, said once a minute, and the next look is taken whole (an ask not written is asked again)."""
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision
    from ray.train.v2.api.exceptions import ControllerError

    ray_policy = DefaultFailurePolicy(FailureConfig(max_failures=-1, controller_failure_limit=-1))
    assert ray_policy.make_decision(ControllerError(RuntimeError("GCS RPC timed out"))) == FailureDecision.RAISE
    policy = _policy(monkeypatch, [1, RuntimeError("GCS RPC timed out"), ConnectionError("GCS restarting"), 2, 2],
                     ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=1, settle_s=0))
    policy.make_decision_for_non_running_worker_group()
    running = SimpleNamespace(num_workers=1)
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)
    said = [line for line in capsys.readouterr().out.splitlines() if "a look at the cluster failed" in line]
    assert said == ["[elastic] a look at the cluster failed (RuntimeError: GCS RPC timed out): the worker group trains on "
                    "as it is; looking again in a second"]
    puts = kv._internal_kv_put
    monkeypatch.setattr(kv, "_internal_kv_put", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("KV put failed")))
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)  # the ask not written
    monkeypatch.setattr(kv, "_internal_kv_put", puts)
    policy.make_decision_for_running_worker_group(running, None)
    assert elastic.growth_asked("inv") == {"generation": 1, "nodes": 2}  # asked at the next look


def test_a_look_that_fails_before_a_worker_group_starts_is_taken_again_after_a_pause_not_raised(monkeypatch, kv, capsys):
    """Before a group starts the controller asks again at once after a ``NoopDecision`` (Ray's own elastic
    policy answers one there when its cluster read fails), so the policy pauses first: no spin."""
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision

    pauses = []
    monkeypatch.setattr(elastic_policy.time, "sleep", pauses.append)
    policy = _policy(monkeypatch, [RuntimeError("GCS RPC timed out"), 2, 2],
                     ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=1, settle_s=0))
    assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)
    deletes = kv._internal_kv_del
    monkeypatch.setattr(kv, "_internal_kv_del", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("KV del failed")))
    assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)  # the old handshake stays: no start
    monkeypatch.setattr(kv, "_internal_kv_del", deletes)
    assert policy.make_decision_for_non_running_worker_group().num_workers == 2
    assert pauses == [elastic_policy.LOOK_AGAIN_S] * 2 and policy.generation == 1
    assert "no worker group starts yet; looking again in 1 s" in capsys.readouterr().out


def test_below_its_minimum_an_elastic_run_asks_for_the_minimum_and_a_spot_reclaim_never_replaced_stops_it_at_the_deadline(
        monkeypatch, kv):
    """Ray's own elastic policy returns ``NoopDecision`` there, and its controller loops on it with no
    wait and no deadline. Ours asks for the minimum with the driver's long start timeout (Ray Train's
    placement wait itself is not run here: the count is stood in), and the retry counter stops the run at
    the first start timeout past the replacement bound after the loss, a Spot reclaim here (every kind of
    loss: tests/training/test_retry_budget.py), as it stops a fixed-size run."""
    import os
    import time

    from ray.train import PreemptionInfo
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState, RestartingState, RunningState
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision
    from ray.train.v2.api.exceptions import ControllerError, PreemptionError

    from training.resilience import faults, preemption
    from training.resilience.preemption import NoReplacement, retry_counter

    policy = _policy(monkeypatch, [1], ElasticSizes(min_nodes=2, max_nodes=3, workers_per_node=4, settle_s=0))
    assert policy.make_decision_for_non_running_worker_group() == ResizeDecision(num_workers=8,
                                                                                 resources_per_worker={"CPU": 1.0})
    assert os.environ[elastic_policy.START_TIMEOUT_ENV] == "900"
    monkeypatch.setattr(faults, "faults_recorded", lambda invocation: {})
    monkeypatch.setattr(preemption, "_capacity_trouble", lambda: None)
    counter = retry_counter("inv", max_failures=0, grace_s=0, replacement_timeout_s=1500)
    reclaimed = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"5f1c0e9a77d2aa": [4, 5, 6, 7]})
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now - 1800)  # the reclaim, 30 min ago
    counter.after_controller_state_update(RunningState(), RestartingState(training_failed_error=PreemptionError(reclaimed)))
    monkeypatch.setattr(time, "time", lambda: now)
    timed_out = ReschedulingState(training_failed_error=ControllerError(WorkerGroupStartupTimeoutError(num_workers=8)))
    with pytest.raises(NoReplacement, match=r"the run lost 30 min ago(?s:.*)node\(s\) 5f1c0e9a77d2: preempted with notice"):
        counter.after_controller_state_update(RunningState(), timed_out)


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


def test_a_fixed_size_run_or_a_new_run_resumed_at_another_size_is_no_resize():
    """A fixed-size run never resizes within a run; a new run resumed from a checkpoint of another size
    (the first group of its invocation: no group before it) is said at its restore, resharded, and
    published as nothing: only an elastic run's restart at another size is a resize."""
    from training.resizing import resized_from

    fixed = _parse("--num-workers", "16", "--workers-per-node", "8", "--global-batch-size", "96", "--micro-batch-size", "1")
    elastic_run = replace(fixed, num_workers=32, min_nodes=2)
    assert resized_from(fixed, 16, 32) is None
    assert resized_from(elastic_run, 16, None) is None
    assert resized_from(elastic_run, 16, 16) is None and resized_from(elastic_run, 16, 24) == 24


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

"""An elastic run's controller side (training/resilience/elastic_policy.py, elastic.py), without a Ray
cluster: how the policy counts whole nodes (Ray's own ``ray.nodes()`` and draining records, as dicts;
raylets as real sockets), when it grows (settle time, the checkpoint handshake, the registration of the
growth's checkpoint through Ray Train's own report handler), the policy as Ray Train 2.58's controller
calls it (its decision classes, one look a call) and when a look at the cluster fails, its start
timeouts, below its minimum the replacement deadline of a fixed-size run, and the private names it goes
in by. Ray's key-value store is stood in (tests/training/elastic_standins.py). The resizes themselves,
on a multi-node Ray, are in test_preemption.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from elastic_standins import Group

from training.resilience import elastic, elastic_policy
from training.resilience.elastic import ElasticSizes, Growth, whole_nodes


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


def test_looks_that_fail_for_minutes_where_the_run_cannot_go_on_without_them_stop_it_and_a_training_group_trains_on(
        monkeypatch, kv, capsys):
    """Failures that last (GCS trouble past its fault tolerance, node records a Ray upgrade changed; a
    clock stands in for the minutes): before a worker group starts the controller stays in its state with
    no timeout and no start (so no replacement deadline), and once the workers were asked to grow they hold
    for the restart; in both the run stops after ``GIVE_UP_S``, resumable, instead of idling until the
    RayJob's deadline. A group that trains with nothing asked trains on whatever the looks do."""
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision

    clock = [1000.0]
    monkeypatch.setattr(elastic_policy.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(elastic_policy.time, "sleep", lambda seconds: clock.__setitem__(0, clock[0] + seconds))
    down = RuntimeError("GCS unavailable")
    sizes = ElasticSizes(min_nodes=1, max_nodes=2, workers_per_node=1, settle_s=0)
    looks_in_the_limit = int(elastic_policy.GIVE_UP_S / elastic_policy.LOOK_AGAIN_S)
    policy = _policy(monkeypatch, [down] * (looks_in_the_limit + 2), sizes)
    for _ in range(looks_in_the_limit + 1):  # the first at 0 s, the last at 300 s
        assert isinstance(policy.make_decision_for_non_running_worker_group(), NoopDecision)
    with pytest.raises(elastic_policy.ClusterUnreadable, match="could not read its cluster for 5 min .*GCS unavailable.*resume"):
        policy.make_decision_for_non_running_worker_group()

    # A group of 1 trains, nothing asked: the looks fail for an hour, it trains on.
    policy = _policy(monkeypatch, [1] + [down] * 3601 + [2, down, down], sizes)
    policy.make_decision_for_non_running_worker_group()
    running = SimpleNamespace(num_workers=1)
    for _ in range(3601):
        clock[0] += 1
        assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)
    clock[0] += 1
    policy.make_decision_for_running_worker_group(running, None)  # the look works: the workers are asked to grow
    assert elastic.growth_asked("inv") == {"generation": 1, "nodes": 2}
    clock[0] += 1
    assert isinstance(policy.make_decision_for_running_worker_group(running, None), NoopDecision)
    clock[0] += elastic_policy.GIVE_UP_S + 1
    with pytest.raises(elastic_policy.ClusterUnreadable, match="the workers asked to grow may be waiting"):
        policy.make_decision_for_running_worker_group(running, None)


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

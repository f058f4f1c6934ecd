"""The scaling policy Ray Train runs for an elastic run (training/resilience/elastic.py says what it
does and why not Ray's own), and where it goes in.

Ray 2.58 gives no public way to hand a trainer a scaling policy: ``DataParallelTrainer.fit`` builds
one with the module-level ``create_scaling_policy`` of ``ray.train.v2.api.data_parallel_trainer``
(imported there from ``_internal/execution/scaling_policy/factory.py``) and passes it to the controller
actor. :func:`installed` replaces that name for the length of one ``fit`` (tests/training/test_elastic.py
pins both names). The policy is pickled into the controller like the retry counter.
"""

from __future__ import annotations

import contextlib
import socket
import time

from .elastic import ElasticSizes, Growth, ask_to_grow, nodes_to_start_line, ready_for, whole_nodes, withdraw

#: How often the policy reads the GCS's nodes while the worker group trains (the controller asks it
#: at every poll, 0.2 s: training/train.py ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``).
LOOK_EVERY_S = 1.0
#: How long the policy waits for a node's raylet to answer a connection before a worker group starts
#: (:func:`usable_nodes`).
RAYLET_ANSWER_S = 2.0


def elastic_policy(scaling_config, sizes: ElasticSizes, invocation_id: str):
    """A Ray Train ``ScalingPolicy`` that starts each worker group on the whole nodes there are (the
    minimum when fewer: its placement waits for a replacement) and grows a running group at a
    checkpoint, through the handshake of training/resilience/elastic.py."""
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision, ScalingPolicy

    class WholeNodePolicy(ScalingPolicy):
        def __init__(self) -> None:
            super().__init__(scaling_config)
            self.growth, self.generation, self.looked_at = Growth(sizes), 0, float("-inf")

        def _get_num_workers_for_resource_request(self) -> int:
            return sizes.workers(sizes.max_nodes)  # what an autoscaler is asked for: the whole run

        def _new_group(self, nodes: int):
            """The decision to start a worker group of ``nodes`` nodes: a new generation, whose handshake
            starts empty (an older group's ask or answer is not this one's)."""
            self.generation += 1
            self.growth = Growth(sizes)
            withdraw(invocation_id, answer_too=True)
            return ResizeDecision(num_workers=sizes.workers(nodes),
                                  resources_per_worker=scaling_config._resources_per_worker_not_none)

        def make_decision_for_non_running_worker_group(self):
            self._maybe_send_resource_request()
            usable = len(usable_nodes(sizes, scaling_config, answering=True))
            print(nodes_to_start_line(sizes, usable), flush=True)
            return self._new_group(sizes.nodes_to_start(usable))

        def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
            self._maybe_send_resource_request()
            now = time.monotonic()
            if now - self.looked_at < LOOK_EVERY_S:
                return NoopDecision()
            self.looked_at = now
            running = worker_group_state.num_workers // sizes.workers_per_node
            usable = len(usable_nodes(sizes, scaling_config))
            action, nodes = self.growth.decide(now=now, running=running, usable=usable,
                                               ready=ready_for(invocation_id, self.generation))
            if action == "ask":
                print(f"[elastic] {usable} whole nodes for {running} training, for {sizes.settle_s:.0f} s: the run grows to "
                      f"{nodes} at its next checkpoint", flush=True)
                ask_to_grow(invocation_id, self.generation, nodes)
            elif action == "withdraw":
                print(f"[elastic] the nodes went before the next checkpoint: the run stays on {running}", flush=True)
                withdraw(invocation_id)
            elif action == "resize":
                print(f"[elastic] the workers checkpointed: restarting on {nodes} nodes ({sizes.workers(nodes)} workers)",
                      flush=True)
                return self._new_group(nodes)
            return NoopDecision()

    return WholeNodePolicy()


def usable_nodes(sizes: ElasticSizes, scaling_config, *, answering: bool = False) -> list[str]:
    """The whole nodes a worker group can start on now, from a fresh read of the GCS; ``answering``
    (before a worker group starts): only those whose raylet answers too. After a node is lost, the
    surviving workers' errors (a collective's peer gone) reach the controller before the GCS declares
    the node dead (after its missed health checks: Ray's defaults, 5 of 3 s each), and a worker group
    asked for on it would wait for it the whole start timeout (900 s, training/train.py)."""
    import ray
    from ray._private.state import state

    nodes = ray.nodes()
    found = whole_nodes(nodes, draining=set(state.get_draining_nodes()),
                        per_worker=scaling_config._resources_per_worker_not_none, workers_per_node=sizes.workers_per_node)
    by_id = {node["NodeID"]: node for node in nodes}
    return [node for node in found if not answering or raylet_answers(by_id[node])]


def raylet_answers(node: dict, timeout_s: float = RAYLET_ANSWER_S) -> bool:
    """Whether the node's raylet accepts a connection on its port (``NodeManagerAddress``, ``NodeManagerPort``)."""
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def installed(sizes: ElasticSizes | None, invocation_id: str):
    """Around ``trainer.fit()``: an elastic run's trainer builds :func:`elastic_policy` instead of Ray's
    own (``ScalingConfig(num_workers=(min, max))``); a fixed-size run's, Ray's as before."""
    if sizes is None:
        yield
        return
    from ray.train.v2.api import data_parallel_trainer

    ray_own = data_parallel_trainer.create_scaling_policy

    def create(scaling_config):
        if not scaling_config.elasticity_enabled:
            return ray_own(scaling_config)
        return elastic_policy(scaling_config, sizes, invocation_id)

    data_parallel_trainer.create_scaling_policy = create
    try:
        yield
    finally:
        data_parallel_trainer.create_scaling_policy = ray_own

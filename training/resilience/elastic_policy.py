"""The scaling policy Ray Train runs for an elastic run (training/resilience/elastic.py says what it
does and why not Ray's own), the report callback that tells it when the growth's checkpoint is
registered, and where the policy goes in.

Ray 2.58 gives no public way to hand a trainer a scaling policy: ``DataParallelTrainer.fit`` builds
one with the module-level ``create_scaling_policy`` of ``ray.train.v2.api.data_parallel_trainer``
(imported there from ``_internal/execution/scaling_policy/factory.py``) and passes it to the controller
actor. :func:`installed` replaces that name for the length of one ``fit`` (tests/training/test_elastic.py
pins both names). The policy is pickled into the controller like the retry counter, and the report
callback (:func:`growth_reports`, ``RunConfig(callbacks=...)``) beside it; both reach the registered
step through this module's functions, which run in the controller's process.

A look at the cluster (the GCS's nodes, its key-value store) that fails is never the run's end: the
controller wraps whatever a policy raises in a ``ControllerError``, which its failure policy does not
retry (ray/train/v2/_internal/execution/controller/controller.py ``_run_control_loop_iteration``,
failure_handling/default.py ``_is_retryable_error``), so the policy answers ``NoopDecision`` and looks
again, as Ray's own ``ElasticScalingPolicy`` does when its cluster read fails (scaling_policy/elastic.py
``_get_reserved_resources``: "Will not resize the worker group ... transiently during network partition").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time

from . import elastic
from .elastic import ElasticSizes, Growth, ask_to_grow, nodes_to_start_line, ready_step, whole_nodes, withdraw

#: How often the policy reads the GCS's nodes while the worker group trains (the controller asks it
#: at every poll, 0.2 s: training/train.py ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``).
LOOK_EVERY_S = 1.0
#: How long the policy waits for a node's raylet to answer a connection (:func:`usable_nodes`).
RAYLET_ANSWER_S = 2.0
#: Ray Train's worker-group start timeout, read from the controller's environment by each new
#: ``WorkerGroup`` (ray/train/v2/_internal/execution/worker_group/worker_group.py ``__init__``).
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
#: The start timeout of a worker group on nodes that are there (at or above ``--min-nodes``): Ray Train's
#: own default (ray/train/v2/_internal/constants.py ``DEFAULT_WORKER_GROUP_START_TIMEOUT_S``), which Ray
#: chose for this case: a placement wait that "could hang ... [when] the controller may try to set a worker
#: group size based on stale information about cluster resources" (worker_group.py, before
#: ``pg_handle.wait``). The wait covers the placement group's reservation only (the workers, the model and
#: the checkpoint come after it), which on nodes whose raylets answer takes seconds; a node that died or
#: began to drain after the count costs this much, not 15 minutes, before the policy counts again.
START_ON_NODES_THERE_S = 60.0
#: A failed look is said at most this often (the policy looks every second).
SAY_TROUBLE_EVERY_S = 60.0
#: How long the looks may fail in a row where the run cannot go on without them (no worker group yet,
#: or the workers asked to grow): then the run stops, resumable, rather than idle its GPUs without a
#: deadline. A GCS restart with fault tolerance takes seconds to a minute (Ray's GCS fault tolerance
#: guide: the raylets reconnect within ``gcs_rpc_server_reconnect_timeout_s``, 60 s by default).
GIVE_UP_S = 300.0
#: The pause before a failed look before a worker group starts is tried again: the controller asks
#: again at once after a ``NoopDecision`` in that state (controller.py ``_step``), with no wait of its own.
LOOK_AGAIN_S = 1.0

#: The latest step whose checkpoint Ray Train registered for the running worker group, by invocation
#: (in the controller's process: :func:`growth_reports` writes it, the policy reads it).
_REGISTERED: dict[str, int] = {}


def registered_step(invocation_id: str) -> int | None:
    """The latest step whose checkpoint Ray Train registered for the running worker group, or None."""
    return _REGISTERED.get(invocation_id)


def note_registered(invocation_id: str, step: int | None) -> None:
    """Ray Train registered the checkpoint of ``step`` (None: a new worker group, nothing registered yet)."""
    if step is None:
        _REGISTERED.pop(invocation_id, None)
    else:
        _REGISTERED[invocation_id] = step


def growth_reports(invocation_id: str):
    """A Ray Train report callback (``RunConfig(callbacks=[...])``) that notes each checkpoint Ray Train
    registered for the running worker group, by its step: the controller's report handler calls it once
    every rank's report is in, after the checkpoint manager registered the checkpoint (it comes first in
    the handler's list: controller.py ``__init__``; report_handler.py ``after_worker_group_poll_status``)."""
    from ray.train.v2._internal.execution.callback import ReportCallback, WorkerGroupCallback

    class GrowthReports(ReportCallback, WorkerGroupCallback):
        def after_report(self, training_report, metrics) -> None:
            if training_report.checkpoint is not None and training_report.metrics.get("step") is not None:
                note_registered(invocation_id, int(training_report.metrics["step"]))

        def after_worker_group_start(self, worker_group) -> None:
            note_registered(invocation_id, None)

    return GrowthReports()


class ClusterUnreadable(RuntimeError):
    """The policy could not read the cluster for :data:`GIVE_UP_S` where the run cannot go on without it."""


class Trouble:
    """Failed looks in a row: said once a minute at most, and since when they fail."""

    def __init__(self) -> None:
        self.said_at, self.since = float("-inf"), None

    def say(self, error: BaseException, what: str) -> None:
        """Print ``what`` with the error, unless said in the last :data:`SAY_TROUBLE_EVERY_S`."""
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        if now - self.said_at >= SAY_TROUBLE_EVERY_S:
            self.said_at = now
            print(f"[elastic] a look at the cluster failed ({type(error).__name__}: {str(error)[:300]}): {what}", flush=True)

    def clear(self) -> None:
        """A look that worked: the failures in a row are over."""
        self.since = None

    def failed(self, error: BaseException, what: str, *, stop_because: str | None = None) -> None:
        """A failed look: said (:meth:`say`); where the run cannot go on without looks (``stop_because``:
        why), :class:`ClusterUnreadable` once they have failed for :data:`GIVE_UP_S` in a row (the controller
        waits in a state with no timeout of its own, and no start, so no replacement deadline)."""
        self.say(error, what)
        if stop_because:
            self.give_up(error, stop_because)

    def give_up(self, error: BaseException, why: str) -> None:
        """Raise :class:`ClusterUnreadable` once the looks have failed for :data:`GIVE_UP_S` in a row."""
        if self.since is not None and time.monotonic() - self.since > GIVE_UP_S:
            raise ClusterUnreadable(
                f"the elastic run could not read its cluster for {GIVE_UP_S / 60:.0f} min ({type(error).__name__}: "
                f"{str(error)[:300]}), and {why}: the run stops (a Ray Train controller error). Its checkpoints stay; "
                "run it again to resume from the last one (ray-train-eks submit --resume)") from error


def set_start_timeout(nodes_there: bool, wait_for_replacement_s: str | None) -> None:
    """The start timeout of the next worker group (the controller's process): Ray Train's own where the
    nodes are there, the driver's long wait (training/train.py) where it waits for a replacement."""
    if nodes_there:
        long_s = float(wait_for_replacement_s) if wait_for_replacement_s else START_ON_NODES_THERE_S
        os.environ[START_TIMEOUT_ENV] = f"{min(START_ON_NODES_THERE_S, long_s):g}"
    elif wait_for_replacement_s:
        os.environ[START_TIMEOUT_ENV] = wait_for_replacement_s
    else:
        os.environ.pop(START_TIMEOUT_ENV, None)


def elastic_policy(scaling_config, sizes: ElasticSizes, invocation_id: str):
    """A Ray Train ``ScalingPolicy`` that starts each worker group on the whole nodes there are (the
    minimum when fewer: its placement waits for a replacement) and grows a running group at a
    checkpoint, through the handshake of training/resilience/elastic.py."""
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision, ScalingPolicy

    wait_for_replacement_s = os.environ.get(START_TIMEOUT_ENV)  # the driver's (training/train.py: 900 s)

    class WholeNodePolicy(ScalingPolicy):
        def __init__(self) -> None:
            super().__init__(scaling_config)
            self.growth, self.generation, self.looked_at, self.trouble = Growth(sizes), 0, float("-inf"), Trouble()

        def _get_num_workers_for_resource_request(self) -> int:
            return sizes.workers(sizes.max_nodes)  # what an autoscaler is asked for: the whole run

        def _new_group(self, usable: int):
            """The decision to start a worker group on ``usable`` whole nodes (the minimum when fewer): a
            new generation, whose handshake starts empty (an older group's ask or answer is not this one's)."""
            withdraw(invocation_id, answer_too=True)
            note_registered(invocation_id, None)
            self.generation, self.growth = self.generation + 1, Growth(sizes)
            set_start_timeout(usable >= sizes.min_nodes, wait_for_replacement_s)
            return ResizeDecision(num_workers=sizes.workers(sizes.nodes_to_start(usable)),
                                  resources_per_worker=scaling_config._resources_per_worker_not_none)

        def make_decision_for_non_running_worker_group(self):
            self._maybe_send_resource_request()
            try:
                usable = len(usable_nodes(sizes, scaling_config, answering=True))
                decision = self._new_group(usable)
            except Exception as error:  # noqa: BLE001 - see the module's docstring
                self.trouble.failed(error, f"no worker group starts yet; looking again in {LOOK_AGAIN_S:g} s",
                                    stop_because="no worker group can start without it")
                time.sleep(LOOK_AGAIN_S)
                return NoopDecision()
            self.trouble.clear()
            print(nodes_to_start_line(sizes, usable), flush=True)
            return decision

        def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
            self._maybe_send_resource_request()
            now = time.monotonic()
            if now - self.looked_at < LOOK_EVERY_S:
                return NoopDecision()
            self.looked_at = now
            before = dataclasses.replace(self.growth)
            try:
                decision = self._look(now, worker_group_state.num_workers // sizes.workers_per_node)
            except Exception as error:  # noqa: BLE001 - see the module's docstring
                self.growth = before  # the look is taken again whole: an ask not written is asked again
                waiting = before.asked is not None or before.answered_at is not None  # the workers may hold for the restart
                self.trouble.failed(error, "the worker group trains on as it is; looking again in a second",
                                    stop_because="the workers asked to grow may be waiting for the restart" if waiting else None)
                return NoopDecision()
            self.trouble.clear()
            return decision

        def _look(self, now: float, running: int):
            """One look while the group trains: the ask, its withdrawal, or the restart on more nodes."""
            ready = ready_step(invocation_id, self.generation)
            # Once the workers wait, the restart's size: only nodes whose raylet answers (a node that died a
            # moment ago is still alive to the GCS, and a placement on it would wait the start timeout).
            usable = len(usable_nodes(sizes, scaling_config, answering=ready is not None))
            action, nodes = self.growth.decide(now=now, running=running, usable=usable, ready=ready,
                                               registered=registered_step(invocation_id))
            if action == "ask":
                ask_to_grow(invocation_id, self.generation, nodes)
                print(f"[elastic] {usable} whole nodes for {running} training, for {sizes.settle_s:.0f} s: the run grows to "
                      f"{nodes} at its next checkpoint", flush=True)
            elif action == "withdraw":
                withdraw(invocation_id)
                print(f"[elastic] the nodes went before the next checkpoint: the run stays on {running}", flush=True)
            elif action.startswith("resize"):
                decision = self._new_group(usable)
                print(restart_line(action, ready, nodes, sizes), flush=True)
                return decision
            return NoopDecision()

    return WholeNodePolicy()


def restart_line(action: str, ready: int | None, nodes: int, sizes: ElasticSizes) -> str:
    """What the growth's restart says: on the checkpoint Ray Train registered, or without it after the wait."""
    if action == "resize":
        return f"[elastic] the checkpoint of step {ready} is registered: restarting on {nodes} nodes ({sizes.workers(nodes)} workers)"
    return (f"[elastic] Ray Train has not registered the checkpoint of step {ready} in {elastic.REGISTERED_WAIT_S:.0f} s: "
            f"restarting on {nodes} nodes ({sizes.workers(nodes)} workers) from the checkpoint before it (the steps since "
            "are trained again)")


def usable_nodes(sizes: ElasticSizes, scaling_config, *, answering: bool = False) -> list[str]:
    """The whole nodes a worker group can start on now, from a fresh read of the GCS; ``answering``
    (before a worker group starts, and before a growth's restart): only those whose raylet answers too.
    After a node is lost, the surviving workers' errors (a collective's peer gone) reach the controller
    before the GCS declares the node dead (after its missed health checks: Ray's defaults, 5 of 3 s each),
    and a worker group asked for on it would wait for it the whole start timeout."""
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

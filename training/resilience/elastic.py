"""An elastic run (``--min-nodes N``): it goes on with the whole nodes it has and grows back.

- Sizes. The run trains on whole nodes, ``--min-nodes`` up to its own (``num_workers /
  workers_per_node``): a node's workers are one HSDP shard group (training/modeling/parallel.py), so
  each GPU holds the same shards at every size, and the memory plan is checked at the smallest and
  the largest (training/modeling/plan.py ``check_sizes``). The global batch, the learning-rate
  schedule (per step) and the data order (``DataOrder`` draws a step's global batch before it splits
  it by worker: training/data/order.py) are the same at every size; only the accumulation steps
  follow the size, so the global batch must split evenly at each (:func:`elastic_problems`).
- Losing nodes. A node lost (a Spot reclaim, a node taken out, one that vanished) ends the worker
  group as in a fixed-size run; Ray Train restarts it (RESTARTING), and the restart takes the whole
  nodes there are then (:func:`whole_nodes`, read fresh from the GCS, each raylet asked), from the last
  checkpoint or the one taken at the notice, with Ray Train's own start timeout (60 s: the nodes are
  there). Below the minimum it asks for the minimum: the placement group waits for a replacement as a
  fixed-size run's does (15 minutes a try), and the run stops at the replacement deadline, which every
  lost node starts (training/resilience/replacement.py).
- Growing back. Nodes that joined are trained on once they have stayed ``--elastic-settle-s``, and
  only at a checkpoint: the controller asks the workers (:func:`ask_to_grow`, Ray's key-value store);
  at their next checkpoint step they write that checkpoint, wait for its upload and answer
  (:func:`say_ready`); once Ray Train has registered that checkpoint (a report callback tells the
  policy), the controller restarts the worker group on the nodes whose raylets answer, and it resumes
  from it (:class:`Growth`). Nothing trained is lost and nothing is trained twice. A preemption notice
  while the workers wait releases the node at once, as at any notice (training/reporting.py
  ``hold_for_growth``).

Why not Ray's own ``ElasticScalingPolicy`` (ray 2.58, ``ray/train/v2/_internal/execution/
scaling_policy/elastic.py``): it counts worker slots, not whole nodes, from a view of the cluster an
``AutoscalingCoordinator`` actor refreshes every 20 s (``default_autoscaling_coordinator.py``
``TICK_INTERVAL_S``), so after a node is lost it first asks for the old size and waits the whole
worker-group start timeout (900 s here, training/train.py); below its minimum it returns
``NoopDecision`` and the controller's loop spins with no wait and no deadline; and it grows by
killing the workers mid-step. This module is the policy's logic, without Ray; the policy Ray Train
runs is training/resilience/elastic_policy.py.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping

#: Ray's key-value namespace of the growth handshake (keys ``<invocation>/ask`` and ``<invocation>/ready``).
NAMESPACE = "ray-train-eks-elastic"
#: How long the controller waits, once the workers answered, for Ray Train to register their growth
#: checkpoint before it restarts them anyway (the new group then resumes from the checkpoint before it, and
#: the steps since are trained again, said in the log). Ray Train takes each rank's report at a poll of
#: the controller (every 0.2 s here, training/train.py; a poll that misses it is carried to the next one:
#: ray/train/v2/_internal/execution/worker_group/worker_group.py ``poll_status``), so 30 s is 150 polls.
REGISTERED_WAIT_S = 30.0
#: Tries of rank 0's answer, :data:`ANSWER_PAUSE_S` apart, before the workers train on (and answer at a later checkpoint).
ANSWER_TRIES = 3
ANSWER_PAUSE_S = 1.0


@dataclass(frozen=True)
class ElasticSizes:
    """The whole-node sizes an elastic run may train at, and how long joined nodes settle."""

    min_nodes: int
    max_nodes: int
    workers_per_node: int
    settle_s: float

    @classmethod
    def of(cls, config) -> "ElasticSizes | None":
        """The sizes of a TrainConfig with ``--min-nodes`` below its node count; None: a fixed-size run (or
        options :func:`elastic_problems` refuses)."""
        per_node = max(config.workers_per_node, 1)
        if config.min_nodes is None or not 1 <= config.min_nodes < config.num_nodes or config.num_workers % per_node:
            return None
        return cls(min_nodes=config.min_nodes, max_nodes=config.num_nodes, workers_per_node=config.workers_per_node,
                   settle_s=config.elastic_settle_s)

    def workers(self, nodes: int) -> int:
        """The workers of ``nodes`` whole nodes."""
        return nodes * self.workers_per_node

    def nodes_to_start(self, usable: int) -> int:
        """The nodes a worker group starts on when ``usable`` whole nodes are there: as many as the run
        takes, and the minimum when fewer are there (its placement then waits for a replacement)."""
        return max(self.min_nodes, min(usable, self.max_nodes))


def nodes_to_start_line(sizes: ElasticSizes, usable: int) -> str:
    """The controller's line at each start of a worker group: on how many nodes, or that it waits."""
    nodes = sizes.nodes_to_start(usable)
    if usable < sizes.min_nodes:
        return (f"[elastic] {usable} whole node(s), fewer than --min-nodes {sizes.min_nodes}: the worker group waits for "
                f"{nodes} (a replacement), as a fixed-size run waits: Ray Train's placement wait, and the replacement "
                "deadline counted from the loss")
    return f"[elastic] starting on {nodes} of {sizes.max_nodes} nodes ({sizes.workers(nodes)} workers)"


def worker_counts(config) -> tuple[int, ...]:
    """The world sizes a TrainConfig may train at: its ``num_workers``, and with ``--min-nodes`` every
    whole number of nodes from the minimum up."""
    sizes = ElasticSizes.of(config)
    if sizes is None:
        return (config.num_workers,)
    return tuple(sizes.workers(nodes) for nodes in range(sizes.min_nodes, sizes.max_nodes + 1))


def elastic_problems(config) -> list[str]:
    """What ``--min-nodes`` cannot do with the rest of the options, each with the field, the value and the fix."""
    if config.min_nodes is None:
        return []
    p: list[str] = []
    if config.elastic_settle_s < 0:
        p.append(f"elastic_settle_s={config.elastic_settle_s} must be 0 or more (seconds a joined node waits before "
                 "the run grows onto it)")
    per_node = max(config.workers_per_node, 1)
    if config.min_nodes < 1:
        return p + [f"min_nodes={config.min_nodes} must be at least 1 (or none: a fixed-size run that waits for a "
                    "replacement)"]
    if config.num_workers % per_node:
        return p + [f"min_nodes={config.min_nodes} resizes in whole nodes, but num_workers({config.num_workers}) is not a "
                    f"multiple of workers_per_node({per_node}); use a multiple, e.g. "
                    f"{max(per_node, config.num_workers // per_node * per_node)}"]
    if config.min_nodes > config.num_nodes:
        return p + [f"min_nodes={config.min_nodes} is more than the run's {config.num_nodes} node(s) (num_workers("
                    f"{config.num_workers}) / workers_per_node({per_node})); use 1 to {config.num_nodes}"]
    smaller = worker_counts(config)[:-1]  # the run's own size is checked with the rest of the options
    micro = config.micro_batch_size or 1
    uneven = [w for w in smaller if config.global_batch_size % (w * micro)]
    if uneven:
        every = math.lcm(*(w * micro for w in worker_counts(config)))
        what = f" x micro_batch_size({micro})" if config.micro_batch_size else ""
        p.append(f"global_batch_size({config.global_batch_size}) does not split evenly at every size --min-nodes "
                 f"{config.min_nodes} allows: {', '.join(f'{w} workers{what}' for w in uneven)}; the global batch stays "
                 f"the same at every size, so use a multiple of {every}, e.g. {every * max(1, round(config.global_batch_size / every))}")
    if config.hsdp_shard_size and any(w % config.hsdp_shard_size for w in smaller):
        p.append(f"hsdp_shard_size({config.hsdp_shard_size}) does not divide every size --min-nodes {config.min_nodes} "
                 f"allows ({', '.join(str(w) for w in smaller)} workers); drop it (the shard group is then one node, "
                 f"workers_per_node({per_node}), which divides every size)")
    if config.inject_failure_at_step is not None and smaller and smaller[0] < 2:
        p.append(f"inject_failure_at_step({config.inject_failure_at_step}) kills worker 1, which a run of "
                 f"--min-nodes {config.min_nodes} ({smaller[0]} worker) may not have; use --min-nodes "
                 f"{-(-2 // per_node)} or more")
    return p


def sequences_per_worker(config) -> int:
    """The packed sequences per worker per step that every allowed size divides into micro-batches:
    the greatest common divisor of the global batch per worker at each size."""
    return math.gcd(*(config.global_batch_size // max(w, 1) for w in worker_counts(config)))


def whole_nodes(nodes: Iterable[Mapping], *, draining: Collection[str], per_worker: Mapping[str, float],
                workers_per_node: int) -> list[str]:
    """The ids of the nodes a worker group can take whole, from ``ray.nodes()``: alive, not draining
    (a preemption notice, or a node our health checks took out: ``ray._private.state`` ``get_draining_nodes``)
    and with room, by their total resources, for ``workers_per_node`` workers of ``per_worker`` each
    (Ray Train's ``_resources_per_worker_not_none``: one GPU each on GPUs). Ray's head pod has no GPUs, so
    it never counts on a GPU cluster. Nodes are told apart by id, never by address (several pods may share one)."""
    found = []
    for node in nodes:
        resources = node.get("Resources") or {}
        if not node.get("Alive") or node.get("NodeID") in draining:
            continue
        if all(resources.get(name, 0.0) >= need * workers_per_node for name, need in per_worker.items() if need > 0):
            found.append(node["NodeID"])
    return found


@dataclass
class Growth:
    """The controller's side of growing back, one worker group at a time: since when more whole nodes
    than the group has have been there, what the workers were asked, and since when they wait."""

    sizes: ElasticSizes
    more_since: float | None = None
    asked: int | None = None
    answered_at: float | None = None

    def decide(self, *, now: float, running: int, usable: int, ready: int | None = None,
               registered: int | None = None) -> tuple[str, int]:
        """What to do at one look (``running`` nodes train, ``usable`` whole nodes are there, ``ready``: the
        step whose checkpoint the workers wrote for the growth before they began to wait, ``registered``: the
        latest step whose checkpoint Ray Train registered for this group): ``("wait", 0)``, ``("ask", nodes)``,
        ``("withdraw", 0)`` (the nodes went before the workers answered), ``("resize", nodes)`` or
        ``("resize unregistered", nodes)`` (:data:`REGISTERED_WAIT_S` passed without the registration).

        Once the workers answered they wait for the restart whatever the nodes do, so they are restarted
        on what is there then; not before Ray Train registered their checkpoint, which the new group
        resumes from (the controller drops the reports it holds when it stops the old group:
        ``ReportCallbackHandler.before_worker_group_shutdown``)."""
        if ready is not None:
            if registered is not None and registered >= ready:
                return ("resize", self.sizes.nodes_to_start(usable))
            self.answered_at = now if self.answered_at is None else self.answered_at
            if now - self.answered_at < REGISTERED_WAIT_S:
                return ("wait", 0)
            return ("resize unregistered", self.sizes.nodes_to_start(usable))
        target = min(usable, self.sizes.max_nodes)
        if target <= running:
            self.more_since = None
            if self.asked is None:
                return ("wait", 0)
            self.asked = None
            return ("withdraw", 0)
        if self.more_since is None:
            self.more_since = now
        if now - self.more_since < self.sizes.settle_s or self.asked == target:
            return ("wait", 0)
        self.asked = target
        return ("ask", target)


# ---------------------------------------------------------------------- the handshake, in Ray's key-value store

def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def ask_to_grow(invocation_id: str, generation: int, nodes: int) -> None:
    """The controller asks the workers of worker group ``generation`` to checkpoint for ``nodes`` nodes."""
    _kv()._internal_kv_put(f"{invocation_id}/ask", json.dumps({"generation": generation, "nodes": nodes}),
                           overwrite=True, namespace=NAMESPACE)


def withdraw(invocation_id: str, *, answer_too: bool = False) -> None:
    """The ask goes (the nodes left before the workers answered); ``answer_too``: the answer as well (a new group)."""
    kv = _kv()
    for key in ("ask", "ready") if answer_too else ("ask",):
        kv._internal_kv_del(f"{invocation_id}/{key}", namespace=NAMESPACE)


def growth_asked(invocation_id: str) -> dict | None:
    """The controller's ask (``{"generation", "nodes"}``), or None."""
    found = _kv()._internal_kv_get(f"{invocation_id}/ask", namespace=NAMESPACE)
    return json.loads(found) if found else None


def say_ready(invocation_id: str, generation: int, step: int) -> bool:
    """Rank 0: every rank's checkpoint of ``step`` is uploaded and reported; the workers wait for the restart.
    Tried :data:`ANSWER_TRIES` times (a moment when the GCS does not answer); False: never said, the workers
    train on and answer at a later checkpoint (the ask stays)."""
    tries = ANSWER_TRIES
    for attempt in range(tries):
        try:
            _kv()._internal_kv_put(f"{invocation_id}/ready", json.dumps({"generation": generation, "step": step}),
                                   overwrite=True, namespace=NAMESPACE)
            return True
        except Exception as error:  # noqa: BLE001 - Ray's GCS client raises its own RPC errors
            print(f"[elastic] could not answer the growth ask ({type(error).__name__}: {error}); try {attempt + 1} of "
                  f"{tries}", flush=True)
            if attempt + 1 < tries:
                time.sleep(ANSWER_PAUSE_S)
    return False


def ready_step(invocation_id: str, generation: int) -> int | None:
    """The step whose checkpoint the workers of worker group ``generation`` wrote for the growth, once they
    answered; None before (an older group's answer is not theirs)."""
    found = _kv()._internal_kv_get(f"{invocation_id}/ready", namespace=NAMESPACE)
    said = json.loads(found) if found else {}
    return said.get("step") if said.get("generation") == generation else None

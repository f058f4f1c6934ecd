"""How many bytes a training step sends, within a node and across nodes: FSDP against
HSDP, as arithmetic (printed by the benchmark, checked against hand sums in the tests).

The model:
- ring collectives: over ``n`` ranks, all-gather and reduce-scatter of a full tensor of
  ``S`` bytes send ``(n-1)/n * S`` per rank; all-reduce sends twice that;
- FSDP gathers every parameter twice per micro-step (forward, and again in backward
  after resharding) in the parameter dtype, and reduce-scatters the gradients in the
  reduce dtype once per micro-step. (The root and the last layer stay gathered between
  forward and backward, so this is an upper bound by their share, about 15% for Qwen2.5-1.5B.)
- plain FSDP runs those collectives over all ranks of all nodes: a ring over node-ordered
  ranks leaves each node once, so ``(n-1)/n * S`` of every collective crosses into the
  next node;
- HSDP shards inside a node and replicates across nodes: gathers and reduce-scatters stay
  inside the node, and only the all-reduce of each rank's gradient shard (``S/G``) among
  the replicas crosses nodes, once per optimizer step when the micro-steps before the last
  skip it (``set_requires_all_reduce(False)``).

"Per rank" is a node's share divided by its ranks: what each GPU puts on the node's EFA
interfaces.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTraffic:
    """Bytes per rank per optimizer step."""

    within_node: float
    cross_node: float


def ring_send_fraction(n: int) -> float:
    """Share of a tensor each rank sends in a ring all-gather or reduce-scatter over ``n`` ranks."""
    return (n - 1) / n


def step_traffic(*, params: int, num_workers: int, workers_per_node: int, accumulation: int, hsdp: bool,
                 param_bytes: int = 2, grad_bytes: int = 4, trainable_params: int | None = None) -> StepTraffic:
    """Bytes a rank sends per optimizer step, split into within-node and cross-node.

    :param params: parameters of the model (each sharded once).
    :param accumulation: micro-steps per optimizer step.
    :param param_bytes: bytes per gathered parameter (2 for bf16 mixed precision).
    :param grad_bytes: bytes per reduced gradient (4: FSDP reduces in fp32).
    :param trainable_params: the parameters that have a gradient (None: all; LoRA: the adapters):
        the frozen base is gathered as the rest, but has no gradient to reduce.
    """
    nodes = max(1, -(-num_workers // workers_per_node))
    trainable = params if trainable_params is None else trainable_params
    per_micro_step = 2 * param_bytes * params + grad_bytes * trainable  # bytes of full tensors collected
    if not hsdp or nodes == 1:
        sent = ring_send_fraction(num_workers) * per_micro_step * accumulation
        if nodes == 1:
            return StepTraffic(within_node=sent, cross_node=0.0)
        # Of the collective a node's ranks send, (n-1)/n * S leaves the node; the rest stays.
        cross = ring_send_fraction(num_workers) * per_micro_step * accumulation / workers_per_node
        return StepTraffic(within_node=sent - cross, cross_node=cross)
    within = ring_send_fraction(workers_per_node) * per_micro_step * accumulation
    shard = grad_bytes * trainable / workers_per_node
    cross = 2 * ring_send_fraction(nodes) * shard
    return StepTraffic(within_node=within, cross_node=cross)

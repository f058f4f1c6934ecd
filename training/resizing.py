"""An elastic run's resizes (``--min-nodes``, training/resilience/elastic.py) as its workers see them:
whether the controller asks them to grow at this step (:func:`growth_asked_at`), and each resize said
where a user looks: the step line (:func:`size_text`), the step's record in metrics.jsonl and the
tracker (training/reporting.py ``log_step``), and a notification (:func:`announce_resize`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .resilience.elastic import ElasticSizes, growth_asked
from .worker import Worker


def growth_asked_at(worker: Worker, metrics: dict) -> dict | None:
    """At a checkpoint step of an elastic run, not its last: the controller's ask to grow (``{"generation",
    "nodes"}``), or None. Rank 0 reads it and every rank learns whether there is one (collective: every
    rank calls this at the same steps), so all checkpoint together."""
    config, step = worker.config, metrics["step"]
    if (ElasticSizes.of(config) is None or step % config.checkpoint_every or step >= config.max_steps
            or metrics.get("stopped_early")):
        return None
    ask = None
    if worker.rank == 0:
        try:
            ask = growth_asked(worker.invocation_id)
        except Exception as error:  # noqa: BLE001 - Ray's GCS away a moment: the ask is read again at the next checkpoint
            print(f"[elastic] could not read the controller's growth ask ({type(error).__name__}: {error}); training on",
                  flush=True)
    nodes = torch.tensor([ask["nodes"] if ask else 0], device=worker.device)
    dist.broadcast(nodes, src=0)
    if not nodes.item():
        return None
    return ask or {"nodes": int(nodes.item())}


def resized_from(config, world: int, workers_before: int | None) -> int | None:
    """The workers an elastic run trained with before Ray Train restarted it at ``world`` (the group before
    this one, ``workers_before``: training/resilience/preemption.py ``RetryCounter``), where that size was
    another; None for a fixed-size run, and for an invocation's first group (a new run resumed from a
    checkpoint of another size: its restore says so, it is no resize)."""
    if ElasticSizes.of(config) is None or not workers_before or workers_before == world:
        return None
    return workers_before


def size_text(worker: Worker, step: int) -> str:
    """The step line's size, for an elastic run: its workers, and at the first step after a resize what they were."""
    if ElasticSizes.of(worker.config) is None:
        return ""
    if step == worker.start_step + 1 and worker.resized_from:
        return f" workers {worker.world} (resized from {worker.resized_from}: {worker.resume_cause})"
    return f" workers {worker.world}"


def resize_reason(worker: Worker, usd_per_hour: float | None = None) -> str:
    """What a resize was, in words: from and to how many nodes, why, from which checkpoint, what changes
    (the accumulation; the cost at the new size where the GPU nodes' price is known: ``usd_per_hour``, all
    of the run's nodes together) and what comes next."""
    config, sizes = worker.config, ElasticSizes.of(worker.config)
    per_node = config.workers_per_node
    before, after = worker.resized_from // per_node, worker.world // per_node
    how = "grew" if after > before else "shrank"
    why = {"resize": "nodes came back", "preemption": "a preemption notice", "failure": "a node lost without notice",
           "hardware fault": "a node taken out for a hardware fault"}.get(worker.resume_cause, worker.resume_cause or "a restart")
    accumulation = config.global_batch_size // (worker.world * config.micro_batch_size)
    text = (f"the run {how} from {before} to {after} of its {sizes.max_nodes if sizes else after} nodes ({worker.world} "
            f"workers) after {why}, and resumed from step {worker.start_step}'s checkpoint; the global batch stays "
            f"{config.global_batch_size}, with {accumulation} micro-batch(es) per worker per step")
    if usd_per_hour is not None and sizes:
        text += (f"; its GPU nodes now cost {usd_per_hour * after / sizes.max_nodes:.2f} USD/hour "
                 f"(was {usd_per_hour * before / sizes.max_nodes:.2f})")
    if sizes and after < sizes.max_nodes:
        text += (f"; it grows back at a checkpoint once a node has been there {sizes.settle_s:.0f} s, and waits for a "
                 f"replacement only below --min-nodes {sizes.min_nodes}")
    return text


def announce_resize(worker: Worker, metrics: dict) -> None:
    """Rank 0, at the first step after a resize: the line in the job log and the notification."""
    notifier = worker.notifier
    print(f"[elastic] {resize_reason(worker)}", flush=True)
    if notifier:
        notifier.publish("resized", resize_reason(worker, notifier.usd_per_hour), quick=True,
                         step=metrics["step"], loss=metrics["loss"], max_steps=worker.config.max_steps)

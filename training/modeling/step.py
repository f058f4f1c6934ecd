"""One optimizer step's forward and backward on a worker: plain torch, no Ray (the bench runs it
alone on a GPU)."""

from __future__ import annotations

import torch

from ..data.batch import MicroBatch
from .parallel import set_cross_node_gradient_sync


def train_step(model, micro_batches: list[MicroBatch], *, normaliser: float, cross_node_sync: bool,
               preference=None, reference_table=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of every micro-batch, gradients accumulated; returns this
    worker's share of the step's loss as a tensor on the device (no host sync).

    ``normaliser`` is the global batch's trained-token count (preference pairs: its pair count) over
    the world size (FSDP averages gradients over ranks), a Python number computed on the CPU from the
    data order (every worker holds the packed set), so mixed precision cannot round it and no
    collective is needed to find it. With HSDP the cross-node all-reduce runs on the last
    micro-step only.

    ``preference`` (training/modeling/preference.py ``PreferenceSettings``): the micro-batches hold
    preference pairs; returns (the loss, this worker's summed metrics and pair count), the reference
    log-probabilities from ``reference_table`` (a full fine-tune's, precomputed) or computed with the
    adapters off (LoRA).
    """
    from .preference import preference_step_loss

    loss_sum = stats_sum = None
    for index, batch in enumerate(micro_batches):
        if cross_node_sync:
            set_cross_node_gradient_sync(model, enabled=index == len(micro_batches) - 1)
        if preference is not None:
            loss, stats = preference_step_loss(model, batch, preference, normaliser=normaliser, table=reference_table)
            stats_sum = stats if stats_sum is None else stats_sum + stats
        else:
            loss = model(**batch.inputs, labels=batch.labels, trained_positions=batch.trained_positions, normaliser=normaliser)
        loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()  # nothing of the batch outlives its backward
        del loss
    return loss_sum.float() if preference is None else (loss_sum.float(), stats_sum)

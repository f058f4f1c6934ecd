"""One optimizer step's forward and backward on a worker: plain torch, no Ray (the bench runs it
alone on a GPU)."""

from __future__ import annotations

import torch

from ..data.batch import MicroBatch
from .parallel import set_cross_node_gradient_sync


def train_step(model, micro_batches: list[MicroBatch], *, normaliser: float, cross_node_sync: bool) -> torch.Tensor:
    """Forward and backward of every micro-batch, gradients accumulated; returns this
    worker's share of the step's loss as a tensor on the device (no host sync).

    ``normaliser`` is the global batch's trained-token count over the world size (FSDP
    averages gradients over ranks), a Python number computed on the CPU from the data order
    (every worker holds the packed set), so mixed precision cannot round it and no
    collective is needed to find it. With HSDP the cross-node all-reduce runs on the last
    micro-step only.
    """
    loss_sum = None
    for index, batch in enumerate(micro_batches):
        if cross_node_sync:
            set_cross_node_gradient_sync(model, enabled=index == len(micro_batches) - 1)
        loss = model(**batch.inputs, labels=batch.labels, trained_positions=batch.trained_positions, normaliser=normaliser)
        loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()  # nothing of the batch outlives its backward
        del loss
    return loss_sum.float()

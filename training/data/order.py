"""Which packed sequences each worker trains on at each step: a deterministic order that a
checkpoint resumes from, and the eval set's share of each worker."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .records import DataError


@dataclass(frozen=True)
class DataOrder:
    """Which packed sequences each worker trains on at each global step.

    Step ``s`` uses ``global_batch`` sequences of epoch ``s // steps_per_epoch``'s
    permutation (seeded by ``seed + epoch``); they are laid out as
    (accumulation, worker, micro-batch), so the global batch of a step is the same
    whatever the number of workers. The position in the data is the global step, which
    is all a checkpoint needs to resume.
    """

    num_sequences: int
    global_batch: int
    micro_batch: int
    num_workers: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch (the remainder is dropped)."""
        return self.num_sequences // self.global_batch

    def global_batch_indices(self, step: int) -> np.ndarray:
        """The packed sequences of global ``step``, over all workers."""
        if self.steps_per_epoch < 1:
            raise DataError(
                f"the data set packs into {self.num_sequences} sequences, fewer than global_batch_size({self.global_batch}); "
                "use more samples or a smaller batch"
            )
        epoch, offset = divmod(step, self.steps_per_epoch)
        permutation = np.random.default_rng(self.seed + epoch).permutation(self.num_sequences)
        return permutation[offset * self.global_batch:(offset + 1) * self.global_batch]

    def micro_batches(self, step: int, rank: int) -> list[np.ndarray]:
        """Indices of the packed sequences worker ``rank`` uses at global ``step``."""
        grid = self.global_batch_indices(step).reshape(-1, self.num_workers, self.micro_batch)
        return [grid[accum, rank] for accum in range(grid.shape[0])]


def eval_micro_batches(num_sequences: int, *, num_workers: int, micro_batch: int, rank: int) -> list[np.ndarray]:
    """Worker ``rank``'s share of the eval set, in micro-batches. Every worker gets the same
    number of micro-batches (FSDP gathers each layer on all of them together); a slot past
    the end is -1 (a micro-batch that trains nothing, see :func:`collate`)."""
    per_round = num_workers * micro_batch
    rounds = max(1, math.ceil(num_sequences / per_round))
    slots = np.arange(rounds * per_round)
    slots[slots >= num_sequences] = -1
    grid = slots.reshape(rounds, num_workers, micro_batch)
    return [grid[r, rank] for r in range(rounds)]

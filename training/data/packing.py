"""Packing samples into fixed-length sequences whose positions restart at every sample, so
no token attends across samples."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .records import IGNORE_INDEX


@dataclass
class PackedDataset:
    """Fixed-length packed sequences: ``input_ids``, ``labels``, ``position_ids``
    (restarting at 0 for each sample) and ``real`` (1 on non-padding tokens). Preference pairs
    (training/data/preference.py) have ``slots`` too: each token's segment, ``2 * pair + side``
    (-1 on padding)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    real: np.ndarray
    slots: np.ndarray | None = None

    @property
    def is_pairs(self) -> bool:
        """Whether the sequences hold preference pairs."""
        return self.slots is not None

    @functools.cached_property
    def pairs(self) -> np.ndarray:
        """Per sequence, the preference pairs it holds (0 for supervised samples)."""
        if self.slots is None:
            return np.zeros(len(self), dtype=np.int64)
        return np.asarray([len(np.unique(row[row >= 0])) // 2 for row in self.slots], dtype=np.int64)

    @property
    def loss_units(self) -> np.ndarray:
        """Per sequence, what its loss is averaged over: trained tokens, or pairs for preference data."""
        return self.pairs if self.is_pairs else self.trained_tokens

    def __len__(self) -> int:
        return len(self.input_ids)

    @functools.cached_property
    def trained_tokens(self) -> np.ndarray:
        """Per sequence, the tokens whose label is trained (every sample's first label is
        ignored, so this is also the count of trained next-token targets)."""
        return (self.labels != IGNORE_INDEX).sum(axis=1)

    @functools.cached_property
    def real_tokens(self) -> np.ndarray:
        """Per sequence, its real (non-padding) tokens."""
        return self.real.sum(axis=1)

    @functools.cached_property
    def squared_lengths(self) -> np.ndarray:
        """Per sequence, the sum of its real samples' lengths squared (attention's cost)."""
        out = np.zeros(len(self), dtype=np.int64)
        for row, (positions, real) in enumerate(zip(self.position_ids, self.real)):
            bounds = segment_bounds(positions)
            lengths = np.diff(bounds).astype(np.int64)
            out[row] = int((lengths[real[bounds[:-1]] > 0] ** 2).sum())
        return out

    def flop_counts(self, indices: np.ndarray) -> dict[str, int]:
        """What :func:`training.telemetry.metrics.step_flops` counts, for the sequences ``indices`` (a
        step's global batch: every worker's micro-batches together)."""
        return {"tokens": int(self.real_tokens[indices].sum()), "trained_tokens": int(self.trained_tokens[indices].sum()),
                "squared_lengths": int(self.squared_lengths[indices].sum())}

    def head(self, rows: int) -> "PackedDataset":
        """The first ``rows`` sequences."""
        return PackedDataset(self.input_ids[:rows], self.labels[:rows], self.position_ids[:rows], self.real[:rows],
                             None if self.slots is None else self.slots[:rows])


def pack(samples: Iterable[tuple[list[int], list[int]]], *, seq_len: int, pad_id: int) -> PackedDataset:
    """Greedy packing in order: a sample that does not fit starts a new sequence; a sample
    longer than ``seq_len`` is truncated. The first label of every sample is ignored, so
    no position learns to predict across a sample boundary."""
    rows_ids, rows_labels, rows_pos, rows_real = [], [], [], []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []

    def flush():
        if not ids:
            return
        pad = seq_len - len(ids)
        rows_ids.append(ids + [pad_id] * pad)
        rows_labels.append(labels + [IGNORE_INDEX] * pad)
        # Padding is its own "sample" (positions from 0), so real tokens never attend to it.
        rows_pos.append(pos + list(range(pad)))
        rows_real.append([1] * len(ids) + [0] * pad)

    for sample_ids, sample_labels in samples:
        sample_ids, sample_labels = sample_ids[:seq_len], list(sample_labels[:seq_len])
        if not sample_ids:
            continue
        sample_labels[0] = IGNORE_INDEX
        if len(ids) + len(sample_ids) > seq_len:
            flush()
            ids, labels, pos = [], [], []
        ids = ids + sample_ids
        labels = labels + sample_labels
        pos = pos + list(range(len(sample_ids)))
    flush()
    as_array = lambda rows: np.asarray(rows, dtype=np.int64).reshape(-1, seq_len)  # noqa: E731
    return PackedDataset(as_array(rows_ids), as_array(rows_labels), as_array(rows_pos), as_array(rows_real))

def segment_bounds(position_ids: np.ndarray) -> np.ndarray:
    """Cumulative segment boundaries ``[0, ..., n]`` of a flat row whose positions restart
    at 0 for every sample (and for every row's trailing padding)."""
    starts = np.flatnonzero(position_ids == 0)
    return np.append(starts, len(position_ids)).astype(np.int32)

"""One worker's micro-batch as the model takes it: flattened into one row of packed
samples with ``cu_seq_lens`` (see :class:`MicroBatch`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .packing import PackedDataset, segment_bounds
from .records import IGNORE_INDEX


@dataclass
class MicroBatch:
    """One worker's micro-batch, flattened into a single row of its packed sequences' real tokens
    (at most ``B * seq_len``: the packing's padding is left out, so no pad token runs through the
    model; the row's length varies).

    ``inputs`` are the model's keyword arguments. Flattening is what makes packing safe
    under every attention implementation: transformers' flash-attention path treats a
    batch as packed only when its batch size is 1 (``_is_packed_sequence`` in
    ``modeling_flash_attention_utils.py``), and then runs the varlen kernel over
    ``cu_seq_lens_q/k`` with integer ``max_length_q/k`` (what
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` produces); sdpa and eager
    derive the same block-diagonal mask from the restarting ``position_ids``. The boundaries
    and the positions the loss trains (``trained_positions``) are computed here on the CPU,
    so the GPU never syncs to find them.
    """

    inputs: dict
    labels: torch.Tensor
    #: Flat positions whose next-token target is trained, ascending (the loss gathers these).
    trained_positions: torch.Tensor
    #: Non-padding tokens (useful throughput counts these).
    real_tokens: int
    #: Tokens whose next-token label is trained (the loss normaliser sums these).
    label_tokens: int
    #: Lengths of the real samples in the row (attention FLOPs follow their squares).
    sample_lengths: tuple[int, ...]
    #: Preference data: which segment each trained position's token belongs to (:class:`PairSegments`).
    pairs: "PairSegments | None" = None


@dataclass
class PairSegments:
    """The preference pairs of a micro-batch (training/data/preference.py), numbered in the order
    they appear, so that pair ``p``'s chosen side is segment ``2p`` and its rejected side ``2p + 1``
    and each segment's trained positions are one run of ``trained_positions``: ``segments`` (each
    trained position's segment), ``bounds`` (where each segment's run starts, and the end: its
    trained tokens are ``bounds[i + 1] - bounds[i]``), ``segment_tokens`` (those counts, for the
    length-averaged losses), ``pair_ids`` (each pair's number in its packed set, the precomputed
    reference's row; ``pair_index`` on the device). Computed on the CPU."""

    segments: torch.Tensor
    bounds: torch.Tensor
    segment_tokens: torch.Tensor
    pair_ids: np.ndarray
    pair_index: torch.Tensor

    @property
    def count(self) -> int:
        """Pairs in the micro-batch."""
        return len(self.pair_ids)


def pair_segments(slots: np.ndarray, trained: np.ndarray, device: torch.device) -> PairSegments:
    """:class:`PairSegments` from the flat tokens' ``slots`` and the trained positions (position t
    learns token t + 1, which is of t's segment: a segment's first label is never trained)."""
    of_trained = slots[trained + 1]
    found, first, local = np.unique(of_trained, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # the segments as they appear along the row
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    found, local = found[order], rank[local.reshape(-1)]
    if len(found) % 2 or not np.array_equal(found[0::2] + 1, found[1::2]) or (found[0::2] % 2).any():
        raise ValueError("a micro-batch holds one side of a preference pair without the other")
    counts = np.bincount(local, minlength=len(found))
    pair_ids = (found[0::2] // 2).astype(np.int64)
    return PairSegments(segments=_to_device(local.astype(np.int64), device),
                        bounds=_to_device(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), device),
                        segment_tokens=_to_device(counts.astype(np.float32), device),
                        pair_ids=pair_ids, pair_index=_to_device(pair_ids, device))


def _selected(dataset: PackedDataset, indices: np.ndarray):
    """Rows ``indices`` of the packed set (-1: a blank slot, row 0's shape training nothing): the
    safe indices, and their labels, positions and real-token flags (blanks ignored and unreal)."""
    indices = np.asarray(indices)
    blank = indices < 0
    safe = np.where(blank, 0, indices)
    labels = dataset.labels[safe].copy()
    labels[blank] = IGNORE_INDEX
    real = dataset.real[safe].copy()
    real[blank] = 0
    return safe, labels, dataset.position_ids[safe], real


def _slots(dataset: PackedDataset, indices: np.ndarray) -> np.ndarray | None:
    """The rows' token segments (preference data; -1 on a blank slot), else None."""
    if dataset.slots is None:
        return None
    indices = np.asarray(indices)
    slots = dataset.slots[np.where(indices < 0, 0, indices)].copy()
    slots[indices < 0] = -1
    return slots


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A CPU array on ``device``, through pinned memory to a GPU (the copy does not block the host)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor.to(device)


def collate(dataset: PackedDataset, indices: np.ndarray, device: torch.device, *, keep_padding: bool = False,
            flatten: bool = True) -> MicroBatch:
    """The packed sequences ``indices`` as one flattened row of their real tokens, with
    per-sample ``position_ids`` and flash-attention's varlen boundaries; no attention mask.
    An index of -1 stands for a slot that trains nothing (the eval's padding slots): it adds no
    token. A micro-batch with no real token at all keeps one pad token, so every rank still runs
    the forward and backward (and their collectives) alike. ``keep_padding``: the whole (1,
    B * seq_len) row, pads as segments of their own (the bench's "before"). ``flatten=False``:
    see :func:`rows`."""
    if not flatten:
        return rows(dataset, indices, device)
    safe, labels, positions, real = _selected(dataset, indices)
    slots = _slots(dataset, indices)
    ids, labels = dataset.input_ids[safe].reshape(1, -1), labels.reshape(1, -1)
    positions, real = positions.reshape(-1), real.reshape(-1)
    slots = slots.reshape(-1) if slots is not None else None
    if not keep_padding:
        # Every sample's first label is IGNORE_INDEX (nothing learns across a boundary), so leaving
        # the pads out changes no target: a sample's last token still learns nothing.
        keep = real.astype(bool)
        if not keep.any():
            keep[0] = True
        ids, labels, positions, real = ids[:, keep], labels[:, keep], positions[keep], real[keep]
        slots = slots[keep] if slots is not None else None
    bounds = segment_bounds(positions)
    lengths = np.diff(bounds)
    max_length = int(lengths.max())
    cu_seq_lens = _to_device(bounds, device)
    inputs = {
        "input_ids": _to_device(ids, device),
        "position_ids": _to_device(positions.reshape(1, -1), device),
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }
    # Position t learns labels[t + 1] (training/modeling/loss.py): the trained positions, on the CPU.
    trained = np.flatnonzero(labels[0, 1:] != IGNORE_INDEX).astype(np.int64)
    real_segments = tuple(int(n) for n, start in zip(lengths, bounds[:-1]) if real[start])
    return MicroBatch(
        inputs=inputs,
        labels=_to_device(labels, device),
        trained_positions=_to_device(trained, device),
        real_tokens=int(real.sum()),
        label_tokens=len(trained),
        sample_lengths=real_segments,
        pairs=pair_segments(slots, trained, device) if slots is not None else None,
    )


def rows(dataset: PackedDataset, indices: np.ndarray, device: torch.device) -> MicroBatch:
    """The packed sequences ``indices`` as a (B, seq_len) batch, one row per packed sequence, for
    attention without a varlen kernel (sdpa, eager): transformers then builds each row's
    block-diagonal mask from its restarting ``position_ids``, B masks of seq_len² instead of one of
    (B x seq_len)² for the flattened row (8,192² for the L4 preset's micro-batch). The rows keep
    their padding (they must be of one length); a blank slot (-1) is a row that trains nothing."""
    safe, labels, positions, real = _selected(dataset, indices)
    slots = _slots(dataset, indices)
    # Position t of a row learns labels[t + 1] of that row (training/modeling/loss.py pads each row).
    targets = np.pad(labels[:, 1:], ((0, 0), (0, 1)), constant_values=IGNORE_INDEX).reshape(-1)
    trained = np.flatnonzero(targets != IGNORE_INDEX).astype(np.int64)
    segments = []
    for row in range(len(safe)):
        bounds = segment_bounds(positions[row])
        segments += [int(n) for n, start in zip(np.diff(bounds), bounds[:-1]) if real[row, start]]
    return MicroBatch(
        inputs={"input_ids": _to_device(dataset.input_ids[safe], device), "position_ids": _to_device(positions, device)},
        labels=_to_device(labels, device),
        trained_positions=_to_device(trained, device),
        real_tokens=int(real.sum()),
        label_tokens=len(trained),
        sample_lengths=tuple(segments),
        pairs=pair_segments(slots.reshape(-1), trained, device) if slots is not None else None,
    )

"""A full fine-tune's DPO reference (``--objective dpo`` without LoRA): the reference model is the
model before its first step, so its log-probabilities of every pair's two completions are computed
once, before training, in one pass over the training and eval pairs without gradients, each worker
a share of the sequences (the collective pattern of the eval pass), then summed across the workers
so that every worker holds the whole table (8 bytes a pair). No second copy of the model is held,
and each step costs one forward less than computing the reference as it goes.

The table is kept beside the checkpoints (``reference_logps.npz`` in the run's folder), written by
rank 0 before the first step, with a fingerprint of the data it belongs to: a resume (after a
failure, a preemption or ``submit --resume``) reads it instead of recomputing, and could not
recompute it (the model it starts from has trained). A resumed run whose table is missing or
belongs to other data stops before its first step and says so; a run that has not trained a step
computes it again.

Under LoRA the reference is the base with the adapters off, computed in each step
(training/modeling/model.py ``reference_logps``); SimPO needs none.
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

#: The table's name in the run's folder.
REFERENCE_FILE = "reference_logps.npz"


@dataclass
class ReferenceTables:
    """Per pair (its number in the packed set), the reference's summed log-probability of its chosen
    and rejected completions, (pairs, 2) float32; ``eval`` for the held-out pairs (None without)."""

    train: np.ndarray
    eval: np.ndarray | None = None


def pair_count(packed) -> int:
    """Pairs in a packed preference set (their numbers run from 0)."""
    return 0 if packed is None or not packed.slots.size else int(packed.slots.max()) // 2 + 1


def fingerprint(data, model: str, revision: str | None = None) -> str:
    """What the table belongs to: the model's name and commit (a Hub model's, pinned at the start) and
    the packed pairs' tokens and segments (the data set, ``--max-samples``, ``--seq-len``, the seed,
    the tokenizer and the eval settings all show there)."""
    digest = hashlib.blake2b(f"{model}@{revision or ''}".encode(), digest_size=16)
    for packed in (data.train, data.eval):
        if packed is not None:
            for array in (packed.input_ids, packed.labels, packed.slots):
                digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def compute_table(model, packed, *, rank: int, world: int, micro_batch: int, device: torch.device,
                  flatten: bool = True) -> np.ndarray:
    """The reference's log-probabilities of every pair of ``packed`` (collective: every rank runs the
    same number of forwards; each pair is computed by one rank and the tables summed)."""
    from ..data import collate, eval_micro_batches
    from .preference import pair_logps

    table = torch.zeros((pair_count(packed), 2), dtype=torch.float32, device=device)
    was_training = model.training
    model.eval()
    try:
        for indices in eval_micro_batches(len(packed), num_workers=world, micro_batch=micro_batch, rank=rank):
            batch = collate(packed, indices, device, flatten=flatten)
            logps = pair_logps(model, batch, reference=True)
            if batch.pairs.count:
                table[batch.pairs.pair_index] = logps.float().reshape(-1, 2)
    finally:
        model.train(was_training)
    dist.all_reduce(table)
    return table.cpu().numpy()


def encode(tables: ReferenceTables, print_: str) -> bytes:
    buffer = io.BytesIO()
    arrays = {"train": tables.train, "fingerprint": np.frombuffer(print_.encode(), dtype=np.uint8)}
    if tables.eval is not None:
        arrays["eval"] = tables.eval
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def decode(data: bytes) -> tuple[ReferenceTables, str]:
    with np.load(io.BytesIO(data)) as stored:
        tables = ReferenceTables(train=stored["train"], eval=stored["eval"] if "eval" in stored else None)
        return tables, stored["fingerprint"].tobytes().decode()


class ReferenceMissing(RuntimeError):
    """A resumed full fine-tune's DPO reference table is not there (or is another data set's)."""


def load_or_compute(worker) -> ReferenceTables:
    """The run's reference table: read from the run's folder, or (before the first step) computed and
    written there. Raises :class:`ReferenceMissing` for a resumed run without it."""
    from ..storage.files import read_bytes, write_bytes
    from .export import run_uri

    config = worker.config
    uri = f"{run_uri(config.storage_path, config.run_name)}/{REFERENCE_FILE}"
    expected = fingerprint(worker.data, config.model, getattr(config, "model_revision", None))
    stored = read_bytes(uri)
    if stored is not None:
        tables, found = decode(stored)
        if found == expected:
            if worker.rank == 0:
                print(f"[dpo] reference log-probabilities of {len(tables.train)} pairs read from {uri}", flush=True)
            return tables
    if worker.start_step > 0:
        why = "is not there" if stored is None else "belongs to other data or another model"
        raise ReferenceMissing(
            f"the DPO reference table {uri} {why}, and this run resumes at step {worker.start_step}: the model has "
            "trained, so it can no longer be the reference. Resume with the data set and model it started with, or "
            "start a new run (another --run-name)")
    started = time.perf_counter()
    common = dict(rank=worker.rank, world=worker.world, micro_batch=config.micro_batch_size, device=worker.device,
                  flatten=config.flattened_rows)
    tables = ReferenceTables(train=compute_table(worker.model, worker.data.train, **common),
                             eval=compute_table(worker.model, worker.data.eval, **common) if worker.data.eval is not None else None)
    if worker.rank == 0:
        write_bytes(uri, encode(tables, expected))
        pairs = len(tables.train) + (len(tables.eval) if tables.eval is not None else 0)
        print(f"[dpo] reference log-probabilities of {pairs} pairs computed in {time.perf_counter() - started:.1f} s "
              f"over {worker.world} workers, kept in {uri} for a resume", flush=True)
    return tables

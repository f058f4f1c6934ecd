"""Supervised fine-tuning data: chat formatting, loss on response tokens only, packing
without cross-sample attention, and a deterministic per-worker order that a checkpoint
can resume from.

Packed sequences carry ``position_ids`` that restart at 0 at every sample, and each
micro-batch is flattened into one row (see :class:`MicroBatch`), so no token attends
across samples under flash-attention 2, sdpa or eager alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

IGNORE_INDEX = -100


# ---------------------------------------------------------------------- records

def load_records(source: str, *, split: str = "train") -> list[dict]:
    """Rows of a local ``.jsonl``/``.json``/``.parquet`` file, or of a Hugging Face Hub
    data set (with ``datasets`` when installed, else from the repository's data files)."""
    if Path(source).is_file():
        return read_data_file(Path(source))
    try:
        import datasets
    except ImportError:
        return _hub_files(source, split)
    return list(datasets.load_dataset(source, split=split))


def read_data_file(path: Path) -> list[dict]:
    """Rows of one JSONL, JSON (a list of rows) or Parquet file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _hub_files(repo_id: str, split: str) -> list[dict]:
    """A Hub data set without the ``datasets`` library: its JSONL/JSON/Parquet files
    (those whose path names the split, when any does), read in order."""
    from huggingface_hub import snapshot_download

    root = Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=["*.jsonl", "*.json", "*.parquet"]))
    files = sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet") and p.name != "dataset_infos.json")
    named = [p for p in files if split in p.relative_to(root).as_posix()]
    rows = [row for path in (named or files) for row in read_data_file(path)]
    if not rows:
        raise ValueError(f"dataset={repo_id!r}: no JSONL, JSON or Parquet data files found on the Hub")
    return rows


def to_messages(record: dict) -> list[dict]:
    """A record in chat form. Accepts ``messages`` (chat), Dolly (instruction, context,
    response) and Alpaca (instruction, input, output) rows."""
    if "messages" in record:
        return record["messages"]
    instruction = record.get("instruction")
    answer = record.get("response", record.get("output"))
    if instruction is None or answer is None:
        raise ValueError(
            f"cannot read a training sample from a row with keys {sorted(record)}: expected 'messages', "
            "or 'instruction' with 'response' (Dolly) or 'output' (Alpaca)"
        )
    context = record.get("context") or record.get("input") or ""
    prompt = f"{instruction}\n\n{context}" if context else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


# ---------------------------------------------------------------------- tokenization

def tokenize_sample(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels that are ``IGNORE_INDEX`` except on
    assistant turns: the loss is on responses only.

    The chat template is applied to growing prefixes; each assistant turn's tokens are
    the difference between the prefix with its generation prompt and the prefix with
    the turn itself (the template is prefix-stable, as ChatML is).
    """
    ids: list[int] = []
    labels: list[int] = []
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            labels.extend([IGNORE_INDEX] * (len(prompt_ids) - len(ids)))
            ids = prompt_ids
        upto = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        upto_ids = tokenizer(upto, add_special_tokens=False)["input_ids"]
        if upto_ids[: len(ids)] != ids:
            raise ValueError("the chat template is not prefix-stable; cannot mask prompts reliably")
        new = upto_ids[len(ids):]
        labels.extend(new if message["role"] == "assistant" else [IGNORE_INDEX] * len(new))
        ids = upto_ids
    return ids, labels


# ---------------------------------------------------------------------- packing

@dataclass
class PackedDataset:
    """Fixed-length packed sequences: ``input_ids``, ``labels``, ``position_ids``
    (restarting at 0 for each sample) and ``real`` (1 on non-padding tokens)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    real: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


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


def build_packed_dataset(tokenizer, source: str, *, seq_len: int, seed: int, split: str = "train", max_samples: int | None = None) -> PackedDataset:
    """Load, shuffle (by ``seed``), tokenize with response-only labels, and pack."""
    records = load_records(source, split=split)
    order = np.random.default_rng(seed).permutation(len(records))
    if max_samples is not None:
        order = order[:max_samples]
    samples = (tokenize_sample(tokenizer, to_messages(records[i])) for i in order)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pack(samples, seq_len=seq_len, pad_id=pad_id)


# ---------------------------------------------------------------------- order

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

    def micro_batches(self, step: int, rank: int) -> list[np.ndarray]:
        """Indices of the packed sequences worker ``rank`` uses at global ``step``."""
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the data set packs into {self.num_sequences} sequences, fewer than global_batch_size({self.global_batch}); "
                "use more samples or a smaller batch"
            )
        epoch, offset = divmod(step, self.steps_per_epoch)
        permutation = np.random.default_rng(self.seed + epoch).permutation(self.num_sequences)
        batch = permutation[offset * self.global_batch:(offset + 1) * self.global_batch]
        grid = batch.reshape(-1, self.num_workers, self.micro_batch)
        return [grid[accum, rank] for accum in range(grid.shape[0])]


@dataclass
class MicroBatch:
    """One worker's micro-batch, flattened into a single row of ``B * seq_len`` tokens.

    ``inputs`` are the model's keyword arguments. Flattening is what makes packing safe
    under every attention implementation: transformers' flash-attention path treats a
    batch as packed only when its batch size is 1 (``_is_packed_sequence`` in
    ``modeling_flash_attention_utils.py``), and then runs the varlen kernel over
    ``cu_seq_lens_q/k`` with integer ``max_length_q/k`` (what
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` produces); sdpa and eager
    derive the same block-diagonal mask from the restarting ``position_ids``. The boundaries
    are computed here on the CPU, so the GPU never syncs to find them.
    """

    inputs: dict
    labels: torch.Tensor
    #: Non-padding tokens (useful throughput counts these).
    real_tokens: int
    #: Tokens whose next-token label is trained (the loss normaliser sums these).
    label_tokens: int
    #: Lengths of the real samples in the row (attention FLOPs follow their squares).
    sample_lengths: tuple[int, ...]


def segment_bounds(position_ids: np.ndarray) -> np.ndarray:
    """Cumulative segment boundaries ``[0, ..., n]`` of a flat row whose positions restart
    at 0 for every sample (and for every row's trailing padding)."""
    starts = np.flatnonzero(position_ids == 0)
    return np.append(starts, len(position_ids)).astype(np.int32)


def collate(dataset: PackedDataset, indices: np.ndarray, device: torch.device) -> MicroBatch:
    """The packed sequences ``indices`` as one flattened row (1, B * seq_len) with
    per-sample ``position_ids`` and flash-attention's varlen boundaries; no attention mask."""
    ids, labels = dataset.input_ids[indices].reshape(1, -1), dataset.labels[indices].reshape(1, -1)
    positions, real = dataset.position_ids[indices].reshape(-1), dataset.real[indices].reshape(-1)
    bounds = segment_bounds(positions)
    lengths = np.diff(bounds)
    max_length = int(lengths.max())
    cu_seq_lens = torch.from_numpy(bounds).to(device)
    inputs = {
        "input_ids": torch.from_numpy(ids).to(device),
        "position_ids": torch.from_numpy(positions.reshape(1, -1)).to(device),
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }
    real_segments = tuple(int(n) for n, start in zip(lengths, bounds[:-1]) if real[start])
    return MicroBatch(
        inputs=inputs,
        labels=torch.from_numpy(labels).to(device),
        real_tokens=int(real.sum()),
        label_tokens=int((labels[0, 1:] != IGNORE_INDEX).sum()),
        sample_lengths=real_segments,
    )

"""The training and eval sets of a run: rows read, held out, tokenized and packed
(:func:`build_training_data`, what the driver checks and every worker builds)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from .masking import encode_chats
from .messages import for_template
from .packing import PackedDataset, pack
from .records import IGNORE_INDEX, Records, load_records
from .report import DataReport, usable_messages


def tokenize_rows(tokenizer, records: Sequence[dict], indices: Iterable[int], *, seq_len: int,
                  report: DataReport) -> list[tuple[list[int], list[int]]]:
    """Tokenized samples of the rows ``indices`` that can train, counting the others in ``report``."""
    samples = []
    for index in indices:
        index = int(index)
        messages = usable_messages(records[index], index, report)
        encoded = encode_chats(tokenizer, records[index], index, [messages], report) if messages is not None else None
        if encoded is None:
            continue
        (ids, labels), = encoded
        if len(ids) > seq_len:
            report.note("truncated", index)
            if all(label == IGNORE_INDEX for label in labels[1:seq_len]):
                report.note("nothing_trained", index)
                continue
        report.used += 1
        samples.append((ids, labels))
    return samples


@dataclass
class TrainingData:
    """The packed training set, the packed eval set (None without eval), and what happened to the rows."""

    train: PackedDataset
    eval: PackedDataset | None
    report: DataReport
    eval_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    train_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: Held-out prompts to sample at each evaluation: ``{"row", "messages", "reference"}`` (:func:`sample_prompts`).
    samples: list[dict] = field(default_factory=list)


def sample_prompts(records: Sequence[dict], rows: Iterable[int], count: int) -> list[dict]:
    """The first ``count`` usable held-out rows as prompts: the conversation up to its last trained
    assistant turn (``messages``, as the chat template takes them) and that turn's text
    (``reference``). Rows without a trained answer are passed over, as training does."""
    found: list[dict] = []
    for index in rows:
        if len(found) >= count:
            break
        messages = usable_messages(records[int(index)], int(index), DataReport())
        if not messages:
            continue
        last = max(i for i, message in enumerate(messages) if message["role"] == "assistant" and message.get("train", True))
        if last == 0:
            continue
        found.append({"row": int(index), "messages": for_template(messages[:last]), "reference": messages[last]["content"]})
    return found


def split_rows(num_rows: int, *, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded permutation of the rows, cut into (train rows, held-out eval rows): the first
    ``ceil(eval_fraction x rows)`` of it are held out and never train."""
    order = np.random.default_rng(seed).permutation(num_rows)
    held_out = min(num_rows - 1, math.ceil(eval_fraction * num_rows)) if eval_fraction > 0 else 0
    return order[held_out:], order[:held_out]


def _packed(tokenizer, records, rows, *, seq_len: int, pad_id: int, report: DataReport, pairs: bool) -> PackedDataset:
    """The rows tokenized and packed: supervised samples, or preference pairs (training/data/preference.py)."""
    if pairs:
        from .preference import pack_pairs, tokenize_pairs

        return pack_pairs(tokenize_pairs(tokenizer, records, rows, seq_len=seq_len, report=report), seq_len=seq_len,
                          pad_id=pad_id)
    return pack(tokenize_rows(tokenizer, records, rows, seq_len=seq_len, report=report), seq_len=seq_len, pad_id=pad_id)


def build_training_data(tokenizer, source: str, *, seq_len: int, seed: int, split: str = "train",
                        max_samples: int | None = None, eval_fraction: float = 0.0, eval_split: str | None = None,
                        eval_max_sequences: int = 64, name: str | None = None, samples: int = 0,
                        objective: str = "sft") -> TrainingData:
    """Load, hold out the eval rows (or read ``eval_split``), shuffle (by ``seed``), tokenize
    with response-only labels, and pack; the first ``samples`` held-out prompts kept. With
    ``objective`` ``dpo`` the rows are preference pairs (training/data/preference.py). Raises
    :class:`DataError` if too few rows can train (naming the data set ``name``, by default ``source``)."""
    records = load_records(source, split=split)
    pairs = objective == "dpo"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows, eval_rows = split_rows(len(records), eval_fraction=0.0 if eval_split else eval_fraction, seed=seed)
    report = DataReport(rows=len(records), held_out=len(eval_rows), records=records if isinstance(records, Records) else None,
                        preference=pairs)
    if max_samples is not None:
        train_rows = train_rows[:max_samples]
    report.examined = len(train_rows)
    train = _packed(tokenizer, records, train_rows, seq_len=seq_len, pad_id=pad_id, report=report, pairs=pairs)
    report.raise_if_unusable(name or source)
    evaluation = None
    held_out = records
    if eval_split:
        held_out = load_records(source, split=eval_split)
        eval_rows = np.random.default_rng(seed).permutation(len(held_out))
    evaluation = _packed(tokenizer, held_out, eval_rows, seq_len=seq_len, pad_id=pad_id, report=DataReport(), pairs=pairs)
    evaluation = evaluation.head(min(len(evaluation), eval_max_sequences)) if len(evaluation) else None
    if pairs:
        from .preference import pair_prompts

        prompts = pair_prompts(held_out, eval_rows, samples) if evaluation is not None and samples else []
    else:
        prompts = sample_prompts(held_out, eval_rows, samples) if evaluation is not None and samples else []
    return TrainingData(train=train, eval=evaluation, report=report, eval_rows=eval_rows, train_rows=train_rows,
                        samples=prompts)

"""Supervised fine-tuning data: rows of the formats people have, chat formatting, loss on
response tokens only, a held-out eval split, packing without cross-sample attention, and a
deterministic per-worker order that a checkpoint can resume from.

No single row stops a run: a row with no assistant turn or an empty response is skipped, a
sample longer than ``seq_len`` is truncated, each counted and reported once (the count and the
first example's row). Only a data set with no usable row, or whose rows are of no known
format, is an error (:class:`DataError`), raised on the driver before Ray starts when the
file is local.

Packed sequences carry ``position_ids`` that restart at 0 at every sample, and each
micro-batch is flattened into one row (see :class:`MicroBatch`), so no token attends
across samples under flash-attention 2, sdpa or eager alike.
"""

from __future__ import annotations

import functools

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

IGNORE_INDEX = -100

#: ShareGPT speakers, as chat roles.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
#: The formats :func:`to_messages` reads, for messages.
FORMATS = ("messages (chat)", "conversations with from/value (ShareGPT)", "prompt/completion",
           "instruction/context/response (Dolly)", "instruction/input/output (Alpaca)")


class DataError(ValueError):
    """The data set cannot train anything: no usable row, or rows of no known format."""


class UnknownFormat(ValueError):
    """A row of none of :data:`FORMATS`."""


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
        raise DataError(f"dataset={repo_id!r}: no JSONL, JSON or Parquet data files found on the Hub")
    return rows


def _text(value) -> str:
    return "" if value is None else str(value)


def to_messages(record: dict) -> list[dict]:
    """A row as a chat: ``messages`` (role/content), ShareGPT ``conversations`` (from/value),
    ``prompt``/``completion``, Dolly (instruction, context, response) or Alpaca (instruction,
    input, output). Raises :class:`UnknownFormat` for anything else."""
    if isinstance(record.get("messages"), list):
        return [{"role": m["role"], "content": _text(m.get("content"))} for m in record["messages"]]
    if isinstance(record.get("conversations"), list):
        messages = []
        for turn in record["conversations"]:
            speaker = turn.get("from", turn.get("role"))
            if speaker not in _SHAREGPT_ROLES:
                raise UnknownFormat(f"a ShareGPT turn from {speaker!r}; expected one of {', '.join(sorted(_SHAREGPT_ROLES))}")
            messages.append({"role": _SHAREGPT_ROLES[speaker], "content": _text(turn.get("value", turn.get("content")))})
        return messages
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        # TRL's conversational prompt-completion rows hold message lists.
        prompt_messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": _text(prompt)}]
        completion_messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": _text(completion)}]
        return [*prompt_messages, *completion_messages]
    instruction = record.get("instruction")
    answer = record.get("response", record.get("output"))
    if instruction is None or answer is None:
        raise UnknownFormat(f"a row with keys {sorted(record)}")
    context = _text(record.get("context") or record.get("input"))
    prompt = f"{instruction}\n\n{context}" if context else _text(instruction)
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(answer)}]


# ---------------------------------------------------------------------- what happened to each row

#: Why a row did not train as it was, in the order they are reported.
SKIP_REASONS = {
    "unknown_format": "rows of no known format",
    "no_assistant_turn": "rows with no assistant turn",
    "empty_response": "rows with an empty response",
    "nothing_trained": f"rows whose response lies wholly beyond seq_len",
}


@dataclass
class DataReport:
    """Rows read, rows used, and the rows skipped or truncated by reason (count and the
    first example's row index in the data set)."""

    rows: int = 0
    used: int = 0
    #: Rows held out for the eval loss (not examined here).
    held_out: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    first: dict[str, int] = field(default_factory=dict)
    #: Keys of the first row of no known format, for the error message.
    unknown_keys: list[str] | None = None

    def note(self, reason: str, row: int) -> None:
        """Count a row under ``reason`` (a key of :data:`SKIP_REASONS`, or ``truncated``)."""
        if reason == "truncated":
            self.truncated += 1
        else:
            self.skipped[reason] += 1
        self.first.setdefault(reason, row)

    def lines(self, seq_len: int) -> list[str]:
        """One line per kind of skipped or truncated row, for the log."""
        out = [f"skipped {self.skipped[reason]} {text} (first: row {self.first[reason]})"
               for reason, text in SKIP_REASONS.items() if self.skipped[reason]]
        if self.truncated:
            out.append(f"truncated {self.truncated} samples longer than seq_len({seq_len}) tokens "
                       f"(first: row {self.first['truncated']})")
        return out

    def raise_if_unusable(self, source: str) -> None:
        """:class:`DataError` when no row is usable, saying why."""
        if self.used:
            return
        if self.skipped["unknown_format"] == self.rows:
            raise DataError(
                f"dataset={source!r}: none of its {self.rows} rows is of a known format (first row's keys: "
                f"{self.unknown_keys}); use rows of one of: {'; '.join(FORMATS)}"
            )
        reasons = ", ".join([f"{self.skipped[r]} {text}" for r, text in SKIP_REASONS.items() if self.skipped[r]]
                            + ([f"{self.held_out} held out for the eval loss"] if self.held_out else []))
        raise DataError(f"dataset={source!r}: no usable row among {self.rows} ({reasons or 'it is empty'}); "
                        "each row needs an assistant turn with a non-empty response")


def usable_messages(record: dict, index: int, report: DataReport) -> list[dict] | None:
    """The row as a chat if it can train something, else None (counted in ``report``)."""
    try:
        messages = to_messages(record)
    except UnknownFormat:
        if report.unknown_keys is None:
            report.unknown_keys = sorted(record) if isinstance(record, dict) else [type(record).__name__]
        report.note("unknown_format", index)
        return None
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    if not answers:
        report.note("no_assistant_turn", index)
        return None
    if not any(a.strip() for a in answers):
        report.note("empty_response", index)
        return None
    return messages


def check_records(records: Sequence[dict], source: str) -> DataReport:
    """Read every row as a chat and raise :class:`DataError` if none can train (run on the
    driver for a local file: seconds, before Ray starts)."""
    report = DataReport(rows=len(records))
    for index, record in enumerate(records):
        if usable_messages(record, index, report) is not None:
            report.used += 1
    report.raise_if_unusable(source)
    return report


# ---------------------------------------------------------------------- tokenization

def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered once by the chat template, and the character span of each
    non-empty assistant turn in it: its content and the template's end of turn.

    A turn's span starts where the prompt rendered with the generation prompt ends and stops
    where the conversation up to that turn ends, when the template renders prefixes as text
    prefixes (ChatML, Llama 3, Mistral do). Otherwise the content is looked up in the text,
    after the previous turn, and the EOS text right after it joins the span.
    """
    render = tokenizer.apply_chat_template
    text = render(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or not message["content"].strip():
            continue
        prompt = render(messages[:index], tokenize=False, add_generation_prompt=True)
        upto = render(messages[: index + 1], tokenize=False)
        if text.startswith(upto) and upto.startswith(prompt) and len(prompt) >= cursor:
            spans.append((len(prompt), len(upto)))
        else:
            start = text.find(message["content"], cursor)
            if start < 0:
                raise ValueError("the chat template does not render an assistant turn's content verbatim; "
                                 "cannot find which tokens to train")
            end = start + len(message["content"])
            if tokenizer.eos_token and text.startswith(tokenizer.eos_token, end):
                end += len(tokenizer.eos_token)
            spans.append((start, end))
        cursor = spans[-1][1]
    return text, spans


def tokenize_sample(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels that are ``IGNORE_INDEX`` except on
    assistant turns: the loss is on responses only.

    The text is tokenized once, with offsets; a token is trained when it starts inside an
    assistant span (:func:`assistant_spans`). Nothing depends on how the tokenizer merges
    across the prompt/response boundary: with Qwen2's tokenizer ``assistant\\n`` followed by
    a response starting with ``\\n`` gives one ``\\n\\n`` token, which starts in the prompt
    and is not trained; the response's tokens after it are.
    """
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for position, (start, _end) in enumerate(encoded["offset_mapping"]):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span < len(spans) and spans[span][0] <= start:
            labels[position] = ids[position]
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
        """What :func:`training.metrics.step_flops` counts, for the sequences ``indices`` (a
        step's global batch: every worker's micro-batches together)."""
        return {"tokens": int(self.real_tokens[indices].sum()), "trained_tokens": int(self.trained_tokens[indices].sum()),
                "squared_lengths": int(self.squared_lengths[indices].sum())}

    def head(self, rows: int) -> "PackedDataset":
        """The first ``rows`` sequences."""
        return PackedDataset(self.input_ids[:rows], self.labels[:rows], self.position_ids[:rows], self.real[:rows])


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


def tokenize_rows(tokenizer, records: Sequence[dict], indices: Iterable[int], *, seq_len: int,
                  report: DataReport) -> list[tuple[list[int], list[int]]]:
    """Tokenized samples of the rows ``indices`` that can train, counting the others in ``report``."""
    samples = []
    for index in indices:
        index = int(index)
        messages = usable_messages(records[index], index, report)
        if messages is None:
            continue
        ids, labels = tokenize_sample(tokenizer, messages)
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


def split_rows(num_rows: int, *, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded permutation of the rows, cut into (train rows, held-out eval rows): the first
    ``ceil(eval_fraction x rows)`` of it are held out and never train."""
    order = np.random.default_rng(seed).permutation(num_rows)
    held_out = min(num_rows - 1, math.ceil(eval_fraction * num_rows)) if eval_fraction > 0 else 0
    return order[held_out:], order[:held_out]


def build_training_data(tokenizer, source: str, *, seq_len: int, seed: int, split: str = "train",
                        max_samples: int | None = None, eval_fraction: float = 0.0, eval_split: str | None = None,
                        eval_max_sequences: int = 64) -> TrainingData:
    """Load, hold out the eval rows (or read ``eval_split``), shuffle (by ``seed``), tokenize
    with response-only labels, and pack. Raises :class:`DataError` if nothing can train."""
    records = load_records(source, split=split)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows, eval_rows = split_rows(len(records), eval_fraction=0.0 if eval_split else eval_fraction, seed=seed)
    report = DataReport(rows=len(records), held_out=len(eval_rows))
    if max_samples is not None:
        train_rows = train_rows[:max_samples]
    train = pack(tokenize_rows(tokenizer, records, train_rows, seq_len=seq_len, report=report), seq_len=seq_len, pad_id=pad_id)
    report.raise_if_unusable(source)
    evaluation = None
    if eval_split:
        eval_records = load_records(source, split=eval_split)
        eval_rows = np.random.default_rng(seed).permutation(len(eval_records))
        eval_samples = tokenize_rows(tokenizer, eval_records, eval_rows, seq_len=seq_len, report=DataReport())
    else:
        eval_samples = tokenize_rows(tokenizer, records, eval_rows, seq_len=seq_len, report=DataReport())
    if eval_samples:
        evaluation = pack(eval_samples, seq_len=seq_len, pad_id=pad_id)
        evaluation = evaluation.head(min(len(evaluation), eval_max_sequences))
    return TrainingData(train=train, eval=evaluation, report=report, eval_rows=eval_rows, train_rows=train_rows)


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


def segment_bounds(position_ids: np.ndarray) -> np.ndarray:
    """Cumulative segment boundaries ``[0, ..., n]`` of a flat row whose positions restart
    at 0 for every sample (and for every row's trailing padding)."""
    starts = np.flatnonzero(position_ids == 0)
    return np.append(starts, len(position_ids)).astype(np.int32)


def collate(dataset: PackedDataset, indices: np.ndarray, device: torch.device) -> MicroBatch:
    """The packed sequences ``indices`` as one flattened row (1, B * seq_len) with
    per-sample ``position_ids`` and flash-attention's varlen boundaries; no attention mask.
    An index of -1 stands for a sequence of the same shape that trains nothing (the eval's
    padding slots)."""
    indices = np.asarray(indices)
    blank = indices < 0
    safe = np.where(blank, 0, indices)
    labels = dataset.labels[safe].copy()
    labels[blank] = IGNORE_INDEX
    ids, labels = dataset.input_ids[safe].reshape(1, -1), labels.reshape(1, -1)
    positions, real = dataset.position_ids[safe].reshape(-1), dataset.real[safe].copy()
    real[blank] = 0
    real = real.reshape(-1)
    bounds = segment_bounds(positions)
    lengths = np.diff(bounds)
    max_length = int(lengths.max())
    pinned = device.type == "cuda"

    def to_device(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor.pin_memory().to(device, non_blocking=True) if pinned else tensor.to(device)

    cu_seq_lens = to_device(bounds)
    inputs = {
        "input_ids": to_device(ids),
        "position_ids": to_device(positions.reshape(1, -1)),
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }
    # Position t learns labels[t + 1] (training/loss.py): the trained positions, on the CPU.
    trained = np.flatnonzero(labels[0, 1:] != IGNORE_INDEX).astype(np.int64)
    real_segments = tuple(int(n) for n, start in zip(lengths, bounds[:-1]) if real[start])
    return MicroBatch(
        inputs=inputs,
        labels=to_device(labels),
        trained_positions=to_device(trained),
        real_tokens=int(real.sum()),
        label_tokens=len(trained),
        sample_lengths=real_segments,
    )

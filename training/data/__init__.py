"""Supervised fine-tuning data: rows of the formats people have, chat formatting, loss on
response tokens only, a held-out eval split, packing without cross-sample attention, and a
deterministic per-worker order that a checkpoint can resume from.

No single row stops a run, and no row trains something other than what its format means:
every row trains as its format says (roles mapped, content parts joined, per-turn weights and
tool calls honoured, a control token typed in a message kept as text) or is skipped and
counted by cause (:data:`SKIP_REASONS`: a line that is not JSON, a message without a role, a
role no format defines, a row the chat template refuses, ...), with the first row of each cause
(and where it is in its file) in the log and the run's summary; a sample longer than
``seq_len`` is truncated, counted alike. Only a data set with no usable row, or fewer than
:data:`MIN_USABLE_SHARE` of its rows, is an error (:class:`DataError`), raised on the driver
before Ray starts (training/train.py ``check_dataset``: the same reading and tokenization as
the workers').

References read: TRL's ``SFTTrainer`` data handling (``trl/trainer/sft_trainer.py``,
``trl/data_utils.py``: conversational rows through the chat template, prompt-completion rows,
no per-turn weights, and a row that breaks the template stops the run) and OpenAI's
fine-tuning format (``messages`` with ``system``/``developer``/``user``/``assistant``/``tool``
roles, content parts, ``tool_calls``, ``weight`` 0 or 1 on assistant turns).

Packed sequences carry ``position_ids`` that restart at 0 at every sample, and each
micro-batch is flattened into one row (see :class:`MicroBatch`), so no token attends
across samples under flash-attention 2, sdpa or eager alike.

The modules, in the order a row goes through them: :mod:`.records` (reading files),
:mod:`.messages` (formats as chat messages), :mod:`.report` (what happened to each row),
:mod:`.masking` (tokens and response-only labels), :mod:`.packing`, :mod:`.dataset` (the
train and eval sets of a run), :mod:`.order` (which sequences each worker trains on at each
step) and :mod:`.batch` (a micro-batch as the model takes it).
"""

from .records import BadRow, DataError, FILE_TYPES, FORMATS, IGNORE_INDEX, Records, UnknownFormat, Unreadable, load_records, read_data_file
from .messages import for_template, supports_tools, to_messages, trainable
from .report import MIN_USABLE_SHARE, SKIP_REASONS, DataReport, check_records, usable_messages
from .masking import assistant_spans, encode_chat, tokenize_sample
from .packing import PackedDataset, pack, segment_bounds
from .dataset import TrainingData, build_training_data, split_rows, tokenize_rows
from .order import DataOrder, eval_micro_batches
from .batch import MicroBatch, collate

__all__ = [
    "BadRow",
    "DataError",
    "DataOrder",
    "DataReport",
    "FILE_TYPES",
    "FORMATS",
    "IGNORE_INDEX",
    "MIN_USABLE_SHARE",
    "MicroBatch",
    "PackedDataset",
    "Records",
    "SKIP_REASONS",
    "TrainingData",
    "UnknownFormat",
    "Unreadable",
    "assistant_spans",
    "build_training_data",
    "check_records",
    "collate",
    "encode_chat",
    "eval_micro_batches",
    "for_template",
    "load_records",
    "pack",
    "read_data_file",
    "segment_bounds",
    "split_rows",
    "supports_tools",
    "to_messages",
    "tokenize_rows",
    "tokenize_sample",
    "trainable",
    "usable_messages",
]

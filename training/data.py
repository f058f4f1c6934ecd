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
"""

from __future__ import annotations

import codecs
import functools
import gzip
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

IGNORE_INDEX = -100

#: The formats :func:`to_messages` reads, for messages.
FORMATS = ("messages (chat)", "conversations with from/value (ShareGPT)", "prompt/completion",
           "instruction/context/response (Dolly)", "instruction/input/output (Alpaca)")


class DataError(ValueError):
    """The data set cannot train anything: no usable row, or rows of no known format."""


class UnknownFormat(ValueError):
    """A row of none of :data:`FORMATS`."""


class BadRow(ValueError):
    """A row that cannot train as it is: ``reason`` (a key of :data:`SKIP_REASONS`) and what is
    wrong with it, naming the key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Unreadable:
    """A line of a JSONL file that is no row: not UTF-8, or not JSON (a truncated last line)."""

    detail: str


class Records(list):
    """Rows of a data set, with where each came from (``file line N``) for the log."""

    def __init__(self, rows: Iterable = (), *, name: str = "", lines: Sequence[int] | None = None) -> None:
        super().__init__(rows)
        self.name, self.line_numbers = name, list(lines) if lines is not None else None

    def where(self, index: int) -> str:
        """``row 50 (train.jsonl line 51)``, or ``row 50``."""
        if self.name and self.line_numbers is not None and index < len(self.line_numbers):
            return f"row {index} ({self.name} line {self.line_numbers[index]})"
        return f"row {index} ({self.name})" if self.name else f"row {index}"


# ---------------------------------------------------------------------- records

#: The file types :func:`read_data_file` reads, each also gzip'd (``.jsonl.gz``).
FILE_TYPES = (".jsonl", ".json", ".parquet", ".arrow")


def load_records(source: str, *, split: str = "train") -> Records:
    """Rows of a local file (:data:`FILE_TYPES`), or of a Hugging Face Hub data set (with
    ``datasets`` when installed, else from the repository's data files)."""
    if Path(source).is_file():
        return read_data_file(Path(source))
    try:
        import datasets
    except ImportError:
        return _hub_files(source, split)
    return Records(datasets.load_dataset(source, split=split), name=source)


def _file_type(path: Path) -> tuple[str, bool]:
    """(``.jsonl``, ``.json``, ``.parquet`` or ``.arrow``; gzip'd)."""
    suffixes = [s.lower() for s in path.suffixes]
    gzipped = bool(suffixes) and suffixes[-1] == ".gz"
    if gzipped:
        suffixes = suffixes[:-1]
    kind = suffixes[-1] if suffixes else ""
    return kind, gzipped


def read_data_file(path: Path) -> Records:
    """Rows of one JSONL, JSON, Parquet or Arrow (``datasets``' ``save_to_disk``) file, each
    maybe gzip'd. A JSONL line that is not UTF-8 or not JSON is an :class:`Unreadable` row
    (counted and skipped later), not the end of the file; lines are cut at ``\\n`` only (a
    U+2028 or U+0085 inside a string is text, as JSON says), ``\\r\\n`` too, and a UTF-8 BOM
    is dropped."""
    kind, gzipped = _file_type(path)
    if kind not in FILE_TYPES:
        raise DataError(f"dataset={str(path)!r}: a {''.join(path.suffixes) or 'file without a suffix'}; "
                        f"use {', '.join(FILE_TYPES)} (each may be gzip'd: .jsonl.gz)")
    data = path.read_bytes()
    if gzipped:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise DataError(f"dataset={str(path)!r}: not a complete gzip file ({error})") from error
    if kind == ".parquet":
        import pyarrow.parquet as pq

        return Records(pq.read_table(pa_buffer(data)).to_pylist(), name=path.name)
    if kind == ".arrow":
        return Records(_arrow_rows(data, path), name=path.name)
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    if kind == ".json":
        whole = data.strip()
        if whole[:1] in (b"[", b"{"):
            try:
                document = json.loads(whole.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                document = None  # JSON Lines under a .json name, or a broken file: line by line below
            if isinstance(document, list):
                return Records(document, name=path.name)
            if isinstance(document, dict):
                return Records(_table_rows(document), name=path.name)
    return _jsonl_rows(data, path.name)


def _hub_files(repo_id: str, split: str) -> Records:
    """A Hub data set without the ``datasets`` library: its JSONL/JSON/Parquet files
    (those whose path names the split, when any does), read in order."""
    from huggingface_hub import snapshot_download

    root = Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=["*.jsonl", "*.json", "*.parquet"]))
    files = sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet") and p.name != "dataset_infos.json")
    named = [p for p in files if split in p.relative_to(root).as_posix()]
    rows = [row for path in (named or files) for row in read_data_file(path)]
    if not rows:
        raise DataError(f"dataset={repo_id!r}: no JSONL, JSON or Parquet data files found on the Hub")
    return Records(rows, name=repo_id)


def pa_buffer(data: bytes):
    import pyarrow as pa

    return pa.BufferReader(data)


def _arrow_rows(data: bytes, path: Path) -> list:
    """Rows of an Arrow IPC stream (what ``datasets`` writes) or file."""
    import pyarrow as pa

    for open_ in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            return open_(pa.BufferReader(data)).read_all().to_pylist()
        except pa.ArrowInvalid:
            continue
    raise DataError(f"dataset={str(path)!r}: not an Arrow IPC stream or file")


def _table_rows(document: dict) -> list:
    """A JSON object as rows: pandas' ``to_json()`` layouts (``columns``, its default:
    ``{column: {index: value}}``; ``index``: ``{index: {column: value}}``; ``split``; ``table``),
    else the object is one row."""
    if isinstance(document.get("data"), list) and ("schema" in document or "columns" in document):
        data = document["data"]
        if "columns" in document:  # orient="split"
            return [dict(zip(document["columns"], values)) for values in data]
        return [{k: v for k, v in row.items() if k != "index"} for row in data]  # orient="table"
    values = list(document.values())
    if document and all(isinstance(v, dict) for v in values):
        if all(str(k).lstrip("-").isdigit() for k in document):  # orient="index"
            return [document[k] for k in sorted(document, key=lambda k: int(k))]
        labels = list(dict.fromkeys(label for column in values for label in column))
        if labels and all(str(label).lstrip("-").isdigit() for label in labels):  # orient="columns"
            return [{column: document[column].get(label) for column in document} for label in labels]
    return [document]


def _jsonl_rows(data: bytes, name: str) -> Records:
    rows, lines = [], []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        lines.append(number)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            rows.append(Unreadable(f"line {number}: not UTF-8 (byte 0x{raw[error.start]:02x} at column {error.start + 1})"))
            continue
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError as error:
            rows.append(Unreadable(f"line {number}: not JSON ({error.msg} at column {error.colno})"))
    if rows and all(isinstance(row, Unreadable) for row in rows):
        raise DataError(f"dataset={name!r}: no line is a JSON row; the first: {rows[0].detail}")
    return Records(rows, name=name, lines=lines)


def _text(value) -> str:
    """A scalar as text: None and a float NaN (pandas' and Parquet's missing value) are empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


#: Chat roles as the formats name them (OpenAI's ``developer`` is a system message for older
#: models; ``function`` is OpenAI's tool role before ``tool``).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
          "function": "tool"}
#: ShareGPT speakers, as chat roles (``function_call``/``observation``: the tool-calling variants).
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system",
                   "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool"}


def _content(value, where: str) -> str:
    """A message's content as text: a string, or OpenAI's content parts (``[{"type": "text",
    "text": ...}]``) joined; a part of another type (an image) is a :class:`BadRow`."""
    if isinstance(value, list):
        texts = []
        for number, part in enumerate(value):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRow("non_text_content", f"{where}: content part {number} is {kind!r}, not text")
        return "".join(texts)
    if isinstance(value, dict):
        return _content([value], where)
    return _text(value)


def _message(turn, where: str, roles: dict[str, str], role_keys: tuple[str, ...], content_keys: tuple[str, ...]) -> dict:
    """One turn as ``{"role", "content"[, "tool_calls"], "train"}``: ``train`` is False for an
    assistant turn with ``weight: 0`` (OpenAI's fine-tuning format, ShareGPT variants)."""
    if not isinstance(turn, dict):
        raise BadRow("malformed_message", f"{where} is a {type(turn).__name__}, not an object with a role and a content")
    key = next((k for k in role_keys if k in turn), None)
    if key is None:
        raise BadRow("malformed_message", f"{where} has no {role_keys[0]!r}")
    speaker = turn[key]
    if not isinstance(speaker, str) or speaker.lower() not in roles:
        raise BadRow("unknown_role", f"{where}: {key} {speaker!r}; use one of {', '.join(sorted(roles))}")
    content_key = next((k for k in content_keys if k in turn), content_keys[0])
    message = {"role": roles[speaker.lower()], "content": _content(turn.get(content_key), f"{where}.{content_key}")}
    calls = turn.get("tool_calls") or ([{"type": "function", "function": turn["function_call"]}]
                                       if isinstance(turn.get("function_call"), dict) else None)
    if calls:
        message["tool_calls"] = calls
    weight = turn.get("weight", 1)
    message["train"] = message["role"] == "assistant" and weight not in (0, 0.0, False, "0")
    return message


def to_messages(record) -> list[dict]:
    """A row as a chat: ``messages`` (role/content, OpenAI's fine-tuning format with content
    parts, ``tool_calls`` and per-turn ``weight``), ShareGPT ``conversations`` (from/value,
    with its top-level ``system``), ``prompt``/``completion``, Dolly (instruction, context,
    response) or Alpaca (instruction, input, output). Each message has ``train``: whether its
    tokens are trained (an assistant turn, not weighted 0, after the first user turn: one that
    opens the conversation is context). Raises :class:`UnknownFormat` for a row of no known
    format and :class:`BadRow` for one that is broken."""
    if not isinstance(record, dict):
        raise BadRow("not_an_object", f"a JSON {type(record).__name__} where a row (an object) belongs")
    if isinstance(record.get("messages"), list):
        messages = [_message(m, f"messages[{i}]", _ROLES, ("role",), ("content",)) for i, m in enumerate(record["messages"])]
    elif isinstance(record.get("conversations"), list):
        messages = [_message(t, f"conversations[{i}]", _SHAREGPT_ROLES, ("from", "role"), ("value", "content"))
                    for i, t in enumerate(record["conversations"])]
        if _text(record.get("system")).strip() and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": _text(record["system"]), "train": False})
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        # TRL's conversational prompt-completion rows hold message lists.
        prompt_messages = ([_message(m, f"prompt[{i}]", _ROLES, ("role",), ("content",)) for i, m in enumerate(prompt)]
                           if isinstance(prompt, list) else [{"role": "user", "content": _text(prompt), "train": False}])
        completion_messages = ([_message(m, f"completion[{i}]", _ROLES, ("role",), ("content",)) for i, m in enumerate(completion)]
                               if isinstance(completion, list) else [{"role": "assistant", "content": _text(completion), "train": True}])
        messages = [*prompt_messages, *completion_messages]
    else:
        instruction = record.get("instruction")
        answer = record.get("response", record.get("output"))
        if instruction is None or answer is None:
            raise UnknownFormat(f"a row with keys {sorted(record)}")
        context = _text(record.get("context") or record.get("input"))
        prompt = f"{_text(instruction)}\n\n{context}" if context else _text(instruction)
        messages = [{"role": "user", "content": prompt, "train": False}, {"role": "assistant", "content": _text(answer), "train": True}]
    for message in messages:  # a greeting before the first user turn is context, not an answer
        if message["role"] == "user":
            break
        message["train"] = False
    return messages


def trainable(message: dict) -> bool:
    """Whether a message has tokens to train: a ``train`` turn (without the key: an assistant
    turn) with text or tool calls."""
    return message.get("train", message["role"] == "assistant") and bool(message["content"].strip() or message.get("tool_calls"))


def for_template(messages: list[dict]) -> list[dict]:
    """The messages as a chat template takes them (without ``train``)."""
    return [{k: v for k, v in m.items() if k != "train"} for m in messages]


def supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tool_calls`` (Qwen2.5's, Llama 3.1's do)."""
    template = tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("tool_calls" in text for text in texts)


# ---------------------------------------------------------------------- what happened to each row

#: Why a row did not train as it was, in the order they are reported.
SKIP_REASONS = {
    "unreadable": "lines that are not a JSON row (not UTF-8, not JSON: a truncated line)",
    "not_an_object": "rows that are not JSON objects",
    "unknown_format": "rows of no known format",
    "malformed_message": "rows with a message that is not an object with a role",
    "unknown_role": "rows with a role no format defines",
    "non_text_content": "rows with content parts that are not text (images, audio)",
    "tool_calls_unsupported": "rows with tool calls the model's chat template cannot render",
    "template_error": "rows the chat template refuses (e.g. roles that do not alternate)",
    "no_assistant_turn": "rows with no assistant turn to train (none, weight 0, or only before the first user turn)",
    "empty_response": "rows with an empty response",
    "nothing_trained": "rows whose response lies wholly beyond seq_len",
}
#: A run stops before Ray starts when fewer than this share of the rows it would train on can
#: train (at least one must): with nine rows in ten unusable the data is being read wrong (a
#: format this reader does not know, a wrong --seq-len), not merely noisy.
MIN_USABLE_SHARE = 0.1


@dataclass
class DataReport:
    """Rows read, rows used, and the rows skipped or truncated by reason (count, and the first
    example's row, where it is in its file, and what is wrong with it)."""

    rows: int = 0
    used: int = 0
    #: Rows held out for the eval loss (not examined here).
    held_out: int = 0
    #: Rows examined for training (the rows less those held out, at most --max-samples).
    examined: int | None = None
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    first: dict[str, int] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    #: Keys of the first row of no known format, for the error message.
    unknown_keys: list[str] | None = None
    #: Where the rows come from (``file line N``).
    records: Records | None = None

    def note(self, reason: str, row: int, detail: str | None = None) -> None:
        """Count a row under ``reason`` (a key of :data:`SKIP_REASONS`, or ``truncated``)."""
        if reason == "truncated":
            self.truncated += 1
        else:
            self.skipped[reason] += 1
        if reason not in self.first or row < self.first[reason]:  # rows are examined shuffled
            self.first[reason] = row
            self.details.pop(reason, None)
            if detail:
                self.details[reason] = detail

    def _first(self, reason: str) -> str:
        where = self.records.where(self.first[reason]) if self.records is not None else f"row {self.first[reason]}"
        detail = self.details.get(reason)
        return f"first: {where}{': ' + detail if detail else ''}"

    def lines(self, seq_len: int) -> list[str]:
        """One line per kind of skipped or truncated row, for the log."""
        out = [f"skipped {self.skipped[reason]} {text} ({self._first(reason)})"
               for reason, text in SKIP_REASONS.items() if self.skipped[reason]]
        if self.truncated:
            out.append(f"truncated {self.truncated} samples longer than seq_len({seq_len}) tokens "
                       f"({self._first('truncated')})")
        return out

    def summary(self) -> dict:
        """The counts by cause and the first row of each, for the run's summary."""
        return {"rows": self.rows, "used": self.used, "held_out": self.held_out,
                "skipped": {reason: {"rows": self.skipped[reason], "first": self._first(reason)[len("first: "):]}
                            for reason in SKIP_REASONS if self.skipped[reason]},
                "truncated": self.truncated}

    def raise_if_unusable(self, source: str) -> None:
        """:class:`DataError` when no row, or fewer than :data:`MIN_USABLE_SHARE` of those
        examined, can train, saying why."""
        examined = self.examined if self.examined is not None else self.rows - self.held_out
        if self.used and self.used >= MIN_USABLE_SHARE * examined:
            return
        if self.skipped["unknown_format"] and self.skipped["unknown_format"] == examined:
            raise DataError(
                f"dataset={source!r}: none of its {self.rows} rows is of a known format (first row's keys: "
                f"{self.unknown_keys}); use rows of one of: {'; '.join(FORMATS)}"
            )
        reasons = "; ".join([f"{self.skipped[r]} {text} ({self._first(r)})" for r, text in SKIP_REASONS.items()
                             if self.skipped[r]] + ([f"{self.held_out} held out for the eval loss"] if self.held_out else []))
        if not self.used:
            raise DataError(f"dataset={source!r}: no usable row among {self.rows} ({reasons or 'it is empty'}); "
                            "each row needs an assistant turn with a non-empty response")
        raise DataError(f"dataset={source!r}: only {self.used} of {examined} rows can train, under "
                        f"{MIN_USABLE_SHARE:.0%} ({reasons}); fix the rows or the options above, or train on the "
                        "usable rows alone (a file of them)")


def usable_messages(record, index: int, report: DataReport) -> list[dict] | None:
    """The row as a chat if it can train something, else None (counted in ``report``)."""
    if isinstance(record, Unreadable):
        report.note("unreadable", index, record.detail)
        return None
    try:
        messages = to_messages(record)
    except UnknownFormat:
        if report.unknown_keys is None:
            report.unknown_keys = sorted(record)
        report.note("unknown_format", index, f"keys {sorted(record)}")
        return None
    except BadRow as bad:
        report.note(bad.reason, index, bad.detail)
        return None
    answers = [m for m in messages if m["role"] == "assistant" and m["train"]]
    if not answers:
        report.note("no_assistant_turn", index)
        return None
    if not any(trainable(m) for m in answers):
        report.note("empty_response", index)
        return None
    return messages


def check_records(records: Sequence[dict], source: str) -> DataReport:
    """Read every row as a chat and raise :class:`DataError` if too few can train."""
    report = DataReport(rows=len(records), records=records if isinstance(records, Records) else None)
    for index, record in enumerate(records):
        if usable_messages(record, index, report) is not None:
            report.used += 1
    report.raise_if_unusable(source)
    return report


# ---------------------------------------------------------------------- tokenization

def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered once by the chat template, and the character span of each
    trained assistant turn in it (:func:`trainable`): its content and the template's end of turn.

    A turn's span starts where the prompt rendered with the generation prompt ends and stops
    where the conversation up to that turn ends, when the template renders prefixes as text
    prefixes (ChatML, Llama 3, Mistral do). Otherwise the content is looked up in the text,
    after the previous turn, and the EOS text right after it joins the span. A template that
    raises on the row (roles that do not alternate, for Mistral's or Gemma's) raises here.
    """
    chat = for_template(messages)
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False)
    text = render(chat)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or not trainable(message):
            if message["role"] == "assistant" and message["content"]:
                found = text.find(message["content"], cursor)  # an untrained turn: skip past it
                cursor = found + len(message["content"]) if found >= 0 else cursor
            continue
        prompt = render(chat[:index], add_generation_prompt=True)
        upto = render(chat[: index + 1])
        if text.startswith(upto) and upto.startswith(prompt) and len(prompt) >= cursor:
            spans.append((len(prompt), len(upto)))
        else:
            start = text.find(message["content"], cursor) if message["content"] else -1
            if start < 0:
                raise BadRow("template_error", "the chat template does not render an assistant turn's content verbatim; "
                                               "cannot find which tokens to train")
            end = start + len(message["content"])
            if tokenizer.eos_token and text.startswith(tokenizer.eos_token, end):
                end += len(tokenizer.eos_token)
            spans.append((start, end))
        cursor = spans[-1][1]
    return text, spans


@functools.lru_cache(maxsize=8)
def _control_tokens(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """The tokenizer's special (control) tokens: a pattern matching any, and their ids."""
    names = set(tokenizer.all_special_tokens)
    names |= {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    names = sorted((n for n in names if n), key=len, reverse=True)
    if not names:
        return None, {}
    return re.compile("|".join(map(re.escape, names))), {n: tokenizer.convert_tokens_to_ids(n) for n in names}


def _content_spans(text: str, messages: list[dict], pattern: re.Pattern | None) -> list[tuple[int, int]]:
    """Where each message's content is in the rendered text (in order). A content that holds a
    control token and is not rendered verbatim cannot be kept text: a :class:`BadRow`."""
    spans, cursor = [], 0
    for message in messages:
        content = message["content"]
        if not content:
            continue
        start = text.find(content, cursor)
        if start < 0:
            if pattern is not None and pattern.search(content):
                raise BadRow("template_error", "the chat template does not render a message holding a control token "
                                               "verbatim; cannot keep the token as text")
            continue
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def encode_chat(tokenizer, text: str, messages: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of a rendered conversation, where the template's control
    tokens are control tokens and the messages' text is text: ``<|im_end|>`` typed by a user is
    split like any text (``split_special_tokens``), so no row can fake a turn boundary. Outside
    the messages the text is cut at control tokens and each piece tokenized, which is what the
    tokenizer does with a whole text, so a row without typed control tokens tokenizes alike."""
    pattern, ids_of = _control_tokens(tokenizer)
    if pattern is None or not any(pattern.search(m["content"]) for m in messages):  # the common row: one call
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), list(encoded["offset_mapping"])
    protected = _content_spans(text, messages, pattern)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []

    def piece(start: int, end: int) -> None:
        if start >= end:
            return
        encoded = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
        ids.extend(encoded["input_ids"])
        offsets.extend((start + a, start + b) for a, b in encoded["offset_mapping"])

    position = 0
    for match in (pattern.finditer(text) if pattern is not None else ()):
        if any(a <= match.start() < b for a, b in protected):
            continue  # typed in a message: text
        piece(position, match.start())
        ids.append(ids_of[match.group()])
        offsets.append(match.span())
        position = match.end()
    piece(position, len(text))
    return ids, offsets


def tokenize_sample(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels that are ``IGNORE_INDEX`` except on
    trained assistant turns: the loss is on responses only.

    The text is tokenized once (:func:`encode_chat`), with offsets; a token is trained when it
    starts inside an assistant span (:func:`assistant_spans`). Nothing depends on how the
    tokenizer merges across the prompt/response boundary: with Qwen2's tokenizer ``assistant\\n``
    followed by a response starting with ``\\n`` gives one ``\\n\\n`` token, which starts in the
    prompt and is not trained; the response's tokens after it are.
    """
    text, spans = assistant_spans(tokenizer, messages)
    ids, offsets = encode_chat(tokenizer, text, messages)
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for position, (start, _end) in enumerate(offsets):
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
    tools = None
    for index in indices:
        index = int(index)
        messages = usable_messages(records[index], index, report)
        if messages is None:
            continue
        if any(m.get("tool_calls") for m in messages):
            tools = supports_tools(tokenizer) if tools is None else tools
            if not tools:
                report.note("tool_calls_unsupported", index, "an assistant turn with tool_calls; the model's chat "
                                                             "template renders none")
                continue
        try:
            ids, labels = tokenize_sample(tokenizer, messages)
        except BadRow as bad:
            report.note(bad.reason, index, bad.detail)
            continue
        except Exception as error:  # noqa: BLE001 - a template may raise anything on a row (jinja2's raise_exception)
            report.note("template_error", index, f"{type(error).__name__}: {str(error)[:200]}")
            continue
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
                        eval_max_sequences: int = 64, name: str | None = None) -> TrainingData:
    """Load, hold out the eval rows (or read ``eval_split``), shuffle (by ``seed``), tokenize
    with response-only labels, and pack. Raises :class:`DataError` if too few rows can train
    (naming the data set ``name``, by default ``source``)."""
    records = load_records(source, split=split)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows, eval_rows = split_rows(len(records), eval_fraction=0.0 if eval_split else eval_fraction, seed=seed)
    report = DataReport(rows=len(records), held_out=len(eval_rows), records=records if isinstance(records, Records) else None)
    if max_samples is not None:
        train_rows = train_rows[:max_samples]
    report.examined = len(train_rows)
    train = pack(tokenize_rows(tokenizer, records, train_rows, seq_len=seq_len, report=report), seq_len=seq_len, pad_id=pad_id)
    report.raise_if_unusable(name or source)
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

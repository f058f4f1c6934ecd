"""Rows of a data set as they are read: local files of the types people have (JSONL, JSON,
Parquet, Arrow, gzip'd), or a Hub data set; the row and error types the other modules share."""

from __future__ import annotations

import codecs
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence


IGNORE_INDEX = -100

#: The formats :func:`to_messages` reads, for messages.
FORMATS = ("messages (chat)", "conversations with from/value (ShareGPT)", "prompt/completion",
           "instruction/context/response (Dolly)", "instruction/input/output (Alpaca)")
#: The preference formats ``--objective dpo`` reads (training/data/preference.py, TRL's).
PREFERENCE_FORMATS = ("prompt/chosen/rejected (explicit prompt; each a string or chat messages)",
                      "chosen/rejected (implicit prompt: their shared beginning; conversations or strings)")


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

"""Preference pairs (``--objective dpo``): rows of TRL's preference formats as two chats that share
their prompt, tokenized and masked as supervised rows are, and packed as two segments of one
packed sequence.

The formats are TRL's (``trl/data_utils.py``, ``is_conversational``/``extract_prompt``):

- **explicit prompt**: ``prompt``, ``chosen``, ``rejected``; the prompt a string (a user turn) or a
  list of chat messages, each completion a string (an assistant turn) or a list of messages;
- **implicit prompt**: ``chosen`` and ``rejected`` alone, each the whole conversation (a list of
  messages, or a string); the prompt is their shared beginning: the leading messages they have in
  common, or for strings their common leading text (as TRL's ``extract_prompt``, which backs up over
  a space so that the completion keeps it).

A string is a chat turn here, as in the supervised ``prompt``/``completion`` rows: it goes through
the model's chat template, so the preference step trains the model as it is served. Each side goes
through the same roles, content parts, tool calls, chat template, control-token rules and
response-only labels as a supervised row (:mod:`.messages`, :mod:`.masking`): the tokens trained
are the completion's assistant turns, with the template's end of turn. A row that cannot train is
skipped and counted by cause, as a supervised row is (:data:`.report.SKIP_REASONS`).

A pair longer than ``seq_len`` is cut so that both sides fit one packed sequence (the longer side
loses its end first; counted as truncated); the two sides are adjacent segments of one sequence
(positions restart at each), never split across sequences, and no segment attends to another.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .masking import encode_chats
from .messages import _ROLES, _message, _text, for_template
from .report import DataReport, has_answer, read_row
from .packing import PackedDataset
from .records import PREFERENCE_FORMATS, BadRow, IGNORE_INDEX, UnknownFormat  # noqa: F401 - PREFERENCE_FORMATS: public here too


#: A side's segment in a packed sequence: ``2 * pair + CHOSEN`` or ``2 * pair + REJECTED``.
CHOSEN, REJECTED = 0, 1


def is_preference_row(record) -> bool:
    """Whether a row is of a preference format (it has ``chosen`` and ``rejected``)."""
    return isinstance(record, dict) and "chosen" in record and "rejected" in record


def _turns(value, where: str, role: str) -> list[dict]:
    """A prompt's or a completion's turns: chat messages as a supervised row's, or a string as one
    turn of ``role``."""
    if isinstance(value, list):
        return [_message(m, f"{where}[{i}]", _ROLES, ("role",), ("content",)) for i, m in enumerate(value)]
    return [{"role": role, "content": _text(value), "train": role == "assistant"}]


def _same(a: dict, b: dict) -> bool:
    return (a["role"], a["content"], a.get("tool_calls")) == (b["role"], b["content"], b.get("tool_calls"))


def _shared_text(chosen: str, rejected: str) -> int:
    """Where two strings part (TRL's ``extract_prompt``: a space just before it stays with the completions)."""
    index = 0
    for index in range(min(len(chosen), len(rejected)) + 1):
        if index == min(len(chosen), len(rejected)) or chosen[index] != rejected[index]:
            break
    if index and chosen[index - 1] == " ":
        index -= 1
    return index


def pair_messages(record) -> tuple[list[dict], list[dict]]:
    """The row as (chosen chat, rejected chat), the same prompt first in both; the completions'
    assistant turns are the ones trained (``train``). Raises :class:`UnknownFormat` for a row with no
    ``chosen``/``rejected`` and :class:`BadRow` for one that is broken."""
    if not isinstance(record, dict):
        raise BadRow("not_an_object", f"a JSON {type(record).__name__} where a row (an object) belongs")
    if not is_preference_row(record):
        raise UnknownFormat(f"a row with keys {sorted(record)}")
    chosen, rejected = record["chosen"], record["rejected"]
    if record.get("prompt") is not None:
        prompt = _turns(record["prompt"], "prompt", "user")
        chosen, rejected = _turns(chosen, "chosen", "assistant"), _turns(rejected, "rejected", "assistant")
    elif isinstance(chosen, list) and isinstance(rejected, list):
        chosen, rejected = _turns(chosen, "chosen", "assistant"), _turns(rejected, "rejected", "assistant")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and _same(chosen[shared], rejected[shared]):
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    elif isinstance(chosen, str) and isinstance(rejected, str):
        cut = _shared_text(chosen, rejected)
        prompt = [{"role": "user", "content": chosen[:cut], "train": False}]
        chosen, rejected = _turns(chosen[cut:], "chosen", "assistant"), _turns(rejected[cut:], "rejected", "assistant")
    else:
        raise BadRow("malformed_pair", f"chosen is a {type(chosen).__name__} and rejected a {type(rejected).__name__}; "
                                       "give both as strings or both as lists of messages (or add a prompt)")
    for message in prompt:
        message["train"] = False
    if [(m["role"], m["content"], m.get("tool_calls")) for m in chosen] == \
            [(m["role"], m["content"], m.get("tool_calls")) for m in rejected]:
        raise BadRow("identical_pair", "chosen and rejected are the same completion: nothing to prefer")
    sides = []
    for messages in (prompt + chosen, prompt + rejected):
        for message in messages:  # a greeting before the first user turn is context, as in a supervised row
            if message["role"] == "user":
                break
            message["train"] = False
        sides.append(messages)
    return sides[0], sides[1]


def usable_pair(record, index: int, report) -> tuple[list[dict], list[dict]] | None:
    """The row as (chosen, rejected) chats if both sides train something, else None (counted in
    ``report`` as :func:`.report.usable_messages` counts a supervised row)."""
    sides = read_row(record, index, report, pair_messages)
    if sides is None or not all(has_answer(chat, index, report, side) for side, chat in zip(("chosen", "rejected"), sides)):
        return None
    return sides


def _fit(chosen: int, rejected: int, seq_len: int) -> tuple[int, int]:
    """Lengths that fit both sides in ``seq_len`` tokens: the longer side is cut first, neither below
    half when both are long."""
    keep_chosen = min(chosen, max(seq_len // 2, seq_len - rejected))
    return keep_chosen, min(rejected, seq_len - keep_chosen)


def tokenize_pairs(tokenizer, records: Sequence[dict], indices: Iterable[int], *, seq_len: int,
                   report) -> list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]]:
    """Tokenized (chosen, rejected) samples of the rows ``indices`` that can train, counting the others."""
    pairs = []
    for index in indices:
        index = int(index)
        sides = usable_pair(records[index], index, report)
        encoded = encode_chats(tokenizer, records[index], index, list(sides), report) if sides is not None else None
        if encoded is None:
            continue
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = encoded
        keep = _fit(len(chosen_ids), len(rejected_ids), seq_len)
        if keep != (len(chosen_ids), len(rejected_ids)):
            report.note("truncated", index)
            trimmed = [(ids[:n], labels[:n]) for (ids, labels), n in zip(encoded, keep)]
            if any(all(label == IGNORE_INDEX for label in labels[1:]) for _, labels in trimmed):
                report.note("nothing_trained", index)
                continue
            encoded = trimmed
        report.used += 1
        pairs.append((encoded[0], encoded[1]))
    return pairs


def pack_pairs(pairs: Sequence[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]], *, seq_len: int,
               pad_id: int) -> PackedDataset:
    """Greedy packing of whole pairs in order, each as two adjacent segments (chosen, rejected) whose
    positions restart at 0; ``slots`` names each token's segment (``2 * pair + side``, -1 on padding).
    Every segment's first label is ignored, so no position learns across a boundary."""
    ids_rows, label_rows, position_rows, real_rows, slot_rows = [], [], [], [], []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    slots: list[int] = []

    def flush():
        if not ids:
            return
        pad = seq_len - len(ids)
        ids_rows.append(ids + [pad_id] * pad)
        label_rows.append(labels + [IGNORE_INDEX] * pad)
        position_rows.append(positions + list(range(pad)))
        real_rows.append([1] * len(ids) + [0] * pad)
        slot_rows.append(slots + [-1] * pad)

    for number, pair in enumerate(pairs):
        if len(ids) + len(pair[0][0]) + len(pair[1][0]) > seq_len:
            flush()
            ids, labels, positions, slots = [], [], [], []
        for side, (side_ids, side_labels) in enumerate(pair):
            ids = ids + list(side_ids)
            labels = labels + [IGNORE_INDEX] + list(side_labels[1:])
            positions = positions + list(range(len(side_ids)))
            slots = slots + [2 * number + side] * len(side_ids)
    flush()
    as_array = lambda rows: np.asarray(rows, dtype=np.int64).reshape(-1, seq_len)  # noqa: E731
    return PackedDataset(as_array(ids_rows), as_array(label_rows), as_array(position_rows), as_array(real_rows),
                         slots=as_array(slot_rows))


def pair_prompts(records: Sequence[dict], rows: Iterable[int], count: int) -> list[dict]:
    """The first ``count`` usable held-out pairs as prompts to sample: the shared prompt
    (``messages``) and the chosen completion's text (``reference``)."""
    found: list[dict] = []
    for index in rows:
        if len(found) >= count:
            break
        sides = usable_pair(records[int(index)], int(index), DataReport())
        if sides is None:
            continue
        chosen, _rejected = sides
        first = next(i for i, message in enumerate(chosen) if message["train"])
        if first == 0:
            continue
        answer = "".join(m["content"] for m in chosen[first:] if m["role"] == "assistant")
        found.append({"row": int(index), "messages": for_template(chosen[:first]), "reference": answer})
    return found

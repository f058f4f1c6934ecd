"""What happened to each row: used, skipped or truncated, counted by cause with the first
example of each, and the check that stops a data set with too few usable rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from .messages import to_messages, trainable
from .records import PREFERENCE_FORMATS, BadRow, DataError, FORMATS, Records, UnknownFormat, Unreadable


#: Why a row did not train as it was, in the order they are reported.
SKIP_REASONS = {
    "unreadable": "lines that are not a JSON row (not UTF-8, not JSON: a truncated line)",
    "not_an_object": "rows that are not JSON objects",
    "unknown_format": "rows of no known format",
    "malformed_message": "rows with a message that is not an object with a role",
    "unknown_role": "rows with a role no format defines",
    "non_text_content": "rows with content parts that are not text (images, audio)",
    "malformed_tool_call": "rows with a tool call that is not a function with JSON arguments",
    "malformed_tools": "rows whose tools are not a list of tool schemas",
    "tool_calls_unsupported": "rows with tool calls the model's chat template cannot render",
    "tools_unsupported": "rows with tools the model's chat template does not render (the model would learn calls to unseen schemas)",
    "template_error": "rows the chat template refuses (e.g. roles that do not alternate)",
    "no_assistant_turn": "rows with no assistant turn to train (none, weight 0, or only before the first user turn)",
    "empty_response": "rows with an empty response",
    "nothing_trained": "rows whose response lies wholly beyond seq_len",
    "malformed_pair": "preference rows whose chosen and rejected are not both strings or both messages",
    "identical_pair": "preference rows whose chosen and rejected completions are the same",
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
    #: Whether the rows are read as preference pairs (``--objective dpo``), for the error messages.
    preference: bool = False

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
            if self.preference:
                raise DataError(
                    f"dataset={source!r}: none of its {self.rows} rows is a preference pair (first row's keys: "
                    f"{self.unknown_keys}); --objective dpo reads rows of: {'; '.join(PREFERENCE_FORMATS)} "
                    "(supervised rows train with --objective sft)")
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


def read_row(record, index: int, report: DataReport, reader=None):
    """``reader(record)`` (a row's chat: :func:`to_messages` by default), or None for a row that is not
    JSON, of no known format or broken (counted in ``report`` by cause)."""
    if isinstance(record, Unreadable):
        report.note("unreadable", index, record.detail)
        return None
    try:
        return (reader or to_messages)(record)
    except UnknownFormat:
        if report.unknown_keys is None:
            report.unknown_keys = sorted(record)
        report.note("unknown_format", index, f"keys {sorted(record)}")
        return None
    except BadRow as bad:
        report.note(bad.reason, index, bad.detail)
        return None


def has_answer(messages: list[dict], index: int, report: DataReport, side: str | None = None) -> bool:
    """Whether a chat has a trained assistant turn with text, else counted in ``report`` (``side``: which
    side of a preference pair, for the detail)."""
    answers = [m for m in messages if m["role"] == "assistant" and m["train"]]
    if not answers:
        report.note("no_assistant_turn", index, f"{side} has no assistant turn after the prompt" if side else None)
        return False
    if not any(trainable(m) for m in answers):
        report.note("empty_response", index, f"{side} is empty" if side else None)
        return False
    return True


def usable_messages(record, index: int, report: DataReport) -> list[dict] | None:
    """The row as a chat if it can train something, else None (counted in ``report``)."""
    messages = read_row(record, index, report)
    return messages if messages is not None and has_answer(messages, index, report) else None


def check_records(records: Sequence[dict], source: str) -> DataReport:
    """Read every row as a chat and raise :class:`DataError` if too few can train."""
    report = DataReport(rows=len(records), records=records if isinstance(records, Records) else None)
    for index, record in enumerate(records):
        if usable_messages(record, index, report) is not None:
            report.used += 1
    report.raise_if_unusable(source)
    return report

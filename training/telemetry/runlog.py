"""A run's course in its folder: ``<storage-path>/<run-name>/metrics.jsonl``, one JSON object
per step, ``run.json`` (what the run trains), and ``curves.png`` drawn from them
(:mod:`training.telemetry.curves`), all written by rank 0 through the same storage layer as the
checkpoints (a local folder or S3).

A resumed run continues the same file: it keeps the steps up to the checkpoint it resumes
from and replaces the ones after it, so no step is missing or written twice across a
crash, a resume or a preemption. The file is written whole (S3 has no append): in a
background thread after each step, so the loop never waits on S3, and synchronously
before each checkpoint is reported, so the checkpoint a run resumes from always has its
steps in the file.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from typing import Any, Callable

from ..storage.files import read_text, write_bytes, write_text

METRICS_FILE = "metrics.jsonl"
#: Greedy completions of held-out prompts at each evaluation (training/evaluation/samples.py), one per line.
SAMPLES_FILE = "samples.jsonl"
RUN_FILE = "run.json"
CURVES_FILE = "curves.png"


def clean(value: Any) -> Any:
    """A value as strict JSON has it: non-finite floats become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def parse_lines(text: str | None) -> list[dict]:
    """The step records of a metrics.jsonl text (blank lines ignored)."""
    return [json.loads(line) for line in (text or "").splitlines() if line.strip()]


class RunLog:
    """Rank 0's record of a run's steps, kept in storage under ``run_uri``.

    :param run_uri: the run's folder (``<storage-path>/<run-name>``).
    :param resume_step: the step of the checkpoint this invocation starts from (0: none);
        records after it are dropped, since this invocation trains those steps again.
    :param about: what the run trains (run name, model, data set), written to run.json and
        used as the picture's title.
    :param draw: draws the picture from the records (PNG bytes), or None for no picture.
    """

    def __init__(self, run_uri: str, *, resume_step: int, about: dict,
                 draw: Callable[[list[dict], dict], bytes | None] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.run_uri = run_uri.rstrip("/")
        self.about = about
        self.draw = draw
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        earlier = parse_lines(read_text(self.uri(METRICS_FILE)))
        self.records: list[dict] = [r for r in earlier if r["step"] <= resume_step]
        self.samples: list[dict] = [r for r in parse_lines(read_text(self.uri(SAMPLES_FILE))) if r["step"] <= resume_step]
        self._samples_changed = False
        write_text(self.uri(RUN_FILE), json.dumps(about, indent=2, sort_keys=True))
        self._lock = threading.Condition()
        self._wanted = 0  # generation of the newest records
        self._written = 0  # generation last written
        self._picture_wanted = False
        self._closed = False
        self._failed = False
        self._io = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="run-log-writer", daemon=True)
        self._writer.start()

    def update_about(self, values: dict) -> None:
        """Rewrite run.json with ``values`` (a later stop time: an extended Capacity Block's)."""
        self.about = {**self.about, **values}
        write_text(self.uri(RUN_FILE), json.dumps(self.about, indent=2, sort_keys=True))

    def uri(self, name: str) -> str:
        """A file in the run's folder."""
        return f"{self.run_uri}/{name}"

    def record(self, entry: dict) -> None:
        """Add one step's record (written soon, in the background)."""
        with self._lock:
            self.records = [r for r in self.records if r["step"] < entry["step"]]
            self.records.append({key: clean(value) for key, value in entry.items()})
            self._wanted += 1
            self._lock.notify_all()

    def add_samples(self, step: int, entries: list[dict]) -> None:
        """The samples of the evaluation at ``step`` (replacing any of that step or later: trained
        again after a restart), written with the metrics."""
        with self._lock:
            self.samples = [r for r in self.samples if r["step"] < step] + [{"step": step, **entry} for entry in entries]
            self._samples_changed = True
            self._wanted += 1
            self._lock.notify_all()

    def flush(self, *, picture: bool = False, wait: bool = True) -> None:
        """Write metrics.jsonl now, from this thread; with ``picture`` also draw curves.png,
        now (``wait``) or in the background."""
        self._write_latest()
        if picture and wait:
            with self._io:
                with self._lock:
                    snapshot = list(self.records)
                self._draw(snapshot)
        elif picture:
            with self._lock:
                self._picture_wanted = True
                self._lock.notify_all()

    def close(self) -> None:
        """Stop the background writer (what it had not written is written by :meth:`flush`)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._writer.join(timeout=60)

    def _write_latest(self) -> None:
        # One writer at a time, each writing the newest records: the last write is the newest.
        with self._io:
            with self._lock:
                snapshot, generation = list(self.records), self._wanted
                samples, self._samples_changed = (list(self.samples) if self._samples_changed else None), False
            self._write(snapshot)
            if samples is not None:
                self._write_samples(samples)
            with self._lock:
                self._written = max(self._written, generation)

    def _write(self, records: list[dict]) -> None:
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
        try:
            write_text(self.uri(METRICS_FILE), text)
        except Exception as error:  # noqa: BLE001 - the log is a view of the run, not part of it
            self._warn(f"writing {self.uri(METRICS_FILE)} failed ({type(error).__name__}: {error})")

    def _write_samples(self, samples: list[dict]) -> None:
        try:
            write_text(self.uri(SAMPLES_FILE), "".join(json.dumps(r, sort_keys=True) + "\n" for r in samples))
        except Exception as error:  # noqa: BLE001 - same
            self._warn(f"writing {self.uri(SAMPLES_FILE)} failed ({type(error).__name__}: {error})")

    def _draw(self, records: list[dict]) -> None:
        if self.draw is None or not records:
            return
        try:
            png = self.draw(records, self.about)
            if png is not None:
                write_bytes(self.uri(CURVES_FILE), png)
        except Exception as error:  # noqa: BLE001 - same: a picture never stops training
            self._warn(f"drawing {self.uri(CURVES_FILE)} failed ({type(error).__name__}: {error})")

    def _warn(self, message: str) -> None:
        if not self._failed:
            self.log(f"[train] {message}; training goes on (further failures are not logged)")
        self._failed = True

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while self._written >= self._wanted and not self._picture_wanted and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                picture, self._picture_wanted = self._picture_wanted, False
            self._write_latest()
            if picture:
                self.flush(picture=True, wait=True)

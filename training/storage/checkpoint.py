"""Sharded checkpoints with ``torch.distributed.checkpoint``: model and optimizer shards
of every rank (under LoRA the adapters' alone: training/modeling/lora.py), plus the scheduler, the step (which is the data position, see
:class:`training.data.DataOrder`) and every rank's RNG state.

Each worker writes into its own folder on the node's fast disk (``RAY_TRAIN_EKS_SCRATCH``: an
emptyDir on the GPU node's NVMe in the Ray pods); Ray Train merges the folders of all workers
into one checkpoint directory in storage (``ray.train.report``), and hands it back on restore
(``ray.train.get_checkpoint``), where each rank reads its own shards in place
(:func:`load_checkpoint`, training/storage/checkpoint_reader.py).

Off the critical path (:class:`CheckpointWriter`, asynchronous): the state is staged to CPU
memory (the only part the loop waits for) and written by ``dcp.async_save``'s thread while
training goes on (torchtitan's ``async_mode``); once every rank's files are written, the
checkpoint is reported with ``checkpoint_upload_mode=ASYNC`` and Ray Train uploads it in its
own thread (``ray/train/v2/api/report_config.py``), deleting the local folder after. Ray
registers a checkpoint only when every rank's upload finished, so a crash during a save or an
upload leaves the last complete checkpoint the one a run resumes from.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..modeling.lora import check_loaded, checkpoint_state, state_dict_options
from .files import SCRATCH_ENV

TRAIN_STATE = "train_state.json"


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def save_checkpoint(directory: str | Path, *, model, optimizer, scheduler, train_state: dict[str, Any], rank: int) -> None:
    """Write this rank's part of a checkpoint into ``directory`` (collective: every rank calls it)."""
    directory = Path(directory)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=state_dict_options(model))
    model_state = checkpoint_state(model, model_state)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory))
    _save_small_files(directory, scheduler=scheduler, train_state=train_state, rank=rank)


def _save_small_files(directory: Path, *, scheduler, train_state: dict[str, Any], rank: int) -> None:
    """This rank's RNG state, and rank 0's train state with the scheduler."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(rng, directory / _rng_file(rank))
    if rank == 0:
        state = {**train_state, "scheduler": scheduler.state_dict()}
        (directory / TRAIN_STATE).write_text(json.dumps(state, indent=2, sort_keys=True))


def load_checkpoint(checkpoint, *, model, optimizer, scheduler, rank: int) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (collective) and return its train state.
    ``checkpoint``: Ray Train's ``Checkpoint``, a URI or a folder, read where it is stored, this rank's
    shards only (training/storage/checkpoint_reader.py)."""
    import io

    from .checkpoint_reader import CheckpointReader, read_small_file

    model_state, optimizer_state = get_state_dict(model, optimizer, options=state_dict_options(model))
    model_state = checkpoint_state(model, model_state)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, storage_reader=CheckpointReader(checkpoint))
    loaded = set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                            options=state_dict_options(model, loading=True))
    check_loaded(model, loaded)
    train_state = json.loads(read_small_file(checkpoint, TRAIN_STATE))
    scheduler.load_state_dict(train_state.pop("scheduler"))
    rng_bytes = read_small_file(checkpoint, _rng_file(rank))
    if rng_bytes is not None:  # absent for a rank the saving world lacked (an elastic run grew): its fresh streams then
        rng = torch.load(io.BytesIO(rng_bytes), weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return train_state


def scratch_directory() -> Path:
    """Where this node stages checkpoints (``RAY_TRAIN_EKS_SCRATCH``, else the system's temp folder)."""
    return Path(os.environ.get(SCRATCH_ENV) or tempfile.gettempdir()) / "ray-train-eks-checkpoints"


#: A staged checkpoint folder untouched this long belongs to no live writer (another run's).
STALE_SCRATCH_S = 24 * 3600


def sweep_scratch(*, run_name: str, rank: int, now: float | None = None) -> list[Path]:
    """Delete the checkpoint folders a failed upload left on this node's scratch disk (Ray Train
    deletes a folder only after its upload): this run's for this rank (a new writer has none in
    flight; several ranks share a node's disk, so only its own), and any untouched for
    :data:`STALE_SCRATCH_S`. Returns what went."""
    root = scratch_directory()
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    swept = []
    for folder in root.iterdir():
        mine = folder.name.startswith(f"{run_name}-") and folder.name.endswith(f"-rank{rank}")
        try:
            stale = now - folder.stat().st_mtime > STALE_SCRATCH_S
        except FileNotFoundError:
            continue
        if folder.is_dir() and (mine or stale):
            shutil.rmtree(folder, ignore_errors=True)
            swept.append(folder)
    if swept:
        print(f"[checkpoint] swept {len(swept)} folder(s) a failed upload left on {root}", flush=True)
    return swept


@dataclass
class PendingCheckpoint:
    """A checkpoint being written: its folder, the metrics it is reported with, the write."""

    directory: Path
    metrics: dict
    future: Any  # concurrent.futures.Future of dcp.async_save
    #: Seconds the loop waited for the staging (or the whole synchronous write); seconds until
    #: this rank's files were written.
    blocked_s: float = 0.0
    written_s: float | None = None

    def describe(self) -> str:
        """The timings, for the job log."""
        written = f", written in {self.written_s:.1f} s" if self.written_s is not None else ""
        return f"the loop waited {self.blocked_s:.1f} s{written}"


class CheckpointWriter:
    """Writes one rank's checkpoints into the node's scratch folder, asynchronously (the loop waits
    for the staging to CPU memory only) or synchronously.

    :param asynchronous: ``dcp.async_save`` in a thread, else ``dcp.save``.
    :param rank: this worker's rank (names its folder: several ranks share a node's disk).
    """

    def __init__(self, *, asynchronous: bool, rank: int, run_name: str, invocation_id: str) -> None:
        self.asynchronous, self.rank = asynchronous, rank
        self.prefix = f"{run_name}-{invocation_id}"
        self.pending: PendingCheckpoint | None = None
        # The background writes plan over a group of their own that runs on the CPU (torchtitan
        # does the same): the default group may be NCCL, busy with training. Whether every rank
        # has written is asked over another: dcp.async_save's thread runs its own collectives
        # (the plan, the metadata) on the first, and two threads' collectives on one group
        # interleave differently on each rank and hang.
        self.group = self.poll_group = None
        self.swept = sweep_scratch(run_name=run_name, rank=rank)
        if asynchronous:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
            self.poll_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))

    @property
    def mode(self) -> str:
        return "asynchronous" if self.asynchronous else "synchronous"

    def directory(self, step: int) -> Path:
        """This rank's folder for the checkpoint of ``step`` (emptied first)."""
        directory = scratch_directory() / f"{self.prefix}-step{step}-rank{self.rank}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        return directory

    def start(self, *, model, optimizer, scheduler, train_state: dict[str, Any], metrics: dict) -> PendingCheckpoint:
        """Begin a checkpoint of the current state (collective); returns when it is staged."""
        started = time.monotonic()
        directory = self.directory(train_state["step"])
        if self.asynchronous:
            model_state, optimizer_state = get_state_dict(model, optimizer, options=state_dict_options(model))
            model_state = checkpoint_state(model, model_state)
            _save_small_files(directory, scheduler=scheduler, train_state=train_state, rank=self.rank)
            future = dcp.async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory),
                                    process_group=self.group)
        else:
            save_checkpoint(directory, model=model, optimizer=optimizer, scheduler=scheduler, train_state=train_state,
                            rank=self.rank)
            future = Future()
            future.set_result(None)
        pending = PendingCheckpoint(directory, metrics, future, blocked_s=time.monotonic() - started)
        future.add_done_callback(lambda _: setattr(pending, "written_s", time.monotonic() - started))
        self.pending = pending
        return pending

    def written_everywhere(self) -> bool:
        """Whether every rank has written its part of the pending checkpoint (collective: a MIN
        of one number over the gloo group, so all ranks decide alike)."""
        if self.pending is None:
            return False
        done = torch.tensor([1.0 if self.pending.future.done() else 0.0])
        if self.poll_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.poll_group)
        return bool(done.item())

    def take(self) -> PendingCheckpoint | None:
        """The pending checkpoint once written (blocking for it, raising what the write raised),
        which the caller now reports; none is pending after."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.future.result()
        return pending

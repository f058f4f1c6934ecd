"""Sharded checkpoints with ``torch.distributed.checkpoint``: model and optimizer shards
of every rank, plus the scheduler, the step (which is the data position, see
:class:`training.data.DataOrder`) and every rank's RNG state.

Each worker writes into its own local folder; Ray Train merges the folders of all workers
into one checkpoint directory in storage (``ray.train.report``), and hands the merged
directory back on restore (``ray.train.get_checkpoint``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

TRAIN_STATE = "train_state.json"


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def save_checkpoint(directory: str | Path, *, model, optimizer, scheduler, train_state: dict[str, Any], rank: int) -> None:
    """Write this rank's part of a checkpoint into ``directory`` (collective: every rank calls it)."""
    directory = Path(directory)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory))
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


def load_checkpoint(directory: str | Path, *, model, optimizer, scheduler, rank: int) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (collective) and return its train state."""
    directory = Path(directory)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    train_state = json.loads((directory / TRAIN_STATE).read_text())
    scheduler.load_state_dict(train_state.pop("scheduler"))
    rng_path = directory / _rng_file(rank)
    if rng_path.exists():  # absent when the world size changed: fresh RNG streams then
        rng = torch.load(rng_path, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return train_state

"""The consolidated Hugging Face model at the end of a run: safetensors, config and
tokenizer in ``<storage>/<run>/final/``, loadable with ``AutoModelForCausalLM.from_pretrained``."""

from __future__ import annotations

import tempfile

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from training.storage import upload_directory


def run_uri(storage_path: str, run_name: str) -> str:
    """The run's folder in storage (Ray Train's ``storage_path/name``)."""
    return f"{storage_path.rstrip('/')}/{run_name}"


def final_model_uri(storage_path: str, run_name: str) -> str:
    """Where the final model of a run goes."""
    return f"{run_uri(storage_path, run_name)}/final"


def stop_notice_uri(storage_path: str, run_name: str) -> str:
    """Where a run that stopped on purpose (non-finite loss) leaves its reason."""
    return f"{run_uri(storage_path, run_name)}/stopped.json"


def export_final_model(*, model, tokenizer, rank: int, uri: str, dtype: torch.dtype) -> str | None:
    """Gather the full state dict (collective: every rank calls it) and, on rank 0, save
    and upload the model in ``dtype`` with its tokenizer. Returns ``uri`` on rank 0."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    state = {key: value.to(dtype) if value.is_floating_point() else value for key, value in state.items()}
    with tempfile.TemporaryDirectory() as local:
        config = model.config
        config.use_cache = True
        config.dtype = dtype
        model.save_pretrained(local, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(local)
        upload_directory(local, uri)
    return uri

"""The consolidated Hugging Face model at the end of a run: safetensors, config and
tokenizer in ``<storage>/<run>/final/``, loadable with ``AutoModelForCausalLM.from_pretrained``."""

from __future__ import annotations

import copy
import tempfile

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..storage.files import export_scratch, upload_directory


def run_uri(storage_path: str, run_name: str) -> str:
    """The run's folder in storage (Ray Train's ``storage_path/name``)."""
    return f"{storage_path.rstrip('/')}/{run_name}"


def final_model_uri(storage_path: str, run_name: str) -> str:
    """Where the final model of a run goes."""
    return f"{run_uri(storage_path, run_name)}/final"


def stop_notice_uri(storage_path: str, run_name: str) -> str:
    """Where a run that stopped on purpose (non-finite loss) leaves its reason."""
    return f"{run_uri(storage_path, run_name)}/stopped.json"


def stopping_generation_config(generation, tokenizer):
    """A copy of ``generation`` whose ``eos_token_id`` lists the base's end token(s), the
    tokenizer's EOS and the chat template's end-of-turn token (training/data/masking.py
    ``end_of_turn_token``), and whose ``pad_token_id`` is set when the tokenizer has one."""
    from ..data.masking import end_of_turn_token

    generation = copy.deepcopy(generation)
    base = generation.eos_token_id
    ids = list(base) if isinstance(base, (list, tuple)) else [] if base is None else [base]
    turn = end_of_turn_token(tokenizer)
    for token in (tokenizer.eos_token, turn):
        token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    generation.eos_token_id = ids[0] if len(ids) == 1 else ids or None
    if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    return generation


def export_final_model(*, model, tokenizer, rank: int, uri: str, dtype: torch.dtype) -> str | None:
    """Gather the full state dict of ``model`` (a :class:`training.modeling.model.CausalLMForSFT`;
    collective: every rank calls it) and, on rank 0, save and upload the Hugging Face model
    in ``dtype`` with its tokenizer. Returns ``uri`` on rank 0.

    Two things ``save_pretrained`` gets wrong for a sharded fp32 training model, fixed here:
    it writes the parameters' dtype (fp32) into ``config.json`` whatever the tensors are,
    and with an explicit state dict it stores a tied output head a second time. And the base
    model's ``generation_config`` stops at the base's end of text (Qwen2.5 base:
    ``<|endoftext|>``), while training taught turns that end in the chat template's end-of-turn
    token: :func:`stopping_generation_config` adds it, so ``generate`` and inference servers stop
    where the answer ends.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    lm = model.lm
    state = {key.removeprefix("lm."): value.to(dtype) if value.is_floating_point() else value for key, value in state.items()}
    if getattr(lm.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    lm.generation_config = stopping_generation_config(lm.generation_config, tokenizer)
    with tempfile.TemporaryDirectory(dir=export_scratch()) as local:
        lm.save_pretrained(local, state_dict=state, safe_serialization=True)
        config = copy.deepcopy(lm.config)
        config.use_cache = True
        config.dtype = str(dtype).removeprefix("torch.")
        config.save_pretrained(local)  # after the model: it overwrites config.json with the real dtype
        tokenizer.save_pretrained(local)
        upload_directory(local, uri)
    return uri

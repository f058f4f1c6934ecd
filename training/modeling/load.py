"""Loading a model into FSDP2 without ever holding it whole on a GPU, with one host copy per run.

Every rank builds the model on the meta device (no memory), shards it (``fully_shard``) and
allocates only its own shards (``to_empty``). Rank 0 alone reads the checkpoint, with
``from_pretrained`` on the CPU (so transformers' key renames and dtype handling apply), and
torch sends it to the other ranks one tensor at a time
(``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``; torch 2.13
``_state_dict_utils._broadcast_state_dict``: "Broadcast every tensor to avoid OOM"), each rank
keeping its shard of each. A rank's peak during the load is its shards plus one full tensor
(the largest: the embedding or the head), not the model; the host holds the fp32 model once,
in rank 0's process, and only until its tensors are sent.

Buffers that are not in a checkpoint (rotary ``inv_freq``, Gemma's embedding scale: transformers
computes them at construction, which the meta device skips) are computed by rank 0's real
model and broadcast too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from .attention import hf_attention
from .lora import LoraSettings, add_adapters
from .loss import DEFAULT_CHUNK_TOKENS
from .model import CausalLMForSFT, for_training
from .parallel import apply_fsdp


def load_sharded(model_dir: str, *, mesh, device: torch.device, rank: int, attn_implementation: str,
                 activation_checkpointing: bool, mixed_precision: str,
                 loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS, lora: LoraSettings | None = None,
                 seed: int = 0, revision: str | None = None) -> CausalLMForSFT:
    """The model of ``model_dir`` for training, sharded over ``mesh`` (collective: every rank of the
    default process group calls it). See the module's docstring for what each rank holds.

    ``lora``: the base frozen in the compute dtype (bf16 with ``mixed_precision`` bf16) with fp32
    adapters, which rank 0 initialises (from ``seed``) and sends with the base's tensors.
    ``revision``: a Hub model's commit (None: a local folder, or the main branch)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    name = hf_attention(attn_implementation, device)
    hub = {"revision": revision} if revision else {}  # a Hub model's pinned commit
    config = AutoConfig.from_pretrained(model_dir, **hub)
    dtype = torch.bfloat16 if lora is not None and mixed_precision == "bf16" else torch.float32
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=name)
    try:
        lm.generation_config = GenerationConfig.from_pretrained(model_dir, **hub)
    except OSError:  # no generation_config.json: the one from_config made stands
        pass
    model = apply_fsdp(for_training(lm, activation_checkpointing=activation_checkpointing,
                                    loss_chunk_tokens=loss_chunk_tokens, lora=lora, seed=seed),
                       mesh=mesh, mixed_precision=mixed_precision)
    model.to_empty(device=device)
    full, computed = {}, {}
    if rank == 0:
        whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=name, **hub)
        if lora is not None:
            whole = add_adapters(whole, lora, seed=seed)
        full = {f"lm.{key}": value for key, value in whole.state_dict().items()}
        computed = dict(_computed_buffers(whole, prefix="lm."))
        del whole
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    with torch.no_grad():
        for key, buffer in _computed_buffers(model):
            if rank == 0:
                buffer.copy_(computed[key])
            dist.broadcast(buffer, src=0)
    return model


def _computed_buffers(module: torch.nn.Module, prefix: str = ""):
    """``(name, buffer)`` of the buffers a checkpoint does not hold (registered ``persistent=False``)."""
    for module_name, child in module.named_modules():
        for buffer_name in sorted(getattr(child, "_non_persistent_buffers_set", ())):  # a set: the same order on every rank
            buffer = child._buffers.get(buffer_name)
            if buffer is not None:
                yield f"{prefix}{module_name}.{buffer_name}" if module_name else f"{prefix}{buffer_name}", buffer

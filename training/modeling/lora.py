"""LoRA fine-tuning (``--peft lora``): PEFT's LoRA adapters on a frozen base, sharded with FSDP2
as a full fine-tune is.

- **The base** is frozen and held in the compute dtype (bf16 on GPUs): no fp32 copy, no gradient,
  no optimizer state. The adapters are fp32 master weights (PEFT's ``get_peft_model`` casts bf16
  adapters to fp32, ``autocast_adapter_dtype=True``) trained by AdamW. One decoder layer is one
  FSDP2 unit with both: FSDP2 asks a uniform original dtype of the *trainable* parameters only
  (torch 2.13 ``_fsdp_param_group.py`` ``_init_mp_dtypes``), and with ``param_dtype=bf16`` both
  are all-gathered in bf16; only the adapters' gradients are reduce-scattered (in fp32).
- **Checkpoints** hold the adapters and their optimizer state (``StateDictOptions(
  ignore_frozen_params=True)``): the base is the model id's, loaded again at a resume.
- **The export** is PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``) in the
  run's ``final/``, which PEFT, transformers (with peft installed) and inference servers (vLLM's
  ``--enable-lora``) load on the base; ``--merge-lora`` adds the base with the adapters merged in
  (PEFT's ``merge_and_unload``) as a Hugging Face model in ``final-merged/``.

PEFT is imported here only: a full fine-tune never needs it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..config import ALL_LINEAR, lora_target_list

#: The adapter's name inside the PEFT model (PEFT's default).
ADAPTER = "default"
#: Where ``--merge-lora`` writes the merged model, next to ``final/``.
MERGED_FOLDER = "final-merged"


@dataclass(frozen=True)
class LoraSettings:
    """``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-target-modules``."""

    rank: int
    alpha: float
    dropout: float
    targets: str = ALL_LINEAR

    @classmethod
    def of(cls, config) -> "LoraSettings | None":
        """From a TrainConfig; None for a full fine-tune."""
        if getattr(config, "peft", "none") != "lora":
            return None
        return cls(rank=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout,
                   targets=config.lora_target_modules)

    @property
    def target_list(self) -> list[str] | str:
        """PEFT's ``target_modules``: the shorthand, or the names."""
        return lora_target_list(self.targets)

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=self.target_list,
                          bias="none", task_type="CAUSAL_LM")


def add_adapters(lm: torch.nn.Module, settings: LoraSettings, *, seed: int) -> torch.nn.Module:
    """``lm`` with PEFT's LoRA adapters (a ``PeftModelForCausalLM``); the base frozen, the adapters
    fp32. On the meta device the adapters are shapes only (filled by the load); on a real device
    they are initialised as PEFT does (A Kaiming-uniform, B zero), from ``seed`` without touching
    the caller's random streams."""
    import contextlib

    from peft import get_peft_model

    # A meta model's adapters are made on the meta device too (else PEFT makes them on the CPU and
    # moves them: memory for nothing, and no move of a fake tensor to meta, as the plan's test runs it).
    meta = any(p.is_meta for p in lm.parameters())
    try:
        with torch.random.fork_rng(devices=[]), (torch.device("meta") if meta else contextlib.nullcontext()):
            torch.manual_seed(seed)
            return get_peft_model(lm, settings.peft_config(), autocast_adapter_dtype=True)
    except ValueError as error:  # PEFT: "Target modules {...} not found in the base model"
        names = sorted({name.rsplit(".", 1)[-1] for name, module in lm.named_modules() if isinstance(module, torch.nn.Linear)})
        raise ValueError(f"lora_target_modules={settings.targets!r}: {error}; this model's linear layers are "
                         f"{', '.join(names)} (or give {ALL_LINEAR})") from error


def is_lora(model) -> bool:
    """Whether ``model`` (a :class:`training.modeling.model.CausalLMForSFT`) trains adapters."""
    return hasattr(getattr(model, "lm", None), "peft_config")


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter of a full fine-tune, the adapters of LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def state_dict_options(model, *, loading: bool = False):
    """``StateDictOptions`` for checkpoints of ``model``: the adapters alone under LoRA (the frozen
    base is the model id's); loading them leaves the base as the load filled it (``strict`` off,
    the keys checked by :func:`check_loaded` instead)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if not is_lora(model):
        return StateDictOptions()
    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


def checkpoint_state(model, model_state: dict) -> dict:
    """The model's part of a checkpoint from ``get_state_dict``: all of it for a full fine-tune, the
    adapters alone under LoRA. ``ignore_frozen_params`` drops the frozen parameters by
    ``named_parameters``, which names a tied tensor once: a tied head's second name
    (``lm_head.weight``, the frozen embedding) would stay in, the vocabulary's worth of bytes."""
    if not is_lora(model):
        return model_state
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {key: value for key, value in model_state.items() if key in trainable}


def check_loaded(model, result) -> None:
    """After ``set_state_dict`` of a LoRA model's adapters: nothing unexpected, and nothing missing
    but frozen parameters (a checkpoint of another adapter layout fails here, not silently)."""
    if result is None or not is_lora(model):
        return
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    missing = [key for key in result.missing_keys if key not in frozen]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"checkpoint does not match this model's adapters: missing {missing[:5]}, "
                           f"unexpected {list(result.unexpected_keys)[:5]}; resume with the LoRA options it was saved with")


def export_adapter(model, *, tokenizer, generation_config, rank: int, local: str, base_name: str) -> None:
    """Gather the adapters (collective) and, on rank 0, write them in PEFT's format into ``local``
    with the tokenizer and the generation config that stops at the end of a turn."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=True))
    if rank != 0:
        return
    peft_model = model.lm
    peft_model.peft_config[ADAPTER].base_model_name_or_path = base_name
    state = {key.removeprefix("lm."): value for key, value in state.items()}
    peft_model.save_pretrained(local, state_dict=state, save_embedding_layers=False, safe_serialization=True)
    tokenizer.save_pretrained(local)
    generation_config.save_pretrained(local)


def export_merged(*, base_dir: str, adapter_dir: str, local: str, tokenizer, generation_config, dtype: torch.dtype) -> None:
    """The base of ``base_dir`` with the adapter of ``adapter_dir`` merged in (PEFT's
    ``merge_and_unload``), saved as a plain Hugging Face model in ``dtype`` into ``local``: on the
    host, one process (rank 0), after the training's memory is no longer needed."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged = merged.to(dtype)
    merged.generation_config = copy.deepcopy(generation_config)
    merged.config.use_cache = True
    merged.save_pretrained(local, safe_serialization=True)
    tokenizer.save_pretrained(local)



def export_lora(model, *, tokenizer, rank: int, uri: str, merged_uri: str | None, base_dir: str, base_name: str,
                dtype: torch.dtype) -> None:
    """The run's LoRA export (collective: the adapters are gathered from every rank): the adapter
    in PEFT's format to ``uri``; with ``merged_uri`` (``--merge-lora``), the merged model there too.
    Rank 0 writes and uploads; ``base_dir`` is the base's local folder (where the load read it)."""
    import tempfile

    from ..storage.files import export_scratch, upload_directory
    from .export import stopping_generation_config

    generation = stopping_generation_config(model.lm.generation_config, tokenizer)
    with tempfile.TemporaryDirectory(dir=export_scratch()) as local:
        export_adapter(model, tokenizer=tokenizer, generation_config=generation, rank=rank, local=local, base_name=base_name)
        if rank != 0:
            return
        upload_directory(local, uri)
        if merged_uri is None:
            return
        with tempfile.TemporaryDirectory(dir=export_scratch()) as merged:
            export_merged(base_dir=base_dir, adapter_dir=local, local=merged, tokenizer=tokenizer,
                          generation_config=generation, dtype=dtype)
            upload_directory(merged, merged_uri)

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
  (PEFT's ``merge_and_unload``, in ``--merge-lora-dtype``) as a Hugging Face model in ``final-merged/``.
  Where a turn ends: the folder's ``generation_config.json`` lists the end-of-turn token and its
  tokenizer's EOS is it, but PEFT and transformers keep the base's generation config when they load
  an adapter, and vLLM reads the served model's (or ``--generation-config``'s), never an adapter's:
  set it from the folder (``GenerationConfig.from_pretrained(final)``), or serve the base with
  ``--generation-config <final>``, or serve ``final-merged/``, which carries it.

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
    they are initialised as PEFT does (A Kaiming-uniform, B zero), from ``seed``, identical on every
    rank (rank 0's are the ones the load sends), without touching the caller's random streams:
    PEFT makes the adapters on the CPU (then moves them beside their layer), so only the CPU
    generator is seeded, inside ``fork_rng`` (``torch.manual_seed`` would reseed every CUDA
    device's generator too, which ``fork_rng(devices=[])`` does not restore)."""
    import contextlib

    from peft import get_peft_model

    # A meta model's adapters are made on the meta device too (else PEFT makes them on the CPU and
    # moves them: memory for nothing, and no move of a fake tensor to meta, as the plan's test runs it).
    meta = any(p.is_meta for p in lm.parameters())
    head = lm.get_output_embeddings()
    try:
        with torch.random.fork_rng(devices=[]), (torch.device("meta") if meta else contextlib.nullcontext()):
            torch.random.default_generator.manual_seed(seed)
            peft_model = get_peft_model(lm, settings.peft_config(), autocast_adapter_dtype=True)
    except ValueError as error:  # PEFT: "Target modules {...} not found in the base model"
        names = sorted({name.rsplit(".", 1)[-1] for name, module in lm.named_modules() if isinstance(module, torch.nn.Linear)})
        raise ValueError(f"lora_target_modules={settings.targets!r}: {error}; this model's linear layers are "
                         f"{', '.join(names)} (or give {ALL_LINEAR})") from error
    if head is not None and any(module is head for module in _adapted_base_layers(peft_model)):
        raise ValueError(f"lora_target_modules={settings.targets!r} puts an adapter on the output head, which the chunked "
                         "loss multiplies by directly (training/modeling/model.py): it would never train; leave the head out")
    return peft_model


def _adapted_base_layers(peft_model):
    """The layers PEFT put an adapter around (their ``base_layer``)."""
    from peft.tuners.lora import LoraLayer

    return [module.get_base_layer() for module in peft_model.modules() if isinstance(module, LoraLayer)]


def seed_dropout(seed: int, rank: int) -> None:
    """Seed this rank's random streams (CPU and CUDA) for training: ``seed + rank``, so each rank
    draws its own dropout masks (one seed would give every rank the same masks). Called after the
    load, whose adapter initialisation takes ``seed`` itself and is the same on every rank; a
    checkpoint keeps each rank's streams (training/storage/checkpoint.py ``rng_rank<k>.pt``), so a
    resume continues them."""
    torch.manual_seed(seed + rank)


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


def adapter_state(model, *, rank: int) -> dict:
    """The adapters' full tensors (collective: each sharded one is all-gathered), on rank 0 (empty
    elsewhere), keys without the wrapper's ``lm.``. Only the trainable parameters are gathered:
    ``get_model_state_dict(ignore_frozen_params=True)`` would gather a tied head's alias of the
    frozen embedding too (named once by ``named_parameters``: see :func:`checkpoint_state`), a
    vocabulary's worth of bytes for PEFT to drop."""
    from torch.distributed.tensor import DTensor

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = {}
    for key, value in model.state_dict().items():  # sharded (no gather yet), the same order on every rank
        if key not in trainable:
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if rank == 0:
            state[key.removeprefix("lm.")] = full.detach().to("cpu", copy=True)
    return state


def serving_tokenizer(tokenizer):
    """A copy of ``tokenizer`` whose EOS is the chat template's end-of-turn token where it ends
    turns with one (Qwen2.5 base: ``<|endoftext|>`` becomes ``<|im_end|>``): what a server that
    stops at the tokenizer's EOS (vLLM does, besides the generation config's) needs."""
    from ..data.masking import end_of_turn_token

    turn = end_of_turn_token(tokenizer)
    if turn is None or turn == tokenizer.eos_token:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.eos_token = turn
    return tokenizer


def export_adapter(model, *, tokenizer, generation_config, rank: int, local: str, base_name: str,
                   revision: str | None = None) -> None:
    """Gather the adapters (collective) and, on rank 0, write them in PEFT's format into ``local``
    with the tokenizer (its EOS the end-of-turn token) and the generation config that stops at the
    end of a turn. ``base_name``/``revision``: ``adapter_config.json``'s ``base_model_name_or_path``
    and ``revision`` (see :func:`adapter_base_name`)."""
    state = adapter_state(model, rank=rank)
    if rank != 0:
        return
    peft_model = model.lm
    config = peft_model.peft_config[ADAPTER]
    config.base_model_name_or_path, config.revision = base_name, revision
    peft_model.save_pretrained(local, state_dict=state, save_embedding_layers=False, safe_serialization=True)
    serving_tokenizer(tokenizer).save_pretrained(local)
    generation_config.save_pretrained(local)


def adapter_base_name(model: str, base_dir: str) -> str:
    """What ``adapter_config.json`` names as the base, for PEFT (and transformers) to load it: the
    Hub id of a Hub model; the folder of a local one (absolute); for an ``s3://`` base the URI as
    given, which neither resolves: download the base and pass it (``PeftModel.from_pretrained(base,
    adapter)``), or serve it with vLLM ``--model <base folder> --lora-modules name=<adapter>``, which
    read no ``base_model_name_or_path``."""
    if model.startswith("tiny:"):
        return base_dir
    if model.startswith("s3://"):
        return model
    import os

    path = os.path.expanduser(model)
    return os.path.abspath(path) if os.path.isdir(path) else model


def export_merged(*, base_dir: str, adapter_dir: str, local: str, tokenizer, generation_config, dtype: torch.dtype,
                  revision: str | None = None) -> None:
    """The base of ``base_dir`` with the adapter of ``adapter_dir`` merged in (PEFT's
    ``merge_and_unload``) in ``dtype`` and saved in it, a plain Hugging Face model, into ``local``:
    on the host, one process (rank 0), after the training's memory is no longer needed. In bf16 the
    sum ``W + BA * alpha / r`` is rounded to bf16 (pytorch/torchtune#1101: expected); in fp32 it is
    the adapter model's up to float rounding."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype, **({"revision": revision} if revision else {}))
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged = merged.to(dtype)
    merged.generation_config = copy.deepcopy(generation_config)
    merged.config.use_cache = True
    merged.save_pretrained(local, safe_serialization=True)
    serving_tokenizer(tokenizer).save_pretrained(local)


def export_lora(model, *, tokenizer, rank: int, uri: str, merged_uri: str | None, base_dir: str, base_name: str,
                dtype: torch.dtype, revision: str | None = None) -> None:
    """The run's LoRA export (collective: the adapters are gathered from every rank): the adapter
    in PEFT's format to ``uri``; with ``merged_uri`` (``--merge-lora``), the merged model, in
    ``dtype`` (``--merge-lora-dtype``), there too. Rank 0 writes and uploads; ``base_dir`` is the
    base's local folder (where the load read it) or Hub id, ``revision`` a Hub base's commit."""
    import tempfile

    from ..storage.files import export_scratch, upload_directory
    from .export import stopping_generation_config

    generation = stopping_generation_config(model.lm.generation_config, tokenizer)
    with tempfile.TemporaryDirectory(dir=export_scratch()) as local:
        export_adapter(model, tokenizer=tokenizer, generation_config=generation, rank=rank, local=local, base_name=base_name,
                       revision=revision)
        if rank != 0:
            return
        upload_directory(local, uri)
        if merged_uri is None:
            return
        with tempfile.TemporaryDirectory(dir=export_scratch()) as merged:
            export_merged(base_dir=base_dir, adapter_dir=local, local=merged, tokenizer=tokenizer,
                          generation_config=generation, dtype=dtype, revision=revision)
            upload_directory(merged, merged_uri)

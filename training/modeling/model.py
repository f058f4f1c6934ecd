"""The model as training runs it: loaded with ``from_pretrained`` (the tiny CPU model
too, from the folder it was saved to), in train mode, with the loss computed from the
hidden states in chunks (:mod:`training.modeling.loss`)."""

from __future__ import annotations

import contextlib

import torch

from .attention import hf_attention
from .lora import LoraSettings, add_adapters
from .loss import DEFAULT_CHUNK_TOKENS, LogitTransform, chunked_cross_entropy_sum, chunked_segment_logps
from .parallel import apply_activation_checkpointing


class CausalLMForSFT(torch.nn.Module):
    """A Hugging Face causal LM whose forward returns the normalised training loss.

    The decoder runs as usual; the output head is applied inside
    :func:`training.modeling.loss.chunked_cross_entropy_sum`, so no full logits exist. Wrapping
    keeps the head inside this module's forward, which is what FSDP's root all-gathers
    around (calling the decoder and the head separately from outside would bypass it).

    :param lm: the ``AutoModelForCausalLM`` model (``lm.model`` the decoder, ``lm.lm_head`` the head), or
        PEFT's model around it under LoRA (which hands ``get_decoder`` and the rest to the model).
    """

    def __init__(self, lm: torch.nn.Module, *, loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__()
        self.lm = lm
        self.loss_chunk_tokens = loss_chunk_tokens
        self.logit_transform = LogitTransform.of(lm.config)

    @property
    def config(self):
        """The Hugging Face model config."""
        return self.lm.config

    @property
    def layers(self) -> list[torch.nn.Module]:
        """The decoder blocks, the unit of FSDP sharding and activation checkpointing."""
        layers = getattr(self.lm.get_decoder(), "layers", None)
        if layers is None:
            raise ValueError(f"{type(self.lm).__name__} has no decoder layers (model.layers); cannot shard it per layer")
        return list(layers)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor, normaliser: float,
                trained_positions: torch.Tensor | None = None, segment_bounds: torch.Tensor | None = None,
                **attention_kwargs) -> torch.Tensor:
        """Summed next-token cross-entropy over trained tokens, divided by ``normaliser``.
        ``trained_positions``: see :func:`training.modeling.loss.chunked_cross_entropy_sum`. With
        ``segment_bounds`` (preference pairs): each segment's summed log-probability instead, fp32
        (:func:`training.modeling.loss.chunked_segment_logps`); the
        preference loss is computed from them outside, in fp32 (training/modeling/preference.py),
        so that no float crosses this forward's arguments, which FSDP2 casts to the compute dtype.

        ``normaliser`` is a Python number on purpose: FSDP2's ``MixedPrecisionPolicy``
        casts floating tensors among forward arguments to the parameter dtype, and a
        token count in bf16 loses its low digits (1,001 becomes 1,000).

        With flash-attention the model runs :mod:`training.modeling.attention`'s varlen call: no
        mask is built, for every decoder family (the boundaries are in ``cu_seq_lens_q/k``). With
        sdpa or eager, transformers builds the block-diagonal mask from the restarting
        ``position_ids``.
        """
        hidden = self.lm.get_decoder()(input_ids=input_ids, use_cache=False, **attention_kwargs).last_hidden_state
        head = self.lm.get_output_embeddings().weight
        if segment_bounds is not None:
            return chunked_segment_logps(hidden, head, labels, segment_bounds=segment_bounds,
                                         trained_positions=trained_positions, chunk_tokens=self.loss_chunk_tokens,
                                         transform=self.logit_transform)
        return chunked_cross_entropy_sum(hidden, head, labels, trained_positions=trained_positions,
                                         chunk_tokens=self.loss_chunk_tokens, transform=self.logit_transform) / normaliser


    def reference_logps(self, **kwargs) -> torch.Tensor:
        """:meth:`forward`'s per-segment log-probabilities under the reference model, without
        gradients: under LoRA the base with the adapters switched off (:func:`adapters_off`: no
        second copy of the model), else the model as it is (the full fine-tune's reference is this
        model before its first step: training/modeling/reference.py). An FSDP forward method
        (training/modeling/parallel.py), so the root's parameters are gathered around it."""
        with torch.no_grad(), adapters_off(self):
            return self.forward(**kwargs)

    def generate(self, *args, **kwargs):
        """The model's ``generate`` (PEFT's under LoRA), through this module, so FSDP gathers the
        root's parameters (embeddings, final norm, head) around it as around ``forward``
        (training/modeling/parallel.py registers it as a forward method)."""
        return self.lm.generate(*args, **kwargs)


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Every LoRA layer of ``model`` runs its base layer alone inside the block (nothing happens to a
    model without adapters).

    Not PEFT's ``PeftModel.disable_adapter()``: it also sets ``requires_grad`` off and on again on the
    adapters' parameters (``BaseTunerLayer.enable_adapters``), and under FSDP2 that reaches the
    parameters registered on the module at that moment. The last decoder layer keeps its gathered
    parameters after forward (training/modeling/parallel.py), so its *unsharded* adapters are switched
    back on while its sharded ones, which the optimizer steps and the checkpoint keeps, stay frozen: a
    LoRA DPO run then saved checkpoints without that layer's adapters. Here only the flag LoRA's
    forward reads (``if self.disable_adapters``, peft 0.21.2 ``tuners/lora/layer.py``) is set. PEFT is
    imported for a model with adapters only (a full fine-tune's image need not have it)."""
    from .lora import is_lora

    if not is_lora(model):
        yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, disabled in zip(layers, before):
            layer._disable_adapters = disabled


def load_model(model_dir: str, *, attn_implementation: str, activation_checkpointing: bool,
               loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS, device: torch.device | None = None,
               lora: LoraSettings | None = None, seed: int = 0) -> CausalLMForSFT:
    """The whole model in fp32 in this process, for one process that trains alone (the tests,
    the bench); a run's workers load with :func:`training.modeling.load.load_sharded`.
    ``attn_implementation``: as the user gives it (flash-attention runs the varlen call on
    ``device``'s kernel). ``lora``: with LoRA adapters initialised from ``seed``."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation=hf_attention(attn_implementation, device or torch.device("cpu")))
    return for_training(lm, activation_checkpointing=activation_checkpointing, loss_chunk_tokens=loss_chunk_tokens,
                        lora=lora, seed=seed)


def for_training(lm: torch.nn.Module, *, activation_checkpointing: bool, loss_chunk_tokens: int,
                 lora: LoraSettings | None = None, seed: int = 0) -> CausalLMForSFT:
    """A loaded (or meta) Hugging Face model made ready to train: no KV cache, activation
    checkpointing if asked, LoRA adapters if asked (training/modeling/lora.py; after the
    checkpointing, which transformers sets on its own decoder layers), train mode, wrapped with the
    chunked loss.

    ``from_pretrained`` returns a model in eval mode, and transformers'
    ``GradientCheckpointingLayer`` only recomputes when ``self.training``: without
    ``train()`` activation checkpointing silently never runs.
    """
    lm.config.use_cache = False
    if activation_checkpointing:
        apply_activation_checkpointing(lm)
    if lora is not None:
        lm = add_adapters(lm, lora, seed=seed)
    lm.train()
    return CausalLMForSFT(lm, loss_chunk_tokens=loss_chunk_tokens)

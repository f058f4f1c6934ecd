"""The model as training runs it: loaded with ``from_pretrained`` (the tiny CPU model
too, from the folder it was saved to), in train mode, with the loss computed from the
hidden states in chunks (:mod:`training.modeling.loss`)."""

from __future__ import annotations

import torch

from .loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy_sum
from .parallel import apply_activation_checkpointing

#: Attention implementations whose kernels take the packed samples' boundaries from
#: ``cu_seq_lens_q/k`` (varlen) and need no attention mask.
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


class CausalLMForSFT(torch.nn.Module):
    """A Hugging Face causal LM whose forward returns the normalised training loss.

    The decoder runs as usual; the output head is applied inside
    :func:`training.modeling.loss.chunked_cross_entropy_sum`, so no full logits exist. Wrapping
    keeps the head inside this module's forward, which is what FSDP's root all-gathers
    around (calling the decoder and the head separately from outside would bypass it).

    :param lm: the ``AutoModelForCausalLM`` model (``lm.model`` the decoder, ``lm.lm_head`` the head).
    """

    def __init__(self, lm: torch.nn.Module, *, loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__()
        self.lm = lm
        self.loss_chunk_tokens = loss_chunk_tokens

    @property
    def config(self):
        """The Hugging Face model config."""
        return self.lm.config

    @property
    def no_mask(self) -> dict | None:
        """The decoder's mask mapping with no mask for any layer type, when the attention
        implementation is varlen; else None (let transformers build the mask)."""
        if self.config._attn_implementation not in VARLEN_ATTENTION:
            return None
        return {layer_type: None for layer_type in (getattr(self.config, "layer_types", None) or ["full_attention"])}

    @property
    def layers(self) -> list[torch.nn.Module]:
        """The decoder blocks, the unit of FSDP sharding and activation checkpointing."""
        layers = getattr(self.lm.get_decoder(), "layers", None)
        if layers is None:
            raise ValueError(f"{type(self.lm).__name__} has no decoder layers (model.layers); cannot shard it per layer")
        return list(layers)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor, normaliser: float,
                trained_positions: torch.Tensor | None = None, **attention_kwargs) -> torch.Tensor:
        """Summed next-token cross-entropy over trained tokens, divided by ``normaliser``.
        ``trained_positions``: see :func:`training.modeling.loss.chunked_cross_entropy_sum`.

        ``normaliser`` is a Python number on purpose: FSDP2's ``MixedPrecisionPolicy``
        casts floating tensors among forward arguments to the parameter dtype, and a
        token count in bf16 loses its low digits (1,001 becomes 1,000).

        With a varlen attention kernel no mask is built: transformers' ``create_causal_mask``
        would look for packed samples in ``position_ids`` (``find_packed_sequence_indices``,
        transformers 5.13 ``masking_utils.py``), whose ``(mask[:, -1] == 0).all()`` in a Python
        ``if`` makes the host wait for the GPU at every forward, only to return ``None`` for a
        flash-attention layer (``flash_attention_mask``). A mask mapping of ``None`` per layer
        type (what the decoder takes in place of a mask, ``Qwen2Model.forward``) skips it; the
        kernel reads the boundaries from ``cu_seq_lens_q/k``. Other implementations (sdpa on
        CPU) build the block-diagonal mask from the restarting ``position_ids`` as before.
        """
        if self.no_mask is not None and "attention_mask" not in attention_kwargs:
            attention_kwargs["attention_mask"] = self.no_mask
        hidden = self.lm.get_decoder()(input_ids=input_ids, use_cache=False, **attention_kwargs).last_hidden_state
        head = self.lm.get_output_embeddings().weight
        return chunked_cross_entropy_sum(hidden, head, labels, trained_positions=trained_positions,
                                         chunk_tokens=self.loss_chunk_tokens) / normaliser


def load_model(model_dir: str, *, attn_implementation: str, activation_checkpointing: bool,
               loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> CausalLMForSFT:
    """Load the model for training, in fp32 (FSDP's mixed precision casts per layer).

    ``from_pretrained`` returns a model in eval mode, and transformers'
    ``GradientCheckpointingLayer`` only recomputes when ``self.training``: without
    ``train()`` activation checkpointing silently never runs.
    """
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn_implementation)
    lm.config.use_cache = False
    if activation_checkpointing:
        apply_activation_checkpointing(lm)
    lm.train()
    return CausalLMForSFT(lm, loss_chunk_tokens=loss_chunk_tokens)

"""Packed rows through a varlen attention kernel: one call path on the GPU and on the CPU.

A micro-batch is one flat row of packed samples with their boundaries in ``cu_seq_lens_q/k``
(training/data/batch.py). With ``--attn-implementation flash_attention_2`` the model runs
:func:`varlen_attention_forward`, registered with transformers' ``AttentionInterface`` under
:data:`VARLEN`; it calls flash-attn's ``flash_attn_varlen_func`` on a GPU and
:func:`reference_varlen_attention` (the same signature, in plain torch) on a CPU, so a CPU run
takes the GPU's model path: the flattened row, ``cu_seq_lens``, no mask.

Why a name of our own rather than transformers' ``flash_attention_2``: transformers builds no
mask for an attention implementation it has no mask function for (transformers 5.13
``masking_utils._preprocess_mask_arguments``: "custom attention without equivalent mask
creation: we don't need a mask!"), for every decoder family alike. Under the name
``flash_attention_2`` each family's ``create_causal_mask`` would run, and look for packed
samples in ``position_ids`` (``find_packed_sequence_indices``, a host sync per forward on a
GPU), unless the decoder takes a mask mapping in place of a mask, which only some families do
(Qwen2, Qwen3, Gemma 2 and 3; Llama, Mistral, Gemma, Phi-3, OLMo 2 and Granite hand it to
``create_causal_mask`` and fail on ``dict.ndim``). The name has no "flash" in it on purpose:
transformers preloads a flash kernel for any name with "flash" in it
(``modeling_utils._check_and_adjust_attn_implementation``), which would fail for ours.
"""

from __future__ import annotations

import math

import torch

#: The name the model is loaded with when the user asks for flash-attention.
VARLEN = "packed_varlen"
#: What users write (``--attn-implementation``) for the varlen kernel.
FLASH = "flash_attention_2"


def hf_attention(attn_implementation: str, device: torch.device, kernel=None) -> str:
    """The ``attn_implementation`` to load the model with: :data:`VARLEN` (registered here, with
    the kernel for ``device``, or ``kernel``: a function of flash-attn's ``flash_attn_varlen_func``
    signature) for flash-attention, else the name as given (sdpa, eager)."""
    if attn_implementation != FLASH:
        return attn_implementation
    from transformers import AttentionInterface

    if kernel is None:
        kernel = _flash_kernel() if device.type == "cuda" else reference_varlen_attention
    AttentionInterface.register(VARLEN, _with_kernel(kernel))
    return VARLEN


def _flash_kernel():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                               softmax_scale: float | None = None, causal: bool = False,
                               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func`` in plain torch, for the CPU: ``q`` (total, heads,
    dim), ``k``/``v`` (total, kv_heads, dim) with fewer heads for grouped queries; each segment
    of ``cu_seqlens`` attends only to itself. ``window_size`` (left, right) and ``softcap`` as
    flash-attn reads them (a key ``j`` is seen from ``i`` when ``i - left <= j <= i + right``,
    -1 for no limit; the scores become ``softcap * tanh(scores / softcap)``). Scores and softmax
    in fp32; the output in ``q``'s dtype."""
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise ValueError("reference_varlen_attention: cu_seqlens_q and cu_seqlens_k differ (only self-attention is supported)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    left, right = window_size
    bounds = cu_seqlens_q.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs = q[start:end].transpose(0, 1).float()  # (heads, n, dim)
        ks = k[start:end].transpose(0, 1).float().repeat_interleave(groups, dim=0)
        vs = v[start:end].transpose(0, 1).float().repeat_interleave(groups, dim=0)
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(end - start).unsqueeze(1)
        j = torch.arange(end - start).unsqueeze(0)
        seen = torch.ones(end - start, end - start, dtype=torch.bool)
        if causal:
            seen &= j <= i
        if left >= 0:
            seen &= j >= i - left
        if right >= 0 and not causal:
            seen &= j <= i + right
        probabilities = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        if dropout_p:
            probabilities = torch.nn.functional.dropout(probabilities, p=dropout_p)
        parts.append((probabilities @ vs).transpose(0, 1))
    return torch.cat(parts, dim=0).to(q.dtype)


def sdpa_per_segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                               softmax_scale: float | None = None, causal: bool = False,
                               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> torch.Tensor:
    """The varlen call through PyTorch's own fused kernels where flash-attn is not installed: one
    ``scaled_dot_product_attention`` per segment (``is_causal``, grouped heads with ``enable_gqa``),
    no block-diagonal mask. It reads the boundaries on the host (one sync per layer); a sliding
    window or a soft cap goes to :func:`reference_varlen_attention`."""
    if softcap or window_size != (-1, -1) or not torch.equal(cu_seqlens_q, cu_seqlens_k):
        return reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                          softmax_scale, causal, window_size, softcap)
    bounds = cu_seqlens_q.tolist()
    parts = [torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1).unsqueeze(0), k[a:b].transpose(0, 1).unsqueeze(0), v[a:b].transpose(0, 1).unsqueeze(0),
        dropout_p=dropout_p, is_causal=causal, scale=softmax_scale, enable_gqa=True)[0].transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=0)


def _with_kernel(kernel):
    def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask, dropout: float = 0.0, scaling: float | None = None,
                                 sliding_window: int | None = None, softcap: float | None = None,
                                 is_causal: bool | None = None, s_aux=None, **kwargs) -> tuple[torch.Tensor, None]:
        """The decoder's attention call (``(batch, heads, seq, dim)`` in, ``(batch, seq, heads, dim)``
        out, as transformers' attention functions) over the packed row's segments. The kwargs are
        read as transformers' flash path reads them (``_process_flash_attention_kwargs``): a
        sliding window of ``w`` tokens is flash-attn's ``window_size=(w - 1, w - 1)``."""
        if attention_mask is not None:
            raise ValueError(f"{VARLEN}: got an attention mask; packed rows carry their boundaries in cu_seq_lens_q/k")
        if s_aux is not None:
            raise ValueError(f"{VARLEN}: {type(module).__name__} uses attention sinks, which this kernel does not take; "
                             "use --attn-implementation eager")
        batch, heads, length, dim = query.shape
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is None:  # a plain batch (no packing): each row is one sequence
            cu_q = cu_k = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=query.device)
            max_q = max_k = length
        else:
            max_q, max_k = kwargs["max_length_q"], kwargs["max_length_k"]
        dtype = query.dtype
        half = torch.bfloat16 if query.device.type == "cuda" and dtype == torch.float32 else dtype  # flash-attn takes 16-bit only
        q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], dim).to(half) for t in (query, key, value))
        options = {"dropout_p": dropout, "softmax_scale": scaling,
                   "causal": module.is_causal if is_causal is None else is_causal}
        if sliding_window is not None and max_k > sliding_window:
            options["window_size"] = (sliding_window - 1, sliding_window - 1)
        if softcap is not None:
            options["softcap"] = softcap
        out = kernel(q, k, v, cu_q, cu_k, max_q, max_k, **options)
        return out.reshape(batch, length, heads, dim).to(dtype), None

    return varlen_attention_forward

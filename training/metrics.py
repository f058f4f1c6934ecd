"""Throughput, model FLOPs utilisation and memory."""

from __future__ import annotations

import resource
import sys

import torch

#: Dense bf16 tensor-core peak per GPU, TFLOPS (vendor data sheets, no sparsity).
PEAK_TFLOPS_BF16 = {"L4": 121.0, "A10G": 70.0, "A100": 312.0, "H100": 989.0, "H200": 989.0}


def device_peak_tflops(device: torch.device) -> float | None:
    """The table's peak for ``device``, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for model, peak in PEAK_TFLOPS_BF16.items():
        if model in name:
            return peak
    return None


def flops_per_token(*, matmul_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters (forward 2, backward 4) plus
    12 x layers x hidden x seq_len for attention scores and values (PaLM, appendix B)."""
    return 6.0 * matmul_params + 12.0 * num_layers * hidden_size * seq_len


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """:func:`flops_per_token` of a Hugging Face causal LM. The input embedding is a
    lookup, not a matmul; the output head is a matmul, and with tied embeddings it is the
    same parameter as the input embedding."""
    config = model.config
    total = sum(p.numel() for p in _unique_parameters(model))
    embedding = config.vocab_size * config.hidden_size
    matmul = total if getattr(config, "tie_word_embeddings", False) else total - embedding
    return flops_per_token(matmul_params=matmul, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, seq_len=seq_len)


def _unique_parameters(model: torch.nn.Module):
    seen = set()
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            yield parameter


def mfu(*, tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Achieved model FLOPs over the device's peak, per device (None without a peak)."""
    if not peak_tflops:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by torch, or the process's peak RSS on CPU, GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20

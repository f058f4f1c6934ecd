"""Throughput, model FLOPs utilisation and memory."""

from __future__ import annotations

import resource
import sys

import torch

#: Dense bf16 tensor-core peak per GPU, TFLOPS (vendor data sheets: half the "with
#: sparsity" figure), by the exact name ``torch.cuda.get_device_name`` reports. Exact,
#: because names nest: "NVIDIA L4" is in "NVIDIA L40S" (362, not 121), and the H100 PCIe
#: and NVL are not the SXM part.
PEAK_TFLOPS_BF16 = {
    "NVIDIA L4": 121.0,
    "NVIDIA L40S": 362.0,
    "NVIDIA A10G": 70.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA H100 80GB HBM3": 989.0,  # SXM5 (p5)
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0,  # SXM (p5en)
    "NVIDIA H200 NVL": 835.0,
}


def peak_tflops(device_name: str) -> float | None:
    """The table's peak for a device name, or None for a GPU not in the table."""
    return PEAK_TFLOPS_BF16.get(device_name.strip())


def device_peak_tflops(device: torch.device) -> float | None:
    """The table's peak for ``device``, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device))


def step_flops(*, decoder_params: int, head_params: int, num_layers: int, hidden_size: int, tokens: int,
               trained_tokens: int, squared_lengths: int, frozen_decoder_params: int = 0, frozen_head: bool = False,
               reference_forward: bool = False) -> float:
    """Training FLOPs of what runs for packed samples: 6 x parameters per token (forward 2,
    backward 4) for the decoder's matmuls on every real token; the output head's 6 x
    (vocab x hidden) only on the trained tokens, since the chunked loss (training/modeling/loss.py)
    applies the head to those alone; and attention scores and values at 12 x layers x hidden
    x context per token (PaLM, appendix B), where a packed sample's context is its own
    length: length squared per sample. Padding counts nothing; recomputation (activation
    checkpointing, the loss's logits) is not model FLOPs.

    A frozen weight (LoRA's base, ``--peft lora``) costs 4 per token, not 6: its forward 2 and
    the backward's gradient of the activations 2, with no gradient of the weight; the adapters
    (trainable, among ``decoder_params``) cost 6 as any trained weight. Attention's scores and
    values have no weights: 12 either way.

    :param frozen_decoder_params: of ``decoder_params``, the frozen ones.
    :param frozen_head: whether the output head is frozen (LoRA).
    :param reference_forward: LoRA DPO's reference pass (training/modeling/preference.py), a forward of
        the base alone (the adapters off) over the same tokens, is part of the step: 2 per frozen
        weight per token, the head's 2 on the trained tokens and attention's forward third (4).

    :param tokens: the real (non-padding) tokens.
    :param trained_tokens: the tokens whose next-token label is trained.
    :param squared_lengths: the sum over the packed samples of their length squared.
    """
    flops = ((6.0 * decoder_params - 2.0 * frozen_decoder_params) * tokens
             + (4.0 if frozen_head else 6.0) * head_params * trained_tokens
             + 12.0 * num_layers * hidden_size * squared_lengths)
    if reference_forward:
        flops += (2.0 * frozen_decoder_params * tokens + 2.0 * head_params * trained_tokens
                  + 4.0 * num_layers * hidden_size * squared_lengths)
    return flops


def flops_shape(model: torch.nn.Module) -> dict[str, int]:
    """What :func:`step_flops` needs of ``model`` (a Hugging Face causal LM or its wrapper):
    the decoder's matmul parameters (all parameters but the input embedding and the output
    head; the norms, a rounding error, included), the head's and the attention's shape; with a
    frozen base (LoRA) also its frozen decoder parameters and that the head is frozen."""
    config = model.config
    head = config.vocab_size * config.hidden_size
    total = sum(p.numel() for p in _unique_parameters(model))
    tied = getattr(config, "tie_word_embeddings", False)
    embeddings = head if tied else 2 * head
    shape = {"decoder_params": total - embeddings, "head_params": head,
             "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size}
    frozen = sum(p.numel() for p in _unique_parameters(model) if not p.requires_grad)
    if frozen:  # the embeddings and head among them (LoRA freezes the whole base)
        shape.update(frozen_decoder_params=max(frozen - embeddings, 0), frozen_head=True)
    return shape


def parameter_count(model: torch.nn.Module) -> int:
    """Every weight of ``model`` once (a tied head counted once; a sharded parameter whole), adapters
    included: what a server loads (run.json's ``parameters``: ray_train_eks/handlers/serving.py sizes a
    replica's GPUs from it)."""
    return sum(p.numel() for p in _unique_parameters(model))


def _unique_parameters(model: torch.nn.Module):
    seen = set()
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            yield parameter


def mfu(*, flops_per_s: float, peak_tflops: float | None) -> float | None:
    """Achieved model FLOPs per second over the device's peak, per device (None without a peak)."""
    if not peak_tflops:
        return None
    return flops_per_s / (peak_tflops * 1e12)


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated by torch, or the process's peak RSS on CPU, GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20

"""The causal-LM loss without the full logits.

With a 152k vocabulary the logits are the largest tensor of a step: 4,096 tokens give
1.2 GB in bf16, 2.5 GB as fp32 for the softmax and 2.5 GB more for their gradient. Here
the loss is computed from the final hidden states in chunks of tokens, only for the tokens
whose label is trained, and each chunk's logits are recomputed in backward instead of
kept (``torch.utils.checkpoint``): the technique of Liger-Kernel's fused linear
cross-entropy and Apple's Cut Cross-Entropy, in plain torch so that it runs the same on
CPU and GPU. The numbers are those of the plain path (logits in the compute dtype, the
softmax in fp32), so the loss and the gradients match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
#: Tokens per chunk: 1,024 x 151,936 x 4 bytes = 0.62 GB of fp32 logits at a time.
DEFAULT_CHUNK_TOKENS = 1024


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position t learns ``labels[t + 1]``; the last position learns nothing (as in
    transformers' ``ForCausalLMLoss``, which pads the labels and shifts them)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


@dataclass(frozen=True)
class LogitTransform:
    """What a family's ``ForCausalLM.forward`` does to the head's output before its loss, read from
    the model config (transformers 5.13): Granite divides by ``logits_scaling``
    (``GraniteForCausalLM``), Cohere multiplies by ``logit_scale`` (``CohereForCausalLM``), Gemma 2
    and 3 cap with ``final_logit_softcapping`` (``cap * tanh(logits / cap)``). The loss here never
    runs that forward, so it applies them itself, in fp32."""

    multiplier: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> "LogitTransform":
        multiplier = float(getattr(config, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None) or 1.0)
        return cls(multiplier=multiplier, softcap=getattr(config, "final_logit_softcapping", None) or None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


PLAIN = LogitTransform()


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    transform: LogitTransform = PLAIN) -> torch.Tensor:
    logits = transform((hidden @ weight.t()).float())
    return F.cross_entropy(logits, targets, reduction="sum")


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                              trained_positions: torch.Tensor | None = None,
                              chunk_tokens: int = DEFAULT_CHUNK_TOKENS, transform: LogitTransform = PLAIN) -> torch.Tensor:
    """Sum over trained tokens of the cross-entropy of ``hidden @ weight.T`` against the
    next-token ``labels``, never holding more than ``chunk_tokens`` rows of logits.

    :param hidden: final hidden states, (..., seq, hidden).
    :param weight: the output head, (vocab, hidden) (the embedding when tied).
    :param labels: token labels, (..., seq), ``IGNORE_INDEX`` where nothing is learnt.
    :param trained_positions: the flat positions whose next-token target is trained, as
        computed on the CPU by ``training.data.collate``. None: found here with ``nonzero()``,
        which on a GPU stops the host until the kernel queue drains (a sync per micro-step).
    :param transform: the family's logit scaling and soft-capping (:class:`LogitTransform`).
    """
    targets = next_token_targets(labels).reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    trained = (targets != IGNORE_INDEX).nonzero().squeeze(-1) if trained_positions is None else trained_positions
    if trained.numel() == 0:
        # Keep the graph connected, so every parameter still gets its (zero) gradient
        # and FSDP's reduce-scatter runs on every rank alike.
        return hidden.sum() * 0.0 + weight.sum() * 0.0
    hidden, targets = hidden.index_select(0, trained), targets.index_select(0, trained)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_loss_sum, hidden[start:end], weight, targets[start:end], transform,
                                   use_reentrant=False)
    return total


def _chunk_token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       transform: LogitTransform = PLAIN) -> torch.Tensor:
    logits = transform((hidden @ weight.t()).float())
    return -F.cross_entropy(logits, targets, reduction="none")


def chunked_segment_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, segment_bounds: torch.Tensor,
                          trained_positions: torch.Tensor | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                          transform: LogitTransform = PLAIN) -> torch.Tensor:
    """Per segment, the summed log-probability of its trained next-token targets, (segments,) in fp32,
    in chunks as :func:`chunked_cross_entropy_sum` (the preference losses' input:
    training/modeling/preference.py). ``segment_bounds``: where each segment's run of trained
    positions starts, and the end (training/data/batch.py ``PairSegments``). The sums are differences
    of an fp64 running sum at those bounds: the same numbers whatever else is in the micro-batch and
    on every run (``index_add`` on a GPU adds with atomics, in no fixed order)."""
    targets = next_token_targets(labels).reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    trained = (targets != IGNORE_INDEX).nonzero().squeeze(-1) if trained_positions is None else trained_positions
    if trained.numel() == 0:
        anchor = (hidden.sum() * 0.0 + weight.sum() * 0.0).float()
        return anchor.reshape(1).expand(segment_bounds.shape[0] - 1).clone()
    hidden, targets = hidden.index_select(0, trained), targets.index_select(0, trained)
    pieces = [checkpoint(_chunk_token_logps, hidden[start:start + chunk_tokens], weight, targets[start:start + chunk_tokens],
                         transform, use_reentrant=False) for start in range(0, hidden.shape[0], chunk_tokens)]
    running = F.pad(torch.cat(pieces).double().cumsum(0), (1, 0))
    return (running.index_select(0, segment_bounds[1:]) - running.index_select(0, segment_bounds[:-1])).float()


def full_logits_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                  transform: LogitTransform = PLAIN) -> torch.Tensor:
    """The plain path: every position's logits at once, then the summed cross-entropy.
    The reference the chunked loss is tested and benchmarked against."""
    logits = transform((hidden @ weight.t()).float())
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), next_token_targets(labels).reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")

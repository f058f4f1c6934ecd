"""Every decoder family the project offers takes the GPU's model path on the CPU: a tiny random
model of each, saved and loaded through the same loader as a real one, with the varlen call
(``--attn-implementation flash_attention_2``, the CPU's reference kernel in place of
flash-attn's), one packed step whose loss and gradients equal those of a per-sample forward of
the same weights through transformers' own model (eager attention, the full logits and the
family's own logit scaling or capping)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.data import collate, pack, tokenize_sample
from training.modeling.attention import VARLEN, reference_varlen_attention
from training.modeling.families import FAMILIES, TINY_WINDOW, per_sample_loss, write_tiny_family
from training.modeling.model import load_model
from training.storage.tiny import synthetic_samples


@pytest.fixture(scope="module")
def packed(tokenizer):
    samples = [tokenize_sample(tokenizer, m["messages"]) for m in synthetic_samples(12, seed=5)]
    return pack(samples, seq_len=96, pad_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_trains_on_the_varlen_path_with_the_per_sample_loss_and_gradients(family, tokenizer, packed, tmp_path):
    from transformers import AutoModelForCausalLM

    directory = write_tiny_family(tmp_path / family, family, tokenizer)
    model = load_model(str(directory), attn_implementation="flash_attention_2", activation_checkpointing=True)
    assert model.config._attn_implementation == VARLEN
    reference = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    reference.train()
    batch = collate(packed, np.arange(3), torch.device("cpu"))
    lengths = batch.sample_lengths
    assert len(lengths) >= 3 and min(lengths) > TINY_WINDOW  # several samples, each longer than a window

    loss = model(**batch.inputs, labels=batch.labels, trained_positions=batch.trained_positions,
                 normaliser=float(batch.label_tokens))
    loss.backward()
    expected = per_sample_loss(reference, batch) / batch.label_tokens
    expected.backward()

    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    grads = dict(reference.named_parameters())
    for name, parameter in model.lm.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=f"{family}: {name}")


def test_the_reference_kernel_is_flash_attns_call_on_one_segment_with_grouped_heads_window_and_softcap():
    """Against a direct computation: the kernel's masks and caps are flash-attn's."""
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = reference_varlen_attention(q, k, v, cu, cu, 6, 6, causal=True, window_size=(2, 2), softcap=5.0,
                                     softmax_scale=0.5)
    for start, end in ((0, 4), (4, 10)):
        for i in range(start, end):
            for head in range(4):
                keys = range(max(start, i - 2), i + 1)
                scores = torch.stack([5.0 * torch.tanh(0.5 * q[i, head] @ k[j, head // 2] / 5.0) for j in keys])
                weights = torch.softmax(scores, 0)
                want = sum(w * v[j, head // 2] for w, j in zip(weights, keys))
                torch.testing.assert_close(out[i, head], want, rtol=1e-5, atol=1e-6)


def test_the_sdpa_per_segment_kernel_is_the_reference_kernel_where_it_applies():
    """The bench's fallback on a GPU without flash-attn: PyTorch's fused kernels per segment."""
    from training.modeling.attention import sdpa_per_segment_attention

    torch.manual_seed(1)
    q, k, v = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    torch.testing.assert_close(sdpa_per_segment_attention(q, k, v, cu, cu, 7, 7, causal=True, softmax_scale=0.3),
                               reference_varlen_attention(q, k, v, cu, cu, 7, 7, causal=True, softmax_scale=0.3),
                               rtol=1e-5, atol=1e-6)

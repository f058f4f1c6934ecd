"""The model as training loads and runs it: train mode with activation checkpointing that
really recomputes, the chunked loss against the plain one, and a loss normaliser that
mixed precision cannot round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.data import collate, pack, tokenize_sample
from training.modeling.loss import IGNORE_INDEX, chunked_cross_entropy_sum, full_logits_cross_entropy_sum
from training.modeling.model import load_model
from training.storage.tiny import synthetic_samples


def _batch(tokenizer, rows: int = 2, seq_len: int = 96):
    samples = [tokenize_sample(tokenizer, m["messages"]) for m in synthetic_samples(12, seed=3)]
    return collate(pack(samples, seq_len=seq_len, pad_id=tokenizer.pad_token_id), np.arange(rows), torch.device("cpu"))


def test_activation_checkpointing_recomputes_every_layer_during_a_real_step(tiny_dir, tokenizer):
    # The production path: from_pretrained (the tiny model was saved to a folder first). A
    # pre-hook, since non-reentrant recomputation stops early, before forward hooks run.
    model = load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=True)
    assert model.training and model.lm.training  # from_pretrained alone returns eval mode
    calls = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda module, args: calls.append(module))
    batch = _batch(tokenizer)
    loss = model(**batch.inputs, labels=batch.labels, normaliser=float(batch.label_tokens))
    forwards = len(calls)
    loss.backward()
    assert forwards == len(model.layers)
    assert len(calls) == 2 * len(model.layers)  # each layer ran again in backward: recomputed


def test_without_train_mode_checkpointing_silently_does_nothing(tiny_dir, tokenizer):
    # The defect this guards against, shown on the same path: eval mode skips recomputation.
    model = load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=True).eval()
    calls = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda module, args: calls.append(module))
    batch = _batch(tokenizer)
    model(**batch.inputs, labels=batch.labels, normaliser=1.0).backward()
    assert len(calls) == len(model.layers)


def test_model_loss_equals_transformers_own_loss(tiny_dir, tokenizer):
    model = load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=False)
    batch = _batch(tokenizer)
    ours = model(**batch.inputs, labels=batch.labels, normaliser=float(batch.label_tokens))
    theirs = model.lm(**batch.inputs, labels=batch.labels, use_cache=False).loss  # mean over trained tokens
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)


@pytest.mark.parametrize("chunk_tokens", [7, 64, 10_000])
def test_chunked_loss_and_gradients_equal_the_full_logits_path(chunk_tokens):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 300, 32, generator=generator, dtype=torch.float32)
    weight = torch.randn(500, 32, generator=generator, dtype=torch.float32) * 0.2
    labels = torch.randint(0, 500, (1, 300), generator=generator)
    labels[0, ::3] = IGNORE_INDEX
    results = []
    for loss_fn in (full_logits_cross_entropy_sum, lambda h, w, y: chunked_cross_entropy_sum(h, w, y, chunk_tokens=chunk_tokens)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = loss_fn(h, w, labels)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    (full, full_dh, full_dw), (chunked, dh, dw) = results
    assert torch.allclose(chunked, full, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dh, full_dh, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dw, full_dw, rtol=1e-5, atol=1e-5)


def test_chunked_loss_of_a_batch_without_trained_tokens_is_zero_with_gradients():
    hidden = torch.randn(1, 10, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    loss = chunked_cross_entropy_sum(hidden, weight, torch.full((1, 10), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad is not None and weight.grad is not None


def test_loss_normaliser_is_not_rounded_by_bf16_mixed_precision(tiny_dir, tokenizer, tmp_path):
    import torch.distributed as dist

    from training.modeling.parallel import apply_fsdp, build_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=False)
        apply_fsdp(model, mesh=build_mesh(device_type="cpu", world_size=1, shard_size=1), mixed_precision="bf16")
        batch = _batch(tokenizer)
        with torch.no_grad():
            unit = model(**batch.inputs, labels=batch.labels, normaliser=1.0).item()
            exact = model(**batch.inputs, labels=batch.labels, normaliser=1001.0).item()
            as_tensor = model(**batch.inputs, labels=batch.labels, normaliser=torch.tensor(1001.0)).item()
    finally:
        dist.destroy_process_group()
    assert exact == pytest.approx(unit / 1001, rel=1e-6)  # a Python number passes through untouched
    assert as_tensor == pytest.approx(unit / 1000, rel=1e-6)  # a tensor is cast to bf16: 1001 -> 1000

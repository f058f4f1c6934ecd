"""What a step computes around the loss: no attention mask (and so no host sync) with a varlen
kernel, the eval loss of the model in eval mode, and an MFU from the whole step's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.data import DataOrder, collate, pack, tokenize_sample
from training.storage.tiny import synthetic_samples


def _packed(tokenizer, *, n: int = 24, seq_len: int = 96):
    samples = [tokenize_sample(tokenizer, m["messages"]) for m in synthetic_samples(n, seed=3)]
    return pack(samples, seq_len=seq_len, pad_id=tokenizer.pad_token_id)


def test_a_varlen_kernel_gets_no_mask_and_transformers_never_looks_for_packed_samples(tiny_dir, tokenizer, monkeypatch):
    """The CPU check of the call path: with flash-attention (the varlen call, training/modeling/
    attention.py), transformers builds no mask, so ``find_packed_sequence_indices`` (its ``.all()``
    in a Python ``if`` is a host sync per forward on a GPU) is never called, and the loss is the
    one the sdpa path computes with the block-diagonal mask."""
    import transformers.masking_utils as masking_utils

    from training.modeling.model import load_model

    packed = _packed(tokenizer)
    batch = collate(packed, np.arange(2), torch.device("cpu"))
    calls = []
    real_find = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda *a, **k: calls.append(1) or real_find(*a, **k))
    varlen_model = load_model(str(tiny_dir), attn_implementation="flash_attention_2", activation_checkpointing=False)
    with torch.no_grad():
        varlen = varlen_model(**batch.inputs, labels=batch.labels, trained_positions=batch.trained_positions, normaliser=1.0)
    assert calls == []
    # Control: the sdpa path does look (that is how it builds the block-diagonal mask).
    sdpa_model = load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=False)
    with torch.no_grad():
        masked = sdpa_model(**batch.inputs, labels=batch.labels, trained_positions=batch.trained_positions, normaliser=1.0)
    assert calls
    assert varlen.item() == pytest.approx(masked.item(), rel=1e-5)


class _RecordsMode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.modes: list[bool] = []

    def forward(self, **kwargs):
        self.modes.append(self.training)
        return self.weight * 1.0


def test_the_eval_loss_runs_the_model_in_eval_mode_and_training_goes_on_in_train_mode(tokenizer, monkeypatch):
    from training import loop
    from training.config import PRESETS, TrainConfig
    from training.data import DataReport, TrainingData

    packed = _packed(tokenizer)
    model = _RecordsMode().train()
    config = TrainConfig.from_dict({**PRESETS["tiny-cpu"], "micro_batch_size": 2})
    worker = loop.Worker(config=config, invocation_id="x", rank=0, world=1, device=torch.device("cpu"), model=model,
                         data=TrainingData(train=packed, eval=packed.head(4), report=DataReport()))
    monkeypatch.setattr(loop.dist, "all_reduce", lambda tensor, *a, **k: None)
    loop.evaluate(worker)
    assert model.modes and not any(model.modes)
    assert model.training


def test_mfu_counts_come_from_the_whole_step_not_rank_0s_share(tokenizer):
    """Every worker computes the step's FLOPs from the global batch (on its CPU copy of the
    data), which equals the sum of every rank's own micro-batches."""
    packed = _packed(tokenizer, n=60)
    world = 2
    order = DataOrder(num_sequences=len(packed), global_batch=8, micro_batch=2, num_workers=world, seed=1)
    for step in range(3):
        counts = packed.flop_counts(order.global_batch_indices(step))
        batches = [collate(packed, indices, torch.device("cpu"))
                   for rank in range(world) for indices in order.micro_batches(step, rank)]
        assert counts == {"tokens": sum(b.real_tokens for b in batches),
                          "trained_tokens": sum(b.label_tokens for b in batches),
                          "squared_lengths": sum(n * n for b in batches for n in b.sample_lengths)}
        rank0 = [collate(packed, indices, torch.device("cpu")) for indices in order.micro_batches(step, 0)]
        assert sum(b.real_tokens for b in rank0) < counts["tokens"]


def test_the_memory_plan_is_calibrated_over_the_first_step_that_starts_with_optimizer_state(monkeypatch, capsys):
    """The peak is reset right before the first step whose optimizer already has its state (not
    the first step of a fresh run, which creates it; the load's peak is forgotten), the three
    numbers are logged after that step and kept for the summary, once."""
    from types import SimpleNamespace

    from training import loop

    events = []
    monkeypatch.setattr(loop, "reset_peak", lambda device: events.append("reset"))
    measured = {"allocated_gib": 9.0, "planned_tensors_gib": 9.5, "tensors_plan_error": 0.056,
                "reserved_over_allocated": 1.04, "fragmentation_margin": 0.05, "num_alloc_retries": 0,
                "outside_allocator_gib": 1.1, "context_allowance_gib": 1.5}
    monkeypatch.setattr(loop, "calibration", lambda found, device: events.append("measure") or measured)
    optimizer = SimpleNamespace(state={})
    worker = SimpleNamespace(memory_calibration=None, memory_plan=object(), device=torch.device("cuda"),
                             optimizer=optimizer, calibrating=False, rank=0)
    for step in range(3):
        loop.calibrate_memory(worker, before_step=True)
        events.append(f"step {step}")
        optimizer.state = {"exp_avg": 1}  # AdamW's state exists after the first optimizer.step()
        loop.calibrate_memory(worker, before_step=False)
    assert events == ["step 0", "reset", "step 1", "measure", "step 2"]
    assert worker.memory_calibration == measured
    assert "9.00 GiB allocated against 9.50 planned for tensors (plan +6%)" in capsys.readouterr().out

"""LoRA's defaults, in one process on the tiny model (no workers, no Ray): the learning rate a LoRA
run takes, the output head refused as a target, the adapters' initialisation that leaves the
caller's random streams alone while dropout draws per rank, the FLOPs and bytes a frozen base
step costs, the exported adapter folder as PEFT, transformers and vLLM read it, the merge in
bf16 against fp32, and the base's Hub commit pinned."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

from training.config import (FULL_LEARNING_RATE, LORA_LEARNING_RATE, TrainConfig, learning_rate_notes, lora_problems,
                             parse_config)

LORA = {"peft": "lora", "lora_rank": 2, "lora_alpha": 4.0}


def _parse(*argv: str) -> TrainConfig:
    return parse_config(list(argv), storage_path="/tmp/runs", validate=False)


# ------------------------------------------------------------------ the learning rate


def test_a_lora_run_takes_loras_rate_unless_one_is_given():
    assert LORA_LEARNING_RATE == 3e-4 and FULL_LEARNING_RATE == 2e-5
    assert _parse().learning_rate == 2e-5  # a full fine-tune's default
    assert _parse("--peft", "lora").learning_rate == 3e-4
    # A full-fine-tune preset's rate (1e-5) is not LoRA's: the LoRA default instead.
    assert _parse("--preset", "qwen2.5-7b-l4x12").learning_rate == 1e-5
    assert _parse("--preset", "qwen2.5-7b-l4x12", "--peft", "lora").learning_rate == 3e-4
    assert _parse("--preset", "tiny-cpu", "--peft", "lora").learning_rate == 3e-4
    # A LoRA preset's rate is given for LoRA, and not for a full fine-tune of it.
    assert _parse("--preset", "qwen2.5-7b-lora-l4x8").learning_rate == 3e-4
    assert _parse("--preset", "qwen2.5-7b-lora-l4x8", "--peft", "none").learning_rate == 2e-5
    # The command line wins.
    assert _parse("--preset", "qwen2.5-7b-l4x12", "--peft", "lora", "--learning-rate", "1e-4").learning_rate == 1e-4
    # Built directly (the workers' from_dict, the tests), the same default; recorded as used.
    assert TrainConfig(peft="lora").learning_rate == 3e-4
    assert TrainConfig.from_dict(_parse("--peft", "lora").to_dict()).to_dict()["learning_rate"] == 3e-4


def test_the_driver_names_loras_default_and_warns_once_below_a_tenth_of_it():
    default = learning_rate_notes(_parse("--peft", "lora"))
    assert len(default) == 1 and "3e-04" in default[0] and "torchtune" in default[0] and "7B_lora.yaml" in default[0]
    low = learning_rate_notes(_parse("--peft", "lora", "--learning-rate", "1e-5"))
    assert len(low) == 1 and "warning" in low[0] and "learning_rate=1e-05" in low[0] and "3e-04" in low[0]
    assert "torchtune" in low[0]
    assert learning_rate_notes(_parse("--peft", "lora", "--learning-rate", "1e-4")) == []
    assert learning_rate_notes(_parse()) == []


# ------------------------------------------------------------------ the output head


def test_the_output_head_is_refused_as_a_target(tiny_dir):
    problems = lora_problems(TrainConfig(**LORA, lora_target_modules="q_proj,lm_head"))
    assert len(problems) == 1
    assert "lora_target_modules='q_proj,lm_head'" in problems[0] and "drop lm_head" in problems[0]
    from training.modeling.lora import LoraSettings
    from training.modeling.model import load_model

    # Where no config check ran (a model built directly): the model refuses it too.
    with pytest.raises(ValueError, match="output head"):
        load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=False,
                   lora=LoraSettings(rank=2, alpha=4.0, dropout=0.0, targets="q_proj,lm_head"))


# ------------------------------------------------------------------ random streams


def _lora_model(tiny_dir, *, dropout: float = 0.0, seed: int = 0):
    from training.modeling.lora import LoraSettings
    from training.modeling.model import load_model

    return load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=False,
                      lora=LoraSettings(rank=2, alpha=4.0, dropout=dropout), seed=seed)


def _adapters(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def test_the_adapters_init_leaves_the_callers_streams_alone(tiny_dir):
    """The same adapters from the same seed, whatever the caller's stream; the caller's CPU stream
    goes on where it was, and no CUDA generator is seeded (``torch.manual_seed`` would seed them all)."""
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with mock.patch("torch.cuda.manual_seed_all") as seed_all, mock.patch("torch.cuda.manual_seed") as seed_one:
        first = _adapters(_lora_model(tiny_dir, seed=7))
    assert not seed_all.called and not seed_one.called
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)
    second = _adapters(_lora_model(tiny_dir, seed=7))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_dropout_masks_are_each_ranks_own_and_come_back_with_the_stream(tiny_dir):
    from training.modeling.lora import seed_dropout

    model = _lora_model(tiny_dir, dropout=0.5)
    dropout = next(m for name, m in model.named_modules() if name.endswith("lora_dropout.default"))
    ones = torch.ones(4, 64)

    def masks(rank: int, state=None) -> tuple[torch.Tensor, torch.Tensor]:
        if state is None:
            seed_dropout(42, rank)
        else:
            torch.set_rng_state(state)  # what a resume does (training/storage/checkpoint.py rng_rank<k>.pt)
        return dropout(ones), dropout(ones)

    rank0, rank1 = masks(0), masks(1)
    assert not torch.equal(rank0[0], rank1[0])
    assert all(torch.equal(a, b) for a, b in zip(masks(0), rank0))
    seed_dropout(42, 1)
    dropout(ones)
    saved = torch.get_rng_state()  # a checkpoint after one step on rank 1
    assert torch.equal(masks(1, saved)[0], rank1[1])


# ------------------------------------------------------------------ FLOPs and bytes


def test_a_frozen_base_costs_four_flops_a_parameter_a_token():
    from training.telemetry.metrics import step_flops

    counts = {"num_layers": 0, "hidden_size": 0, "tokens": 1000, "trained_tokens": 250, "squared_lengths": 0}
    full = step_flops(decoder_params=10**9, head_params=10**8, **counts)
    assert full == 6 * 10**9 * 1000 + 6 * 10**8 * 250
    # LoRA: 1e9 frozen and 1e6 adapters: 4 x 1e9 + 6 x 1e6 per token, the frozen head 4 x 1e8 per trained token.
    lora = step_flops(decoder_params=10**9 + 10**6, head_params=10**8, frozen_decoder_params=10**9, frozen_head=True, **counts)
    assert lora == (4 * 10**9 + 6 * 10**6) * 1000 + 4 * 10**8 * 250
    # Attention has no weights: 12 x layers x hidden x length^2 either way.
    attention = {"num_layers": 2, "hidden_size": 8, "tokens": 0, "trained_tokens": 0, "squared_lengths": 100}
    assert step_flops(decoder_params=0, head_params=0, frozen_head=True, **attention) == 12 * 2 * 8 * 100


def test_the_flops_shape_of_a_lora_model_names_its_frozen_base(tiny_dir, tiny_model):
    from training.telemetry.metrics import flops_shape

    full = flops_shape(tiny_model)
    assert "frozen_decoder_params" not in full
    lora = flops_shape(_lora_model(tiny_dir))
    adapters = lora["decoder_params"] - full["decoder_params"]
    # rank 2 on the 7 linear layers of each of the tiny model's layers: 2 x (in + out) each
    assert adapters > 0 and lora["frozen_decoder_params"] == full["decoder_params"] and lora["frozen_head"] is True


def test_a_frozen_base_is_gathered_but_has_no_gradient_to_reduce():
    from training.modeling.traffic import step_traffic

    params, adapters = 1_000_000, 10_000
    full = step_traffic(params=params, num_workers=4, workers_per_node=4, accumulation=1, hsdp=False)
    lora = step_traffic(params=params, num_workers=4, workers_per_node=4, accumulation=1, hsdp=False, trainable_params=adapters)
    assert full.within_node == pytest.approx(3 / 4 * (2 * 2 + 4) * params)
    assert lora.within_node == pytest.approx(3 / 4 * (2 * 2 * params + 4 * adapters))
    hsdp = step_traffic(params=params, num_workers=8, workers_per_node=4, accumulation=2, hsdp=True, trainable_params=adapters)
    assert hsdp.cross_node == pytest.approx(2 * (1 / 2) * 4 * adapters / 4)  # the adapters' gradient shards alone

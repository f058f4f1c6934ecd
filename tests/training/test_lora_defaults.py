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
    # LoRA DPO: the reference pass (the base alone, forward) adds 2 per frozen weight per token, the head's 2 per
    # trained token and attention's forward third.
    dpo = step_flops(decoder_params=10**9 + 10**6, head_params=10**8, frozen_decoder_params=10**9, frozen_head=True,
                     reference_forward=True, **counts)
    assert dpo == lora + 2 * 10**9 * 1000 + 2 * 10**8 * 250
    assert step_flops(decoder_params=0, head_params=0, reference_forward=True, **attention) == (12 + 4) * 2 * 8 * 100


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


# ------------------------------------------------------------------ the exported adapter


def _trained_like(model, seed: int = 3, scale: float = 0.3) -> None:
    """Adapters away from PEFT's zero B, as training leaves them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    """The tiny base as a Qwen2.5 base is (its tokenizer's EOS the end of text, no EOS in its generation
    config, weights bf16-exact as a bf16 checkpoint's), and its trained-like adapter exported as a run
    exports it, with the merged model in bf16 and in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.modeling.lora import adapter_state, export_lora, export_merged
    from training.modeling.export import stopping_generation_config

    root = tmp_path_factory.mktemp("lora-export")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    base.save_pretrained(root / "base")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(root / "base")
    model = _lora_model(root / "base")
    _trained_like(model)
    state = adapter_state(model, rank=0)
    export_lora(model, tokenizer=tokenizer, rank=0, uri=str(root / "final"), merged_uri=str(root / "merged-bf16"),
                base_dir=str(root / "base"), base_name=str(root / "base"), dtype=torch.bfloat16, revision="a" * 40)
    export_merged(base_dir=str(root / "base"), adapter_dir=str(root / "final"), local=str(root / "merged-fp32"),
                  tokenizer=tokenizer, dtype=torch.float32,
                  generation_config=stopping_generation_config(model.lm.generation_config, tokenizer))
    return root, state, tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_the_gathered_adapter_state_holds_no_frozen_key(exported):
    _, state, _ = exported
    assert state and all("lora_A" in key or "lora_B" in key for key in state), sorted(state)[:5]


def test_the_adapter_folder_stops_at_the_end_of_a_turn_as_each_reader_reads_it(exported):
    """What each reader takes: PEFT's ``PeftModel.from_pretrained`` and transformers'
    ``from_pretrained`` of the adapter folder keep the base's generation config (transformers loads
    it from the base's path: modeling_utils.py passes ``adjust_generation_fn`` the path
    ``maybe_load_adapters`` returned); vLLM reads ``GenerationConfig.from_pretrained(--generation-config,
    else the served model)`` (vllm/config/model.py ``ModelConfig.try_get_generation_config``,
    vllm/transformers_utils/config.py ``try_get_generation_config``), never the adapter's; every one
    reads the folder's file when pointed at it, and its tokenizer's EOS is the end of a turn."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    root, _, end_of_turn = exported
    final = str(root / "final")

    def eos(generation) -> list:
        value = generation.eos_token_id
        return value if isinstance(value, list) else [value]

    def vllm_reader(model: str):  # vllm/transformers_utils/config.py try_get_generation_config, without GGUF
        try:
            return GenerationConfig.from_pretrained(model)
        except OSError:
            return None

    assert end_of_turn in eos(GenerationConfig.from_pretrained(final))
    assert AutoTokenizer.from_pretrained(final).eos_token == "<|im_end|>"
    assert AutoTokenizer.from_pretrained(str(root / "merged-bf16")).eos_token == "<|im_end|>"
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(root / "base")), final)
    direct = AutoModelForCausalLM.from_pretrained(final)
    for model in (peft_model, direct):  # the base's: the folder's must be set (docs: fine-tuning)
        assert end_of_turn not in eos(model.generation_config)
        model.generation_config = GenerationConfig.from_pretrained(final)
        assert end_of_turn in eos(model.generation_config)
    assert end_of_turn not in eos(vllm_reader(str(root / "base")) or GenerationConfig())  # vllm serve <base>
    assert end_of_turn in eos(vllm_reader(final))  # vllm serve <base> --generation-config <final>
    assert end_of_turn in eos(vllm_reader(str(root / "merged-bf16")))  # vllm serve <final-merged>
    # generate stops there: the end-of-turn token forced as the first new token ends the answer.
    forced = torch.nn.functional.one_hot(torch.tensor(end_of_turn), direct.config.vocab_size).float()
    out = direct.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False,
                          logits_processor=[lambda ids, scores: scores + 1e4 * forced])
    assert out.shape[1] == 4 and out[0, -1] == end_of_turn


def test_adapter_config_names_the_base_and_its_commit(exported):
    from training.modeling.lora import adapter_base_name

    root, _, _ = exported
    config = json.loads((root / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(root / "base") and config["revision"] == "a" * 40
    assert adapter_base_name("Qwen/Qwen2.5-7B", "/cache/x") == "Qwen/Qwen2.5-7B"
    assert adapter_base_name("tiny:qwen2", "/cache/x") == "/cache/x"
    assert adapter_base_name(str(root / "base"), str(root / "base")) == str(root / "base")
    assert adapter_base_name("s3://bucket/models/base", "/cache/x") == "s3://bucket/models/base"


def merge_distance(root, merged: str, *, dtype: torch.dtype) -> tuple[float, float]:
    """The merged model (computed in ``dtype``) against the adapter model in fp32: the largest
    absolute logit difference, and the share of positions whose top-1 token agrees."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.float32),
                                        str(root / "final")).eval()
    model = AutoModelForCausalLM.from_pretrained(str(root / merged), dtype=dtype).eval()
    inputs = torch.randint(3, 380, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapter(input_ids=inputs).logits
        got = model(input_ids=inputs).logits.float()
    return (got - expected).abs().max().item(), (got.argmax(-1) == expected.argmax(-1)).float().mean().item()


def test_an_fp32_merge_is_the_adapter_model_and_a_bf16_one_within_its_bound(exported):
    """Measured here: the fp32 merge 1.3e-6 off the adapter model, top-1 all the same; the bf16 merge
    0.018 computed in fp32 (its rounding alone) and 0.031 in bf16 (as served), top-1 99.2% the same
    (pytorch/torchtune#1101: expected). The bf16 bounds are about 10x the measured."""
    root, _, _ = exported
    assert json.loads((root / "merged-fp32" / "config.json").read_text())["dtype"] == "float32"
    fp32, agree32 = merge_distance(root, "merged-fp32", dtype=torch.float32)
    bf16, agree16 = merge_distance(root, "merged-bf16", dtype=torch.float32)
    served, agree_served = merge_distance(root, "merged-bf16", dtype=torch.bfloat16)
    print(f"fp32 merge {fp32:.2e} ({agree32:.1%} top-1); bf16 merge in fp32 {bf16:.2e} ({agree16:.1%}); "
          f"bf16 merge in bf16 {served:.2e} ({agree_served:.1%})")
    assert fp32 < 1e-4 and agree32 == 1.0
    assert bf16 < 0.2 and served < 0.5


# ------------------------------------------------------------------ the base's commit


class FakeHub:
    """``huggingface_hub.HfApi`` resolving branches to commits, offline; counts its calls."""

    heads = {"main": "1" * 40, "v2": "2" * 40}
    calls: list = []

    def model_info(self, repo_id, revision=None):
        FakeHub.calls.append((repo_id, revision))
        return mock.Mock(sha=self.heads[revision or "main"])


def test_a_hub_base_is_pinned_to_its_commit_and_a_resume_reloads_it(monkeypatch, tmp_path):
    import huggingface_hub

    from training import train
    from training.storage import sources

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    FakeHub.calls = []
    model = "Qwen/Qwen2.5-7B"
    assert sources.pinned_revision(model, None, {}) == "1" * 40  # the main branch's commit now
    assert sources.pinned_revision(model, "v2", {}) == "2" * 40
    assert sources.pinned_revision(model, None, {"model": model, "model_revision": "3" * 40}) == "3" * 40  # a resume
    assert sources.pinned_revision(model, None, {"model": "other/model", "model_revision": "3" * 40}) == "1" * 40
    assert sources.pinned_revision("tiny:qwen2", None, {}) is None
    assert len(FakeHub.calls) == 3  # a commit is not looked up
    # The driver: the commit recorded in the run's run.json is the one the resume reads.
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps({"max_position_embeddings": 4096}))
    fetched = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, name, revision=None: fetched.append(revision) or str(config_json))
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "run.json").write_text(json.dumps({"model": model, "model_revision": "4" * 40}))
    config = TrainConfig(model=model, storage_path=str(tmp_path / "runs"), run_name="r", peft="lora", gpu_type=None)
    assert train.check_model(config).model_revision == "4" * 40 and fetched == ["4" * 40]
    fresh = TrainConfig(model=model, storage_path=str(tmp_path / "runs"), run_name="new", gpu_type=None)
    assert train.check_model(fresh).model_revision == "1" * 40


def test_a_dpo_run_takes_dpos_rate_unless_one_is_given_and_a_lora_dpo_rate_is_not_warned_about():
    """TRL's scripts/dpo.py: 5e-7 in full; an SFT preset's rate is not a DPO run's."""
    assert _parse("--objective", "dpo").learning_rate == 5e-7
    assert _parse("--preset", "tiny-cpu-dpo").learning_rate == 3e-3  # the DPO preset's own rate
    notes = learning_rate_notes(_parse("--objective", "dpo", "--peft", "lora"))
    assert len(notes) == 1 and "1.25e-06" in notes[0] and "LoRA DPO's default" in notes[0] and "dpo.py" in notes[0]
    low = learning_rate_notes(_parse("--objective", "dpo", "--peft", "lora", "--learning-rate", "1e-7"))
    assert "warning" in low[0] and "LoRA DPO's default 1.25e-06" in low[0]


def test_lora_dpos_default_rate_is_trls_scaled_from_its_adapter_scale_to_the_runs():
    """TRL's scripts/dpo.py trains LoRA DPO at 5e-6 with rank 32, alpha 16 (scale 0.5); an adapter's step
    is about the rate times alpha / rank, so at our rank 8, alpha 16 (scale 2) TRL's step is 1.25e-6, and
    at TRL's own shape it is TRL's 5e-6."""
    assert _parse("--objective", "dpo", "--peft", "lora").learning_rate == pytest.approx(1.25e-6)
    assert _parse("--preset", "qwen2.5-7b-lora-l4x8", "--objective", "dpo").learning_rate == pytest.approx(1.25e-6)
    assert _parse("--objective", "dpo", "--peft", "lora", "--lora-rank", "32").learning_rate == pytest.approx(5e-6)
    note = learning_rate_notes(_parse("--objective", "dpo", "--peft", "lora", "--lora-rank", "32"))[0]
    assert "5e-06 at its adapter scale 0.5 (rank 32, alpha 16), scaled to this run's 0.5 (alpha 16 / rank 32)" in note


def test_offline_a_hub_base_is_pinned_to_the_commit_of_its_cached_copy(monkeypatch, tmp_path):
    """With HF_HUB_OFFLINE=1 the Hub is not asked: the local cache's snapshot of the branch names the commit."""
    import huggingface_hub
    from huggingface_hub import constants

    from training.storage import sources

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: pytest.fail("the Hub asked while offline"))
    asked = []

    def snapshot_download(repo, revision=None, local_files_only=False, allow_patterns=None):
        asked.append((repo, revision, local_files_only))
        return str(tmp_path / "models--Qwen--Qwen2.5-7B" / "snapshots" / ("5" * 40))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert sources.pinned_revision("Qwen/Qwen2.5-7B", None, {}) == "5" * 40
    assert asked == [("Qwen/Qwen2.5-7B", None, True)]


def test_the_driver_says_what_a_merge_takes_of_rank_0s_host_before_the_run():
    from training.train import merge_notes

    qwen32 = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
              "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "tie_word_embeddings": False,
              "max_position_embeddings": 32768}
    fp32 = merge_notes(TrainConfig(**LORA, model="Qwen/Qwen2.5-32B", merge_lora=True, merge_lora_dtype="fp32"), qwen32)
    assert len(fp32) == 1 and "131 GB" in fp32[0] and "--merge-lora-dtype bf16 halves it" in fp32[0]
    assert merge_notes(TrainConfig(**LORA, model="Qwen/Qwen2.5-32B", merge_lora=True, merge_lora_dtype="bf16"), qwen32) == []
    assert merge_notes(TrainConfig(**LORA, model="Qwen/Qwen2.5-32B"), qwen32) == []  # no merge

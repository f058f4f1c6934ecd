"""The memory plan: parameter counts as the models have them, the sharded states as FSDP2
allocates them (measured on 2 gloo workers), the stop before Ray starts and at synth, the
fixes it names, HSDP giving way where its shard group has no room, and its command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from processes import run_workers

from training.modeling.plan import (
    GIB,
    DoesNotFit,
    Options,
    check,
    choose_fastest,
    choose_sharding,
    job_options,
    plan,
)

from training.modeling.shapes import KNOWN_MODELS, TABLE_MODELS, ModelShape, sharded_numel
from training.presets import PRESET_GPUS

ROOT = Path(__file__).resolve().parents[2]
L4_DEFAULT = Options(num_workers=8, workers_per_node=4, shard_size=4, micro_batch_size=4, seq_len=2048)


def test_known_models_have_their_published_parameter_counts():
    # Model cards: Qwen2.5-7B "7.61B", Qwen2.5-1.5B "1.54B", Llama 3.1 8B "8.03B" (exact counts from safetensors' metadata).
    assert KNOWN_MODELS["Qwen/Qwen2.5-7B"].parameters == 7_615_616_512
    assert KNOWN_MODELS["Qwen/Qwen2.5-1.5B"].parameters == 1_543_714_304
    assert KNOWN_MODELS["meta-llama/Llama-3.1-8B"].parameters == 8_030_261_248
    # Hub pages' sizes (safetensors): Qwen2.5-72B "72.7B", Llama-3.1-70B "70.6B", gemma-2-9b "9.24B",
    # Phi-3-mini "3.82B", Qwen3-8B "8.19B".
    published = {"Qwen/Qwen2.5-72B": 72.7, "meta-llama/Llama-3.1-70B": 70.6, "google/gemma-2-9b": 9.24,
                 "microsoft/Phi-3-mini-4k-instruct": 3.82, "Qwen/Qwen3-8B": 8.19}
    for name, billions in published.items():
        digits = len(str(billions).split(".")[1])
        assert round(KNOWN_MODELS[name].parameters / 1e9, digits) == billions, name


def test_every_known_model_counts_what_transformers_builds_from_its_shape():
    """Each row of the table, as its family's transformers model built on the meta device (no
    memory): the plan counts every parameter it has (q/k norms, Gemma's four norms, biases, ties)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for name, shape in TABLE_MODELS.items():
        fields = {"hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
                  "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
                  "tie_word_embeddings": shape.tied, **({"head_dim": shape.head_dim} if shape.head_dim else {})}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(shape.family, **fields))
        assert shape.parameters == sum({id(p): p.numel() for p in model.parameters()}.values()), name
        assert ModelShape.from_config(model.config.to_dict(), name=name).parameters == shape.parameters, name
    # Every post-trained release is its base's shape, under its own name and source.
    assert KNOWN_MODELS["mistralai/Mistral-7B-Instruct-v0.3"].parameters == TABLE_MODELS["mistralai/Mistral-7B-v0.3"].parameters
    assert KNOWN_MODELS["google/gemma-2-9b-it"].source == "https://huggingface.co/google/gemma-2-9b-it/blob/main/config.json"
    assert "mistralai/Mistral-7B-v0.3-Instruct" not in KNOWN_MODELS  # no such release


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_the_shape_from_a_config_counts_what_transformers_builds(tiny_dir, kind):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if kind == "qwen2":
        config = AutoConfig.from_pretrained(str(tiny_dir))
    else:
        config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert ModelShape.from_config(config.to_dict()).parameters == sum(unique.values())


def _fsdp_worker(rank: int, world: int, tiny_dir: str, workdir: str) -> None:
    import torch.distributed as dist

    from training.modeling.step import train_step
    from training.modeling.model import load_model
    from training.modeling.parallel import apply_fsdp, build_mesh
    from training.modeling.plan import ModelShape, Options, plan

    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = load_model(tiny_dir, attn_implementation="sdpa", activation_checkpointing=False)
    shape = ModelShape.from_config(model.config.to_dict())
    apply_fsdp(model, mesh=build_mesh(device_type="cpu", world_size=world, shard_size=world), mixed_precision="fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    batch = type("B", (), {"inputs": {"input_ids": ids, "position_ids": torch.arange(64)[None]}, "labels": ids,
                           "trained_positions": torch.arange(63)})()
    train_step(model, [batch], normaliser=63.0, cross_node_sync=False)
    optimizer.step()

    def local_bytes(tensors) -> int:
        return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
                   for t in tensors)

    measured = {
        "parameters (sharded, fp32)": local_bytes(model.parameters()),
        "gradients (sharded, fp32)": local_bytes(p.grad for p in model.parameters()),
        "optimizer (AdamW, fp32)": local_bytes(s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")),
    }
    planned = plan(shape, "L4", Options(num_workers=world, workers_per_node=world, shard_size=world, micro_batch_size=1,
                                        seq_len=64, mixed_precision="fp32", activation_checkpointing=False)).terms
    if rank == 0:
        Path(workdir, "result.json").write_text(json.dumps({"measured": measured, "planned": {k: planned[k] for k in measured}}))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_the_planned_states_are_what_fsdp2_allocates_on_two_workers(tiny_dir, tmp_path):
    """Rank 0's sharded parameters, gradients and AdamW state after a real step, byte for byte."""
    run_workers(_fsdp_worker, args=(2, str(tiny_dir), str(tmp_path)), nprocs=2)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["measured"] == result["planned"]
    assert result["measured"]["parameters (sharded, fp32)"] > 0


#: The configurations the plan is checked at, at the models' real widths and depths: the default 1.5B
#: preset as HSDP 4 x 2 with no accumulation; 7B sharded over 12 ranks and Llama 3.1 8B over 8, each
#: with two micro-steps (HSDP's and FSDP's gradient accumulation).
FAKE_STEP_CASES = {
    "Qwen2.5-1.5B, HSDP 4x2, 8x2048": ("Qwen/Qwen2.5-1.5B", 28, 8, 4, 8, 2048, 1),
    "Qwen2.5-7B, FSDP over 12, 2 micro-steps of 1x2048": ("Qwen/Qwen2.5-7B", 28, 12, 12, 1, 2048, 2),
    "Llama-3.1-8B, FSDP over 8, 2 micro-steps of 4x2048": ("meta-llama/Llama-3.1-8B", 32, 8, 8, 4, 2048, 2),
    # LoRA: the bf16 base frozen, fp32 adapters of rank 16 on every linear layer with dropout (their
    # masks and dropped inputs), no activation checkpointing: every activation the adapters add; as
    # DPO, each micro-batch's reference forward first, the adapters off and no gradient.
    "Qwen2.5-7B LoRA r16 dropout DPO, HSDP 4x2, 4x2048, no checkpointing":
        ("Qwen/Qwen2.5-7B", 28, 8, 4, 4, 2048, 1, False, 1024, 16, 0.05, "dpo"),
}


def test_the_live_bytes_counter_counts_storages_once_frees_them_and_follows_fsdp_resizes():
    from fake_step_memory import LiveBytes

    tracker = LiveBytes()
    with tracker.counting():
        tracker.label("first")
        a = torch.empty(1024, dtype=torch.float32)
        view = a.view(32, 32)  # a view: the same storage, counted once
        b = torch.empty(2048, dtype=torch.bfloat16)
        assert tracker.total == 8192
        del a, view
        assert tracker.total == 4096
        tracker.label("second")
        b.untyped_storage().resize_(0)  # what FSDP2's free_storage does to a gathered parameter
        assert tracker.total == 0
        b.untyped_storage().resize_(4096)
        assert tracker.total == 4096
        with tracker.suspend():
            ignored = torch.empty(4096)
        assert tracker.total == 4096 and ignored.numel() == 4096
    assert tracker.peaks == {"first": 8192, "second": 4096}


@pytest.mark.parametrize("case", FAKE_STEP_CASES, ids=list(FAKE_STEP_CASES))
def test_each_moment_of_the_plan_is_what_the_project_step_holds_at_real_sizes(case):
    """The project's load and training step at the real shapes on one rank, with fake tensors and
    a fake process group (tests/training/fake_step_memory.py says what runs and where it differs from
    a GPU): every moment of the plan within 10% of the bytes alive in it, in both directions, none more
    than 2% under, and the plan's peak within 10% of the step's (bench/plan_vs_fake_memory.py: every
    GPU preset's). About 9 s each, the DPO case 13 s."""
    from fake_step_memory import Case, ratios

    found = ratios(Case(*FAKE_STEP_CASES[case]))
    report = "; ".join(f"{name} planned {p:.3f} GiB, measured {m:.3f} GiB" for name, (p, m, _) in found.items())
    for name, (planned_gib, measured_gib, ratio) in found.items():
        assert 0.98 <= ratio <= 1.1, f"{name}: {report}"
    # The load and the root's reduce within 0.2%: their tensors are sizes, not lifetimes.
    assert found["load"][2] == pytest.approx(1, abs=2e-3) and found["root reduce"][2] == pytest.approx(1, abs=2e-3)


def test_the_default_fits_and_a_7b_model_does_not_fit_eight_l4s_naming_what_would():
    assert check(KNOWN_MODELS["Qwen/Qwen2.5-1.5B"], "L4", L4_DEFAULT).fits
    with pytest.raises(DoesNotFit) as stopped:
        check(KNOWN_MODELS["Qwen/Qwen2.5-7B"], "L4", L4_DEFAULT)
    message = str(stopped.value)
    assert message.startswith("Qwen/Qwen2.5-7B does not fit 8 x L4: 42.1 GiB per GPU planned, 22.5 GiB there")
    assert "3 GPU nodes with --no-hsdp" in message and "-c gpuNodeCount=3" in message
    # Every fix it names does fit.
    three_nodes = replace(L4_DEFAULT, num_workers=12, shard_size=12)
    assert plan(KNOWN_MODELS["Qwen/Qwen2.5-7B"], "L4", three_nodes).fits


def test_fixes_come_cheapest_first_and_each_one_fits():
    model = KNOWN_MODELS["Qwen/Qwen2.5-3B"]
    tight = replace(L4_DEFAULT, activation_checkpointing=False)
    with pytest.raises(DoesNotFit) as stopped:
        check(model, "L4", tight)
    fixes = stopped.value.suggestions
    assert fixes[0].startswith("--activation-checkpointing") or fixes[0].startswith("--no-hsdp")
    for text in fixes:
        assert float(text.rsplit(": ", 1)[1].split()[0]) <= 22.49 / 1.0


def test_hsdp_gives_way_to_full_sharding_only_when_it_is_the_default_and_has_no_room():
    model = KNOWN_MODELS["Qwen/Qwen2.5-7B"]
    chosen, why = choose_sharding(model, "A100", L4_DEFAULT, hsdp_asked=None)
    assert chosen.shard_size == 8 and "sharding over all 8 workers instead" in why
    assert choose_sharding(model, "A100", L4_DEFAULT, hsdp_asked=True) == (L4_DEFAULT, None)
    assert choose_sharding(KNOWN_MODELS["Qwen/Qwen2.5-1.5B"], "L4", L4_DEFAULT, hsdp_asked=None) == (L4_DEFAULT, None)


def test_the_driver_stops_before_ray_starts_when_the_plan_does_not_fit(monkeypatch):
    from training import train
    from training.config import ConfigError, parse_config

    started = []
    monkeypatch.setattr(train, "start_ray", lambda config: started.append(config))
    config = parse_config(["--model", "Qwen/Qwen2.5-7B", "--gpu-type", "L4"], storage_path="s3://bucket/runs", validate=False)
    seven_b = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
               "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
    with pytest.raises(ConfigError, match=r"memory: Qwen/Qwen2\.5-7B does not fit 8 x L4.*3 GPU nodes with --no-hsdp"):
        train.plan_memory(config, seven_b)
    # On A100s HSDP, only the default, gives way to full sharding, which fits.
    a100 = replace(config, gpu_type="A100")
    assert train.plan_memory(a100, seven_b).hsdp is False
    # LoRA: the same 7B fits the 8 L4s; a target the model lacks stops the run, naming its layers.
    lora = replace(config, peft="lora")
    assert train.plan_memory(lora, seven_b).micro_batch_size == 8
    with pytest.raises(ConfigError, match=r"c_attn is not a linear layer of Qwen/Qwen2\.5-7B's decoder layers"):
        train.plan_memory(replace(lora, lora_target_modules="c_attn"), seven_b)
    assert not started


def test_a_32b_lora_fits_the_default_l4s_sharded_over_all_workers_where_hsdp_fits_no_micro_batch():
    """Qwen2.5-32B under LoRA on 8 L4: its bf16 base over a node's 4 GPUs is 15.3 GiB before anything
    else, so HSDP fits no micro-batch; sharded over all 8 with micro-batch 2 it fits (the preset)."""
    from training.config import parse_config

    model = KNOWN_MODELS["Qwen/Qwen2.5-32B"]
    options, chosen = job_options(model, "L4", parse_config(["--peft", "lora", "--model", "Qwen/Qwen2.5-32B"],
                                                            storage_path="s3://bucket/runs"))
    assert (options.shard_size, options.micro_batch_size) == (8, 2)
    assert chosen[0] == "HSDP (shard 4) fits no micro-batch on L4; sharding over all 8 workers instead"
    found = plan(model, "L4", options)
    base = model.layers * sharded_numel(model.layer_parameter_shapes(), 8) + sharded_numel(model.root_parameter_shapes(), 8)
    assert found.fits and found.terms["base (sharded, frozen, bf16)"] == 2 * base
    preset = plan(model, "L4", Options.of(parse_config(["--preset", "qwen2.5-32b-lora-l4x8"], storage_path="s3://bucket/runs")))
    assert preset.fits and preset.needed == found.needed
    # A checkpoint: rank 8 on all seven linear layers of 64, fp32 with AdamW's two states.
    per_layer = sum(8 * (out + inp) for out, inp in model.linear_shapes().values())
    assert found.checkpoint_bytes == 12 * 64 * per_layer and found.checkpoint_bytes < 0.01 * found.full_checkpoint_bytes


def test_synth_refuses_a_model_that_cannot_fit_and_takes_the_presets_that_do():
    from ray_train_eks.config import ConfigError, PlatformConfig

    with pytest.raises(ConfigError, match=r"trainingArgs='--model Qwen/Qwen2\.5-7B' on 2 x g6\.12xlarge: Qwen/Qwen2\.5-7B "
                                          r"does not fit 8 x L4.*-c gpuNodeCount=3"):
        PlatformConfig.from_context({"trainingArgs": "--model Qwen/Qwen2.5-7B"}, environ={})
    PlatformConfig.from_context({"trainingArgs": "--preset qwen2.5-7b-l4x12", "gpuNodeCount": "3"}, environ={})
    PlatformConfig.from_context({"trainingArgs": "--preset qwen2.5-7b-h100x8", "gpuInstanceType": "p5.48xlarge",
                                 "gpuNodeCount": "1"}, environ={})
    # A model the plan does not know is planned when the job starts, not refused.
    PlatformConfig.from_context({"trainingArgs": "--model someone/unknown-model"}, environ={})


@pytest.mark.parametrize("preset", list(PRESET_GPUS))
def test_every_gpu_preset_fits_its_gpus(preset):
    from training.config import parse_config

    gpu, nodes, objective = PRESET_GPUS[preset]
    config = parse_config(["--preset", preset, "--gpu-type", gpu], storage_path="s3://bucket/runs")
    assert config.num_nodes == nodes
    model = KNOWN_MODELS[config.model]
    options, _ = job_options(model, gpu, config)
    # A DPO preset as DPO (the objective is not a preset key yet: Options.of reads it when it is).
    found = check(model, gpu, replace(options, objective=objective))
    assert found.headroom > 1 * GIB
    if objective == "dpo":
        assert found.reference == "adapters off (no copy)" and "reference forward (adapters off)" in found.moments
        assert found.moments["reference forward (adapters off)"] != found.terms  # never the peak
        assert "DPO (sigmoid), reference: adapters off (no copy)" in found.table().splitlines()[0]


def test_the_plan_reads_the_objective_and_names_the_reference():
    """``--objective`` and ``--dpo-loss`` of the run's options: LoRA DPO runs a reference forward with
    the adapters off, a full fine-tune's DPO a pass before training with no AdamW state, SimPO none."""
    from training.config import parse_config

    def options(*argv):
        return Options.of(parse_config(["--preset", "qwen2.5-7b-h100x8", *argv], storage_path="s3://bucket/runs").with_defaults())

    assert options().objective == "sft" and options().reference == "none"
    qwen7 = KNOWN_MODELS["Qwen/Qwen2.5-7B"]
    full = options("--objective", "dpo")
    assert (full.objective, full.dpo_loss, full.reference) == ("dpo", "sigmoid", "precomputed before training")
    found = plan(qwen7, "H100", full)
    reference = found.moments["reference pass (before training)"]
    assert not any(name.startswith(("optimizer", "gradients")) for name in reference)
    assert sum(reference.values()) < found.peak and found.peak == plan(qwen7, "H100", replace(full, objective="sft")).peak
    assert options("--objective", "dpo", "--peft", "lora").reference == "adapters off (no copy)"
    simpo = options("--objective", "dpo", "--dpo-loss", "simpo")
    assert simpo.reference == "none" and not any(m.startswith("reference") for m in plan(qwen7, "H100", simpo).moments)
    assert plan(qwen7, "H100", simpo).to_dict()["reference"] == "none"


def test_python_m_training_plan_prints_the_table_and_the_fixes():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "training.modeling.plan", "--model", "Qwen/Qwen2.5-1.5B", "--gpu-type", "L4"],
                        capture_output=True, text=True, env=env, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert "memory plan: Qwen/Qwen2.5-1.5B (1.54 B parameters) on 8 x L4" in ok.stdout
    assert "activations" in ok.stdout and "fits," in ok.stdout
    # Every moment, and the one that is the peak; the choice for what the options left open.
    for moment in ("load", "loss backward", "last layer's backward", "root reduce"):
        assert f"  {moment}" in ok.stdout
    assert "(the peak)" in ok.stdout and "[plan] chose activation checkpointing" in ok.stdout
    too_big = subprocess.run([sys.executable, "-m", "training.modeling.plan", "--model", "Qwen/Qwen2.5-7B", "--gpu-type", "L4"],
                             capture_output=True, text=True, env=env, cwd=ROOT)
    assert too_big.returncode == 1
    assert "does NOT fit" in too_big.stdout and "  fix: 3 GPU nodes with --no-hsdp" in too_big.stdout


def test_the_readme_table_is_what_the_plan_says():
    from training.modeling.plan import fit_table

    assert f"<!-- memory table: python -m training.modeling.plan --table -->\n{fit_table()}<!-- end of memory table -->" in \
        (ROOT / "docs" / "how-training-works.md").read_text(), "docs/how-training-works.md's memory table is stale: paste python -m training.modeling.plan --table"


def _job(*args: str):
    from training.config import parse_config

    return parse_config(["--storage-path", "s3://bucket/runs", *args])


def test_the_plan_picks_the_fastest_configuration_that_fits_where_the_options_leave_it_open():
    """Activation checkpointing off where it fits (with room to spare and two sequences a forward),
    the largest micro-batch that fits and divides the global batch; what the user gave is kept."""
    qwen7 = KNOWN_MODELS["Qwen/Qwen2.5-7B"]
    # 7B on one node of 8 H200: no recomputation, 8 sequences a forward, no accumulation.
    options, chosen = job_options(qwen7, "H200", _job("--num-workers", "8", "--workers-per-node", "8"))
    assert (options.activation_checkpointing, options.micro_batch_size) == (False, 8)
    assert chosen and chosen[0].startswith("chose activation checkpointing off, micro-batch 8 (1 accumulation step)")
    # The default on 8 L4s: checkpointing stays on (off would leave 0.5 GiB), micro-batch 8.
    options, _ = job_options(KNOWN_MODELS["Qwen/Qwen2.5-1.5B"], "L4", _job())
    assert (options.activation_checkpointing, options.micro_batch_size) == (True, 8)
    # Every choice fits with a tenth of the GPU to spare beyond the plan's own margin.
    for model, gpu, job in [(qwen7, "H200", _job("--num-workers", "8", "--workers-per-node", "8")),
                            (KNOWN_MODELS["Qwen/Qwen2.5-1.5B"], "L4", _job()), (qwen7, "H100", _job("--preset", "qwen2.5-7b-h100x8"))]:
        found = plan(model, gpu, job_options(model, gpu, job)[0])
        assert found.fits and found.headroom >= 0.10 * found.capacity
    # An option given is kept: the plan chooses only the other.
    options, _ = job_options(qwen7, "H200", _job("--num-workers", "8", "--workers-per-node", "8", "--activation-checkpointing"))
    assert (options.activation_checkpointing, options.micro_batch_size) == (True, 8)
    options, chosen = job_options(qwen7, "H200", _job("--num-workers", "8", "--workers-per-node", "8", "--micro-batch-size", "2",
                                                      "--no-activation-checkpointing"))
    assert (options.activation_checkpointing, options.micro_batch_size, chosen) == (False, 2, [])
    # The micro-batch divides the global batch per worker: 48 over 12 workers is 4 each, so not 8.
    options, _ = job_options(qwen7, "H200", _job("--num-workers", "12", "--workers-per-node", "4", "--global-batch-size", "48"))
    assert options.micro_batch_size == 4


def test_nothing_fits_keeps_the_options_as_without_a_plan_for_the_refusal():
    options, chosen = choose_fastest(KNOWN_MODELS["Qwen/Qwen2.5-32B"], "L4", L4_DEFAULT, checkpointing_asked=None,
                                     micro_batch_asked=None, global_batch_size=64)
    assert (options, chosen) == (L4_DEFAULT, None)


def test_the_driver_runs_what_the_plan_chose(capsys):
    """training/train.py plan_memory: the job's config takes the chosen values, and the log says so."""
    from training.train import plan_memory

    qwen15 = {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
              "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 32768}
    config = plan_memory(_job("--gpu-type", "H200", "--num-workers", "8", "--workers-per-node", "8"), qwen15)
    assert (config.activation_checkpointing, config.micro_batch_size, config.grad_accum_steps) == (False, 8, 1)
    out = capsys.readouterr().out
    assert "[plan] chose activation checkpointing off, micro-batch 8" in out
    assert "micro-batch 8 x 2048, activation checkpointing off" in out  # the plan printed is the one that runs
    # No plan (CPU): as before, checkpointing on and micro-batch 4.
    cpu = plan_memory(_job("--no-use-gpu", "--mixed-precision", "fp32"), qwen15)
    assert (cpu.activation_checkpointing, cpu.micro_batch_size) == (True, 4)

"""Every training configuration rule, with its message; the command line and presets."""

from __future__ import annotations

import pytest

from training.config import PRESETS, ConfigError, TrainConfig, parse_config

TINY = ["--preset", "tiny-cpu", "--storage-path", "/tmp/runs"]


def problems(**overrides) -> list[str]:
    values = {**PRESETS["tiny-cpu"], "preset": "tiny-cpu", "storage_path": "/tmp/runs", **overrides}
    return TrainConfig(**values).problems()


def test_presets_are_valid():
    assert parse_config(TINY).num_workers == 2
    production = parse_config(["--storage-path", "s3://bucket/runs"])
    assert (production.model, production.num_workers, production.mixed_precision) == ("Qwen/Qwen2.5-1.5B", 8, "bf16")
    # Left to the memory plan (training/train.py plan_memory); without a plan, micro-batch 4 and checkpointing.
    assert (production.micro_batch_size, production.activation_checkpointing) == (None, None)
    resolved = production.with_defaults()
    assert (resolved.micro_batch_size, resolved.grad_accum_steps, resolved.activation_checkpointing) == (4, 2, True)
    # Two nodes of four: HSDP by default, shard inside the node.
    assert production.use_hsdp and production.shard_size == 4
    single_node = parse_config(["--storage-path", "s3://bucket/runs", "--num-workers", "4"])
    assert not single_node.use_hsdp and single_node.shard_size == 4
    assert not parse_config(["--storage-path", "s3://bucket/runs", "--no-hsdp"]).use_hsdp


def test_every_field_is_a_command_line_option(tmp_path):
    (tmp_path / "d.jsonl").write_text("{}\n")
    config = parse_config(TINY + ["--max-steps", "7", "--num-workers", "4", "--global-batch-size", "32", "--model", "m",
                                  "--dataset", str(tmp_path / "d.jsonl"), "--workers-per-node", "4", "--no-activation-checkpointing", "--max-samples", "none"])
    assert (config.max_steps, config.num_workers, config.model, config.dataset) == (7, 4, "m", str(tmp_path / "d.jsonl"))
    assert config.activation_checkpointing is False and config.max_samples is None


def test_unknown_preset_is_rejected():
    with pytest.raises(ConfigError, match=r"preset='huge' is unknown; use one of qwen2.5-1.5b-l4x8, qwen2.5-32b-lora-dpo-h100x8, qwen2.5-32b-lora-l4x8, qwen2.5-7b-h100x8, qwen2.5-7b-l4x12, qwen2.5-7b-lora-dpo-l4x8, qwen2.5-7b-lora-l4x8, tiny-cpu"):
        parse_config(["--preset", "huge", "--storage-path", "x"])


def test_global_batch_must_divide_by_workers_times_micro_batch():
    assert problems(global_batch_size=20, num_workers=2, micro_batch_size=4) == [
        "global_batch_size(20) is not divisible by num_workers(2) * micro_batch_size(4) = 8; use a multiple of 8, e.g. 16"
    ]


def test_production_batch_on_six_workers_shows_the_numbers():
    config = TrainConfig(storage_path="s3://b/r", num_workers=6, workers_per_node=3)
    # The micro-batch left to the plan: any divisor would do, but not even one sequence per worker divides.
    assert "global_batch_size(64) is not divisible by num_workers(6) = 6; use a multiple of 6, e.g. 66" in config.problems()
    given = TrainConfig(storage_path="s3://b/r", num_workers=6, workers_per_node=3, micro_batch_size=4)
    assert "global_batch_size(64) is not divisible by num_workers(6) * micro_batch_size(4) = 24; use a multiple of 24, e.g. 72" in given.problems()


def test_hsdp_shard_size_must_divide_world_size():
    assert problems(hsdp=True, hsdp_shard_size=3, num_workers=2, global_batch_size=16) == [
        "hsdp_shard_size(3) does not divide num_workers(2); use a divisor such as the GPUs per node"
    ]


def test_hsdp_equal_to_world_is_plain_fsdp():
    assert problems(hsdp=True, hsdp_shard_size=2) == [
        "hsdp with hsdp_shard_size(2) == num_workers(2) is plain FSDP; drop --hsdp or use a smaller shard size"
    ]


def test_sequence_length_above_the_models_maximum_is_rejected():
    with pytest.raises(ConfigError, match=r"seq_len\(4096\) is above the model's max_position_embeddings\(512\); use --seq-len 512 or less"):
        TrainConfig(**{**PRESETS["tiny-cpu"], "storage_path": "x", "seq_len": 4096}).check_against_model(max_position_embeddings=512)


def test_multi_node_run_needs_shared_storage():
    config = TrainConfig(storage_path="/data/runs")
    assert (
        "storage_path='/data/runs' is a local directory but num_workers(8) / workers_per_node(4) spans 2 nodes: "
        "checkpoints need shared storage; use s3://<bucket>/runs"
    ) in config.problems()


def test_missing_storage_path_is_rejected():
    assert problems(storage_path="") == [
        "storage_path is empty; set --storage-path (or RAY_TRAIN_EKS_STORAGE_PATH): s3://<bucket>/runs on a cluster, a directory locally"
    ]


def test_storage_path_comes_from_the_pod_environment(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_EKS_STORAGE_PATH", "s3://bucket/runs")
    assert parse_config([]).storage_path == "s3://bucket/runs"
    assert parse_config(["--storage-path", "s3://other/runs"]).storage_path == "s3://other/runs"


def test_bf16_needs_a_gpu_and_flash_attention_runs_its_reference_kernel_on_a_cpu():
    assert problems(mixed_precision="bf16", attn_implementation="flash_attention_2") == [
        "mixed_precision='bf16' needs use_gpu; use --mixed-precision fp32 on CPU",
    ]
    assert problems(mixed_precision="fp32", attn_implementation="flash_attention_2") == []


def test_fp32_with_flash_attention_on_a_gpu_is_a_configuration_error_naming_both():
    config = TrainConfig(storage_path="s3://bucket/runs", mixed_precision="fp32")
    assert config.problems() == [
        "mixed_precision='fp32' with attn_implementation='flash_attention_2': flash-attention takes bf16 or fp16 inputs "
        "only; use --mixed-precision bf16, or --attn-implementation sdpa"
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_steps": 0, "warmup_steps": 0}, "max_steps=0 must be at least 1"),
        ({"warmup_steps": 30}, "warmup_steps(30) must be at least 0 and below max_steps(30)"),
        ({"learning_rate": 2.0}, "learning_rate=2.0 must be in (0, 1)"),
        ({"mixed_precision": "fp16"}, "mixed_precision='fp16'; use bf16 or fp32"),
        ({"attn_implementation": "flex"}, "attn_implementation='flex'; use flash_attention_2, sdpa or eager"),
        ({"max_failures": -1}, "max_failures=-1 must be 0 or more"),
        ({"inject_failure_at_step": 30}, "inject_failure_at_step(30) must be between 1 and max_steps(30) - 1"),
        ({"max_grad_norm": 0}, "max_grad_norm=0 must be positive"),
        ({"eval_fraction": 0.6}, "eval_fraction=0.6 must be in [0, 0.5] (0: no eval); e.g. 0.02"),
        ({"eval_every": 0}, "eval_every=0 must be at least 1"),
        ({"eval_max_sequences": 0}, "eval_max_sequences=0 must be at least 1"),
        ({"eval_split": "validation"}, "eval_split='validation' names a split of a Hub data set, but "
                                       "dataset='tiny:reverse-words' is a single file; hold rows out with --eval-fraction instead"),
    ],
)
def test_simple_field_rules(overrides, message):
    assert message in problems(**overrides)


def test_all_problems_are_raised_together():
    with pytest.raises(ConfigError) as raised:
        parse_config(TINY + ["--global-batch-size", "20", "--max-steps", "0"])
    assert str(raised.value).startswith("3 problem(s) in the training configuration:\n  - ")


def test_bad_model_data_and_storage_fail_together_in_seconds_before_ray(capsys):
    import time

    from training.train import main

    started = time.perf_counter()
    assert main(["--dataset", "/no/such.jsonl", "--model", "/no/such/dir", "--storage-path", "s3://"]) == 2
    assert time.perf_counter() - started < 5
    error = capsys.readouterr().err
    assert error.startswith("error: 3 problem(s) in the training configuration:")
    assert "model='/no/such/dir': no such directory on this machine; fix the path, or give a Hub id or an s3:// URI with --model" in error
    assert "dataset='/no/such.jsonl': no such file on this machine; fix the path, or give a Hub id or an s3:// URI with --dataset" in error
    assert "storage_path='s3://' names no valid S3 bucket (3-63 lower-case letters, digits, '.', '-'); use s3://<bucket>/runs" in error


@pytest.mark.parametrize("overrides, message", [
    ({"dataset": "not a hub id!"}, "dataset='not a hub id!' is neither a local path nor a valid Hugging Face Hub id"),
    ({"model": "s3://my-bucket"}, "model='s3://my-bucket' names a bucket but no object; use s3://my-bucket/<path>"),
    ({"dataset": "tiny:other"}, "dataset='tiny:other': the built-in datasets are tiny:reverse-words and tiny:reverse-words-pairs"),
    ({"storage_path": "s3://Bad_Bucket/runs"}, "storage_path='s3://Bad_Bucket/runs' names no valid S3 bucket"),
])
def test_sources_are_checked_on_the_driver(overrides, message):
    assert any(problem.startswith(message) for problem in problems(**overrides)), problems(**overrides)


def test_a_local_model_folder_needs_its_config(tmp_path):
    assert problems(model=str(tmp_path)) == [
        f"model={str(tmp_path)!r} is a local path without config.json; give a folder saved with save_pretrained"
    ]
    assert problems(model="Qwen/Qwen2.5-1.5B", dataset="databricks/databricks-dolly-15k") == []


@pytest.mark.parametrize("overrides, message", [
    ({"objective": "rlhf"}, "objective='rlhf'; use sft (supervised fine-tuning) or dpo (preference pairs)"),
    ({"objective": "dpo", "dpo_loss": "kto"}, "dpo_loss='kto'; use one of sigmoid, ipo, simpo"),
    ({"objective": "dpo", "dpo_beta": 0.0}, "dpo_beta=0.0 must be positive"),
    ({"objective": "dpo", "dpo_loss": "simpo", "simpo_gamma": -1.0}, "simpo_gamma=-1.0 must be 0 or more"),
    ({"dpo_loss": "ipo", "dpo_beta": 0.5}, "dpo_loss, dpo_beta set but objective is 'sft': add --objective dpo, or drop them"),
])
def test_preference_options_are_checked_naming_the_field_the_value_and_the_fix(overrides, message):
    assert any(problem.startswith(message) for problem in problems(**overrides)), problems(**overrides)


def test_dpo_beta_none_on_the_command_line_is_the_losss_default():
    from training.config import parse_config

    config = parse_config(["--preset", "tiny-cpu-dpo", "--dpo-beta", "none", "--storage-path", "/tmp/x"])
    assert (config.objective, config.dpo_beta) == ("dpo", None)
    assert parse_config(["--preset", "tiny-cpu-dpo", "--dpo-beta", "0.25", "--storage-path", "/tmp/x"]).dpo_beta == 0.25


def test_the_planned_objective_of_each_gpu_preset_is_the_presets():
    from training.presets import PRESET_GPUS

    for preset, (_gpu, _nodes, objective) in PRESET_GPUS.items():
        assert PRESETS[preset].get("objective", "sft") == objective, preset
    assert parse_config(["--preset", "qwen2.5-7b-lora-dpo-l4x8", "--storage-path", "s3://bucket/runs"]).learning_rate == 1.25e-6


def test_simpos_default_margin_is_its_recipes_half_of_beta():
    """princeton-nlp/SimPO llama-3-8b-base-simpo.yaml: beta 2.0, gamma_beta_ratio 0.5; --simpo-gamma is absolute."""
    from training.modeling.preference import PreferenceSettings

    def gamma(*argv):
        return PreferenceSettings.of(parse_config(["--preset", "tiny-cpu-dpo", "--dpo-loss", "simpo", "--storage-path",
                                                   "/tmp/x", *argv])).gamma_value

    assert gamma() == 1.0 and gamma("--dpo-beta", "2.5") == 1.25 and gamma("--simpo-gamma", "0.3") == 0.3

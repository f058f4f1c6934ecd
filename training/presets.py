"""The presets: the defaults a run starts from (``--preset``; the command line overrides any of
them), and the built-in tiny model and data set they name. ``training.config`` exports them too."""

from __future__ import annotations

from typing import Any

#: Model and data set sentinels that are built on the spot (no download): a tiny Qwen2
#: from a config in code with a tokenizer trained on synthetic text, and that text as
#: an instruction data set. They are written to a local folder and then loaded through
#: the same ``from_pretrained`` / JSONL code paths as real ones.
TINY_MODEL = "tiny:qwen2"
TINY_DATASET = "tiny:reverse-words"
#: The same task as preference pairs (``--objective dpo``): the words reversed, chosen; left in order, rejected.
TINY_PREFERENCE_DATASET = "tiny:reverse-words-pairs"
#: Presets: defaults a run starts from; the command line overrides any of them.
PRESETS: dict[str, dict[str, Any]] = {
    # Qwen2.5-1.5B on two g6.12xlarge (8 x L4 24 GB, 4 per node, EFA between nodes).
    # 2048-token packed sequences hold several short Dolly samples each and truncate the
    # rare longer one (its contexts are paragraphs, not documents). 64 sequences (131k
    # tokens) per step, a usual SFT batch; the micro-batch and activation checkpointing are
    # left to the memory plan (training/modeling/plan.py ``choose_fastest``): with HSDP (on:
    # two nodes) and the chunked loss it picks 8 x 2048 tokens a forward (one flattened row of
    # 16,384), no accumulation, checkpointing on: 11.6 GiB per L4 of 22.5.
    # 120 steps is about 3 epochs of Dolly-15k at a peak
    # LR of 2e-5 with cosine decay.
    "qwen2.5-1.5b-l4x8": {},
    # Qwen2.5-7B (7.6 B parameters): its sharded fp32 parameters, gradients and AdamW state
    # alone are 114 GB, 14.2 GiB per GPU over 8; with activations, gathered layers and the loss
    # no option fits 8 x L4 (the plan's best: 23.9 GiB of 22.5, micro-batch 1 over 8). Three
    # g6.12xlarge (-c gpuNodeCount=3) with full sharding over 12 and micro-batch 1 do: 19.0
    # GiB planned. 48 sequences per step (4 accumulation steps).
    "qwen2.5-7b-l4x12": {"model": "Qwen/Qwen2.5-7B", "run_name": "qwen2.5-7b-sft", "num_workers": 12, "workers_per_node": 4,
                         "hsdp": False, "micro_batch_size": 1, "global_batch_size": 48, "learning_rate": 1e-5},
    # Qwen2.5-7B on one p5.48xlarge (8 x H100 80 GB): FSDP over 8, 4 x 2048 per micro-batch,
    # 27.2 GiB planned per GPU of 79.6.
    "qwen2.5-7b-h100x8": {"model": "Qwen/Qwen2.5-7B", "run_name": "qwen2.5-7b-sft", "num_workers": 8, "workers_per_node": 8,
                          "micro_batch_size": 4, "global_batch_size": 64, "learning_rate": 1e-5},
    # LoRA (--peft lora) on the default nodes, two g6.12xlarge (8 L4): the base frozen in bf16, the
    # adapters (rank 8 on every linear layer) trained at torchtune's Qwen2.5 LoRA learning rate.
    # Qwen2.5-7B, which a full fine-tune cannot fit on these GPUs: HSDP across the two nodes, 8 x 2048
    # tokens a forward, no accumulation: 17.1 GiB planned per L4 of 22.5 (5.4 GiB headroom).
    "qwen2.5-7b-lora-l4x8": {"model": "Qwen/Qwen2.5-7B", "run_name": "qwen2.5-7b-lora", "peft": "lora",
                             "learning_rate": 3e-4, "micro_batch_size": 8, "activation_checkpointing": True},
    # Qwen2.5-32B: its frozen bf16 base alone is 61 GiB, 15.3 GiB per GPU in a shard group of one node,
    # so it shards over all 8 (7.6 GiB each), 2 x 2048 tokens a forward, 4 accumulation steps:
    # 19.3 GiB planned per L4 of 22.5 (3.2 GiB headroom).
    "qwen2.5-32b-lora-l4x8": {"model": "Qwen/Qwen2.5-32B", "run_name": "qwen2.5-32b-lora", "peft": "lora",
                              "learning_rate": 3e-4, "hsdp": False, "micro_batch_size": 2,
                              "activation_checkpointing": True},
    # DPO (--objective dpo, preference pairs) with LoRA, on UltraFeedback's binarized pairs (TRL's DPO
    # example data set). Each starts from the Instruct release, not the base: DPO refines a model that
    # already follows instructions (TRL's DPO examples start from an SFT/Instruct model; the reference
    # is that same model). The reference is the base with the adapters off, a no-grad forward of each
    # micro-batch before the policy's: no second copy of the model. A pair is packed as two segments
    # (chosen, rejected) of one 2048-token sequence, so the token counts and the plan are SFT's plus
    # that reference forward, which is never the peak. 64 packed sequences a step (each one pair or
    # more). The learning rate: LoRA DPO's default, TRL's 5e-6 (scripts/dpo.py with --use_peft, rank 32,
    # alpha 16: adapter scale 0.5) scaled to our scale 2.0 (rank 8, alpha 16): 1.25e-6; beta 0.1 (TRL's default).
    # Qwen2.5-7B-Instruct on the default nodes (8 L4), HSDP, 8 x 2048 a forward, no accumulation: its
    # reference forward 10.2 GiB, the peak (the last layer's backward) 17.1 GiB planned per L4 of 22.5.
    "qwen2.5-7b-lora-dpo-l4x8": {"model": "Qwen/Qwen2.5-7B-Instruct", "run_name": "qwen2.5-7b-dpo", "peft": "lora",
                                 "dataset": "trl-lib/ultrafeedback_binarized", "seq_len": 2048, "global_batch_size": 64,
                                 "objective": "dpo", "micro_batch_size": 8, "activation_checkpointing": True},
    # Qwen2.5-32B-Instruct on one p5.48xlarge (8 H100 80 GB), FSDP over 8, 8 x 2048 a forward, no
    # accumulation: its reference forward 17.1 GiB, the peak 33.2 GiB planned per H100 of 79.6.
    "qwen2.5-32b-lora-dpo-h100x8": {"model": "Qwen/Qwen2.5-32B-Instruct", "run_name": "qwen2.5-32b-dpo", "peft": "lora",
                                    "dataset": "trl-lib/ultrafeedback_binarized", "seq_len": 2048, "global_batch_size": 64,
                                    "objective": "dpo", "num_workers": 8, "workers_per_node": 8, "micro_batch_size": 8,
                                    "activation_checkpointing": True},
    # Everything on CPU in about a minute: a tiny Qwen2 and a synthetic task.
    "tiny-cpu": {
        "run_name": "tiny-cpu-sft",
        "model": TINY_MODEL,
        "dataset": TINY_DATASET,
        "max_samples": 1200,
        "eval_fraction": 0.05,
        "eval_max_sequences": 16,
        "eval_every": 10,
        "num_workers": 2,
        "workers_per_node": 2,
        "use_gpu": False,
        "seq_len": 128,
        "micro_batch_size": 4,
        "global_batch_size": 16,
        "max_steps": 30,
        "learning_rate": 3e-3,
        "warmup_steps": 3,
        "mixed_precision": "fp32",
        "activation_checkpointing": False,
        "attn_implementation": "flash_attention_2",
        "checkpoint_every": 10,
        "keep_checkpoints": 2,
        "max_failures": 2,
        "preflight_mb": 1,
        # The synthetic task's answers are at most 8 words.
        "sample_max_tokens": 24,
    },
}
# DPO on CPU: the same tiny model and task, as preference pairs (each a chosen and a rejected side in
# one packed sequence, so a sequence holds half as many rows), at DPO's beta.
PRESETS["tiny-cpu-dpo"] = {**PRESETS["tiny-cpu"], "run_name": "tiny-cpu-dpo", "dataset": TINY_PREFERENCE_DATASET,
                           "objective": "dpo"}
#: The GPUs each GPU preset is planned for (the memory plan's GPU type, GPU nodes), and its objective
#: (a DPO preset is planned with its reference).
PRESET_GPUS: dict[str, tuple[str, int, str]] = {
    "qwen2.5-1.5b-l4x8": ("L4", 2, "sft"), "qwen2.5-7b-l4x12": ("L4", 3, "sft"), "qwen2.5-7b-h100x8": ("H100", 1, "sft"),
    "qwen2.5-7b-lora-l4x8": ("L4", 2, "sft"), "qwen2.5-32b-lora-l4x8": ("L4", 2, "sft"),
    "qwen2.5-7b-lora-dpo-l4x8": ("L4", 2, "dpo"), "qwen2.5-32b-lora-dpo-h100x8": ("H100", 1, "dpo"),
}

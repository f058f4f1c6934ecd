"""The fine-tune's configuration: one keyword-only dataclass, presets, the command line,
and the checks that run before Ray starts.

Every field is a command-line option (``max_steps`` -> ``--max-steps``); a preset sets
defaults and the command line overrides them. Problems are collected and raised together,
each naming the field and showing the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from .evaluation.options import HARNESS_PACKAGES, evaluation_problems  # noqa: F401 - public here beside LORA_PACKAGES
from .presets import PRESETS, TINY_DATASET, TINY_MODEL, TINY_PREFERENCE_DATASET  # noqa: F401 - public here too
from .resilience.deadline import stop_time_problem
from .resilience.elastic import elastic_problems, sequences_per_worker, worker_counts
from .option_checks import (ALL_LINEAR, DPO_LEARNING_RATES, FULL_LEARNING_RATE, LORA_LEARNING_RATE,  # noqa: F401 - public here
                            LORA_LEARNING_RATE_SOURCE, LORA_PACKAGES, OUTPUT_HEAD, TRACKING_PACKAGES, 
                            _s3_problem, _source_problem, default_learning_rate, learning_rate_notes, lora_problems,
                            lora_target_list, objective_problems, source_problems)

#: The storage path when --storage-path is not given; the RayJob's pods set it.
STORAGE_PATH_ENV = "RAY_TRAIN_EKS_STORAGE_PATH"


#: The micro-batch where no memory plan chooses one (CPU runs, no GPU type).
DEFAULT_MICRO_BATCH = 4


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one fine-tuning run depends on. Field docs are the ``--help`` texts."""

    preset: str = field(default="qwen2.5-1.5b-l4x8", metadata={"help": "preset that sets the defaults"})
    run_name: str = field(default="qwen2.5-1.5b-sft", metadata={"help": "run name; the same name under the same storage path resumes"})
    storage_path: str = field(default="", metadata={"help": "where checkpoints and the final model go: s3://bucket/prefix, or a directory (default: $RAY_TRAIN_EKS_STORAGE_PATH, set in the Ray pods)"})
    model: str = field(default="Qwen/Qwen2.5-1.5B", metadata={"help": "Hub id, local directory, s3:// prefix, or tiny:qwen2"})
    dataset: str = field(default="databricks/databricks-dolly-15k", metadata={"help": "Hub id, local .jsonl, s3://.../file.jsonl, or tiny:reverse-words"})
    dataset_split: str = field(default="train", metadata={"help": "split of a Hub data set"})
    max_samples: int | None = field(default=None, metadata={"help": "use at most this many training samples (none: all)"})
    eval_fraction: float = field(default=0.02, metadata={"help": "share of the data set's rows held out for the eval loss; they never train (0: no eval)"})
    eval_split: str | None = field(default=None, metadata={"help": "a split of the Hub data set to compute the eval loss on, instead of held-out rows"})
    eval_max_sequences: int = field(default=64, metadata={"help": "at most this many packed sequences of held-out data are evaluated"})
    eval_every: int = field(default=20, metadata={"help": "compute the eval loss every N steps (and at the end)"})
    num_workers: int = field(default=8, metadata={"help": "Ray Train workers (one GPU each on GPU)"})
    workers_per_node: int = field(default=4, metadata={"help": "workers on one node (GPUs per node); sets the HSDP shard size and the shared-storage check"})
    use_gpu: bool = field(default=True, metadata={"help": "train on GPUs with NCCL; else CPUs with gloo"})
    seq_len: int = field(default=2048, metadata={"help": "tokens per packed sequence"})
    micro_batch_size: int | None = field(default=None, metadata={"help": "packed sequences per worker per forward pass (flattened into one row); default: the largest the memory plan fits that divides the global batch (4 without a plan: CPU, or no GPU type)"})
    global_batch_size: int = field(default=64, metadata={"help": "sequences per optimizer step, over all workers"})
    max_steps: int = field(default=120, metadata={"help": "optimizer steps of the whole run; a resumed run stops here too"})
    learning_rate: float | None = field(default=None, metadata={"help": "peak learning rate; default: 2e-5 for a full fine-tune, 3e-4 with --peft lora (torchtune's Qwen2.5 LoRA recipes: recipes/configs/qwen2_5/7B_lora.yaml lr: 3e-4); with --objective dpo 5e-7, or with LoRA TRL's 5e-6 at its adapter scale 0.5 (scripts/dpo.py: rank 32, alpha 16) scaled to the run's alpha / rank (1.25e-6 at rank 8, alpha 16); a preset's rate applies to the kind of run it is for (a full-fine-tune preset's not to --peft lora, an SFT preset's not to --objective dpo)"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine decay floor, as a fraction of the peak"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm"})
    mixed_precision: str = field(default="bf16", metadata={"help": "bf16 (parameters in bf16, reductions in fp32; GPU only) or fp32"})
    activation_checkpointing: bool | None = field(default=None, metadata={"help": "recompute decoder layers in backward to save memory (about a third more compute); default: off where the memory plan fits without it, else on (on without a plan)"})
    peft: str = field(default="none", metadata={"help": "none: full fine-tune; lora: train LoRA adapters (PEFT) on the frozen base, held in the compute dtype (bf16 on GPUs); checkpoints hold the adapters and their optimizer state, final/ the adapter in PEFT's format"})
    # LoRA's defaults: torchtune's Qwen2.5 LoRA recipes (rank 8, alpha 16, dropout 0; PEFT's own
    # defaults are rank 8 and dropout 0 too) on every linear layer of the decoder, as QLoRA trains and
    # PEFT's "all-linear" names them (torchtune: q, v, o and the MLP), whatever a family calls them.
    lora_rank: int = field(default=8, metadata={"help": "LoRA: rank r of each adapter (its A is r x in, its B out x r)"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA: alpha; the adapters' product is scaled by alpha / rank"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA: dropout on the adapters' input while training"})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "LoRA: all-linear (every linear layer of the decoder, not the output head) or comma-separated module names, e.g. q_proj,k_proj,v_proj,o_proj"})
    merge_lora: bool = field(default=False, metadata={"help": "LoRA: also export the base with the adapters merged in, a plain Hugging Face model, to final-merged/"})
    merge_lora_dtype: str | None = field(default=None, metadata={"help": "LoRA: bf16 or fp32, the dtype the adapters are merged in and the merged model saved in; default: the run's compute dtype (bf16 on GPUs). A bf16 merge rounds the sum to bf16: its logits differ from the adapter model's (0.03 at most on the tiny model, top-1 99% the same), fp32's do not (1e-6)"})
    model_revision: str | None = field(default=None, metadata={"help": "the Hub model's commit (or a branch or tag, resolved to its commit at the start); default: the commit the run first loaded (run.json), else the main branch's now. Recorded in run.json and adapter_config.json, and reloaded on resume"})
    objective: str = field(default="sft", metadata={"help": "sft: supervised fine-tuning on chats; dpo: preference tuning on chosen/rejected pairs (TRL's preference formats) with --dpo-loss, against a reference model (under LoRA the base with the adapters off; a full fine-tune's reference log-probabilities computed once before the first step)"})
    dpo_loss: str = field(default="sigmoid", metadata={"help": "dpo: sigmoid (DPO), ipo (IPO) or simpo (SimPO: no reference model), as TRL computes them"})
    dpo_beta: float | None = field(default=None, metadata={"help": "dpo: beta, how far the policy may move from the reference; default: 0.1 for sigmoid and ipo (TRL's), 2.0 for simpo (SimPO's paper)"})
    simpo_gamma: float | None = field(default=None, metadata={"help": "simpo: the target reward margin gamma, subtracted from beta times the difference of the sides' mean log-probabilities (TRL's simpo_gamma, absolute); default: half of beta, the gamma/beta ratio 0.5 of SimPO's recipe (princeton-nlp/SimPO training_configs/llama-3-8b-base-simpo.yaml: beta 2.0, gamma_beta_ratio 0.5), so 1.0 at the default beta"})
    loss_chunk_tokens: int = field(default=1024, metadata={"help": "tokens per chunk of the output head and loss (the full logits never exist)"})
    hsdp: bool | None = field(default=None, metadata={"help": "shard inside a node, replicate across nodes (HSDP); default: on when the workers span several nodes"})
    hsdp_shard_size: int | None = field(default=None, metadata={"help": "HSDP shard group size (none: workers_per_node)"})
    gpu_type: str | None = field(default=None, metadata={"help": "the workers' GPU model (L4, A10G, A100, H100, H200) for the memory plan before Ray starts; the RayJob sets it; none: no plan"})
    attn_implementation: str = field(default="flash_attention_2", metadata={"help": "flash_attention_2, sdpa or eager"})
    checkpoint_every: int = field(default=40, metadata={"help": "save a checkpoint every N steps (and at the end)"})
    checkpoint_mode: str = field(default="async", metadata={"help": "async: written in the background to the node's disk and uploaded by Ray in the background, training goes on; sync: the loop waits for both"})
    keep_checkpoints: int = field(default=2, metadata={"help": "keep the K checkpoints with the lowest eval loss (with --export best and eval data; else the last K), and always the latest, which a resume starts from"})
    export: str = field(default="best", metadata={"help": "what final/ holds: best (the weights of the step with the lowest eval loss; a step with a new best is checkpointed) or last (the last step's); without eval data the last"})
    early_stopping_patience: int = field(default=0, metadata={"help": "end the run, as finished, after N evaluations without a new lowest eval loss (0: off); a resumed run keeps counting"})
    sample_prompts: int = field(default=3, metadata={"help": "at each evaluation, greedy completions for the first N held-out prompts into samples.jsonl and the tracker (0: none)"})
    sample_max_tokens: int = field(default=32, metadata={"help": "at most this many new tokens per sample (generation also stops at the chat template's end of turn); each costs a forward of the sharded model"})
    eval_tasks: str | None = field(default=None, metadata={"help": "after training, run these lm-evaluation-harness tasks (comma-separated, e.g. gsm8k,ifeval) on the exported model and on the base (kept once per model and tasks), into eval_results.json and the summary; none: no benchmark"})
    eval_tasks_path: str | None = field(default=None, metadata={"help": "a local folder of lm-evaluation-harness task YAML files to find --eval-tasks in too (tasks over your own JSONL)"})
    eval_limit: int | None = field(default=None, metadata={"help": "at most this many examples per benchmark task (none: all)"})
    max_failures: int = field(default=3, metadata={"help": "worker or node failures (no notice) to recover from the last checkpoint before giving up"})
    max_hardware_faults: int = field(default=2, metadata={"help": "hardware faults (a node taken out: a GPU error on evidence, a node condition, a straggler) to resume from on a new node before giving up; each costs a node's start"})
    max_preemptions: int = field(default=-1, metadata={"help": "preemptions (a node drained with notice: Spot, drift, node-group update) to resume from before giving up; -1: no limit, as Ray's"})
    min_nodes: int | None = field(default=None, metadata={"help": "an elastic run: when nodes are lost (a Spot reclaim, a node taken out, a Capacity Block's end) it goes on with the whole nodes it has, down to N, from the last checkpoint or the one at the notice, and grows back at a checkpoint when nodes return; the global batch, learning-rate schedule and data order stay, the accumulation steps follow the size (docs/elastic-runs.md); none: a fixed-size run, which waits for a replacement"})
    elastic_settle_s: float = field(default=60.0, metadata={"help": "an elastic run grows onto a node that joined once the node has stayed this long, at its next checkpoint"})
    stop_before: str | None = field(default=None, metadata={"help": "checkpoint and stop, resumable, before this UTC time (ISO-8601, e.g. 2026-12-05T14:00:00Z): the run ends where the next step and a checkpoint would pass it; default: on GPU nodes that run on Capacity Blocks only, 35 min before the earliest block's end (EC2 reclaims the instances from 40 min before), else none"})
    gpu_usd_per_hour: float | None = field(default=None, metadata={"help": "what one GPU node costs an hour, for the run's cost (metrics.jsonl's cost_usd, status, summary.json): a Capacity Block's upfront fee over its hours and instances, a Savings Plan's rate; default: as each node is billed (On-Demand at the platform's price, Spot at EC2's Spot price, a reservation at the On-Demand rate)"})
    health_check_every: int = field(default=50, metadata={"help": "time a short matmul on every GPU every N steps and log the slowest against the median, with each rank's step time (0: never)"})
    straggler_share: float = field(default=0.85, metadata={"help": "a GPU whose matmul throughput is below this share of the median is a straggler: at the preflight its node is taken out and the run restarts elsewhere; in the run it is logged"})
    preemption_check_every: int = field(default=1, metadata={"help": "look for a preemption notice every N steps (a barrier across the workers)"})
    seed: int = field(default=42, metadata={"help": "seed of data order and initialisation"})
    expect_efa: bool = field(default=False, metadata={"help": "fail at start if NCCL does not use EFA (the RayJob sets this)"})
    preflight_mb: int = field(default=256, metadata={"help": "all-reduce size of the network preflight, MiB (0: skip)"})
    preflight_timeout_s: int = field(default=180, metadata={"help": "the preflight fails when its all-reduce takes longer (a hung transport)"})
    summary_file: str | None = field(default=None, metadata={"help": "also write the JSON summary to this file (a local path or s3://), for scripts"})
    tracking_uri: str | None = field(default=None, metadata={"help": "MLflow tracking URI the run logs to: an MLflow server's http(s)://, a SageMaker MLflow App's or tracking server's ARN, or on one machine a local store (sqlite:///mlflow.db, MLflow's default; file:); default: $MLFLOW_TRACKING_URI (the stack sets it in the Ray pods); none: no tracking"})
    experiment_name: str | None = field(default=None, metadata={"help": "MLflow experiment of the run; default: $RAY_TRAIN_EKS_MLFLOW_EXPERIMENT (the stack's), else ray-train-eks"})
    register_model: str | None = field(default=None, metadata={"help": "register the final model (or adapter) in MLflow's model registry under this name, its source the model's folder (nothing uploaded again)"})
    inject_failure_at_step: int | None = field(default=None, metadata={"help": "testing: worker 1 dies once after this step"})
    step_pause_s: float = field(default=0.0, metadata={"help": "testing: pause this long after each step, so a test can act on a run midway"})

    def __post_init__(self) -> None:
        if self.learning_rate is None:  # the default of the kind of run (the help says which)
            scale = self.lora_alpha / self.lora_rank if self.lora_rank > 0 else None  # a bad rank is refused below
            object.__setattr__(self, "learning_rate", default_learning_rate(self.peft, self.objective, scale))

    # ------------------------------------------------------------------ checks

    def problems(self) -> list[str]:
        """Every problem with this configuration, each naming the field with its numbers."""
        p: list[str] = []
        if self.preset not in PRESETS:
            p.append(f"preset={self.preset!r} is unknown; use one of {', '.join(sorted(PRESETS))}")
        if not self.storage_path:
            p.append("storage_path is empty; set --storage-path (or RAY_TRAIN_EKS_STORAGE_PATH): s3://<bucket>/runs on a cluster, a directory locally")
        for name in ("num_workers", "workers_per_node", "seq_len", "micro_batch_size", "global_batch_size", "max_steps",
                     "checkpoint_every", "keep_checkpoints", "loss_chunk_tokens", "preflight_timeout_s", "eval_every",
                     "eval_max_sequences", "preemption_check_every", "sample_max_tokens", "eval_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                p.append(f"{name}={getattr(self, name)} must be at least 1")
        if self.max_failures < 0:
            p.append(f"max_failures={self.max_failures} must be 0 or more")
        p.extend(tracking_problems(self))
        if self.max_hardware_faults < 0:
            p.append(f"max_hardware_faults={self.max_hardware_faults} must be 0 or more")
        if self.health_check_every < 0:
            p.append(f"health_check_every={self.health_check_every} must be 0 (never) or more")
        if not 0 < self.straggler_share < 1:
            p.append(f"straggler_share={self.straggler_share} must be between 0 and 1 (a share of the median GPU's throughput; 0.85 is the default)")
        if self.max_preemptions < -1:
            p.append(f"max_preemptions={self.max_preemptions} must be -1 (no limit) or more")
        p.extend(filter(None, [stop_time_problem(self.stop_before), _price_problem(self.gpu_usd_per_hour)]))
        if self.max_samples is not None and self.max_samples < 1:
            p.append(f"max_samples={self.max_samples} must be at least 1 (or none for all)")
        per_step = self.num_workers * (self.micro_batch_size or 1)  # unset: chosen among the divisors
        if per_step >= 1 and self.global_batch_size % per_step:
            what = (f"num_workers({self.num_workers}) * micro_batch_size({self.micro_batch_size})"
                    if self.micro_batch_size else f"num_workers({self.num_workers})")
            p.append(
                f"global_batch_size({self.global_batch_size}) is not divisible by {what} = {per_step}; use a multiple of "
                f"{per_step}, e.g. {max(per_step, round(self.global_batch_size / per_step) * per_step)}"
            )
        if not 0 < self.learning_rate < 1:
            p.append(f"learning_rate={self.learning_rate} must be in (0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            p.append(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.warmup_steps < 0 or self.warmup_steps >= max(self.max_steps, 1):
            p.append(f"warmup_steps({self.warmup_steps}) must be at least 0 and below max_steps({self.max_steps})")
        if self.max_grad_norm <= 0:
            p.append(f"max_grad_norm={self.max_grad_norm} must be positive")
        if self.gpu_type is not None and self.gpu_type not in _GPU_TYPES:
            p.append(f"gpu_type={self.gpu_type!r} is unknown to the memory plan; use one of {', '.join(_GPU_TYPES)} (or none)")
        if self.checkpoint_mode not in ("async", "sync"):
            p.append(f"checkpoint_mode={self.checkpoint_mode!r}; use async (the default) or sync")
        if self.mixed_precision not in ("bf16", "fp32"):
            p.append(f"mixed_precision={self.mixed_precision!r}; use bf16 or fp32")
        elif self.mixed_precision == "bf16" and not self.use_gpu:
            p.append("mixed_precision='bf16' needs use_gpu; use --mixed-precision fp32 on CPU")
        if not 0 <= self.eval_fraction <= 0.5:
            p.append(f"eval_fraction={self.eval_fraction} must be in [0, 0.5] (0: no eval); e.g. 0.02")
        if self.eval_split is not None and (self.dataset.startswith(("tiny:", "s3://")) or os.path.exists(os.path.expanduser(self.dataset))):
            p.append(f"eval_split={self.eval_split!r} names a split of a Hub data set, but dataset={self.dataset!r} is a single "
                     "file; hold rows out with --eval-fraction instead")
        # On a CPU flash-attention's varlen call runs a reference kernel in fp32 (training/modeling/attention.py).
        if self.mixed_precision == "fp32" and self.attn_implementation == "flash_attention_2" and self.use_gpu:
            p.append("mixed_precision='fp32' with attn_implementation='flash_attention_2': flash-attention takes bf16 or fp16 "
                     "inputs only; use --mixed-precision bf16, or --attn-implementation sdpa")
        if self.attn_implementation not in ("flash_attention_2", "sdpa", "eager"):
            p.append(f"attn_implementation={self.attn_implementation!r}; use flash_attention_2, sdpa or eager")
        p.extend(self._hsdp_problems())
        nodes = self.num_nodes
        if self.use_gpu and self.storage_path and nodes > 1 and "://" not in self.storage_path:
            p.append(
                f"storage_path={self.storage_path!r} is a local directory but num_workers({self.num_workers}) / "
                f"workers_per_node({self.workers_per_node}) spans {nodes} nodes: checkpoints need shared storage; "
                "use s3://<bucket>/runs"
            )
        if self.inject_failure_at_step is not None and not 0 < self.inject_failure_at_step < self.max_steps:
            p.append(f"inject_failure_at_step({self.inject_failure_at_step}) must be between 1 and max_steps({self.max_steps}) - 1")
        if self.step_pause_s < 0:
            p.append(f"step_pause_s={self.step_pause_s} must be 0 or more")
        if self.inject_failure_at_step is not None and self.num_workers < 2:
            p.append("inject_failure_at_step needs num_workers >= 2 (worker 1 is the one that dies)")
        p.extend(elastic_problems(self) + lora_problems(self))
        p.extend(objective_problems(self))
        p.extend(source_problems(self))
        p.extend(evaluation_problems(self))
        return p

    def _hsdp_problems(self) -> list[str]:
        if not self.hsdp:  # asked for explicitly (None: chosen from the node count)
            return []
        shard = self.hsdp_shard_size or self.workers_per_node
        if shard < 1 or self.num_workers % shard:
            return [f"hsdp_shard_size({shard}) does not divide num_workers({self.num_workers}); "
                    f"use a divisor such as the GPUs per node"]
        if shard == self.num_workers:
            return [f"hsdp with hsdp_shard_size({shard}) == num_workers({self.num_workers}) is plain FSDP; "
                    f"drop --hsdp or use a smaller shard size"]
        return []

    def validate(self) -> "TrainConfig":
        """Return self, or raise :class:`ConfigError` listing every problem."""
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    def check_against_model(self, *, max_position_embeddings: int) -> None:
        """Checks that need the model's config (read before Ray starts)."""
        if self.seq_len > max_position_embeddings:
            raise ConfigError([
                f"seq_len({self.seq_len}) is above the model's max_position_embeddings({max_position_embeddings}); "
                f"use --seq-len {max_position_embeddings} or less"
            ])

    # ------------------------------------------------------------------ derived

    def with_defaults(self) -> "TrainConfig":
        """This configuration with what the memory plan did not choose set as without a plan
        (training/train.py ``plan_memory`` chooses where it can): activation checkpointing on, the
        micro-batch the largest of 4, 2, 1 that divides the global batch per worker (at every size an
        elastic run may take)."""
        micro = self.micro_batch_size
        if micro is None:
            micro = next((m for m in (DEFAULT_MICRO_BATCH, 2, 1) if self.sequences_per_worker % m == 0), 1)
        checkpointing = True if self.activation_checkpointing is None else self.activation_checkpointing
        return dataclasses.replace(self, micro_batch_size=micro, activation_checkpointing=checkpointing)

    @property
    def worker_counts(self) -> tuple[int, ...]:
        """The world sizes the run may train at: ``num_workers``, and with ``--min-nodes`` each whole
        number of nodes from the minimum up (training/resilience/elastic.py)."""
        return worker_counts(self)

    @property
    def sequences_per_worker(self) -> int:
        """Packed sequences per worker per step that every size the run may train at divides into
        micro-batches (the global batch per worker; an elastic run's: their greatest common divisor)."""
        return sequences_per_worker(self)

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per worker per optimizer step at ``num_workers`` (with the micro-batch unset: as
        without a plan); an elastic run's follow its size (training/prepare.py)."""
        micro = self.micro_batch_size if self.micro_batch_size is not None else self.with_defaults().micro_batch_size
        return self.global_batch_size // (self.num_workers * micro)

    @property
    def flattened_rows(self) -> bool:
        """Whether micro-batches are one flattened row (a varlen kernel: flash-attention), or one row
        per packed sequence (sdpa, eager: training/data/batch.py ``rows``)."""
        return self.attn_implementation == "flash_attention_2"

    @property
    def num_nodes(self) -> int:
        """Nodes the workers span."""
        return math.ceil(self.num_workers / max(self.workers_per_node, 1))

    @property
    def use_hsdp(self) -> bool:
        """HSDP as asked, else whenever the workers span several nodes: gradients then
        cross nodes once per step instead of every micro-step (see training.modeling.traffic)."""
        if self.hsdp is not None:
            return self.hsdp
        return self.num_nodes > 1 and self.num_workers % max(self.workers_per_node, 1) == 0

    @property
    def shard_size(self) -> int:
        """FSDP shard group size (the world size unless HSDP)."""
        return (self.hsdp_shard_size or self.workers_per_node) if self.use_hsdp else self.num_workers

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, for Ray's ``train_loop_config``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """Inverse of :meth:`to_dict`; keys that are not fields (run bookkeeping) are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


def _price_problem(usd_per_hour: float | None) -> str | None:
    if usd_per_hour is not None and not usd_per_hour > 0:
        return f"gpu_usd_per_hour={usd_per_hour} must be positive (USD a GPU node costs an hour), or none"
    return None


#: The GPU models the memory plan knows (training/modeling/plan.py GPU_MEMORY_MIB).
_GPU_TYPES = ("L4", "A10G", "A100", "H100", "H200")


class ConfigError(ValueError):
    """Every problem of a training configuration, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"{len(problems)} problem(s) in the training configuration:\n" + "\n".join(f"  - {x}" for x in problems))


def options_table() -> str:
    """docs/fine-tuning.md's table of the training options, from the fields (scripts/render_config_table.py)."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for f in fields(TrainConfig):
        default = "none" if f.default is None else f"`{str(f.default).lower() if isinstance(f.default, bool) else f.default}`"
        if f.default == "":
            default = "none"
        rows.append(f"| `--{f.name.replace('_', '-')}` | {default} | {f.metadata.get('help', '').replace('|', '/')} |")
    return "\n".join(rows) + "\n"


#: Fields typed ``int | None``: 'none' on the command line is a value (argparse drops them when not given).
_OPTIONAL_INTS = tuple(f.name for f in fields(TrainConfig) if f.type in ("int | None", "float | None"))


def _parse_optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "null", "") else int(text)


def _parse_optional_float(text: str) -> float | None:
    return None if text.lower() in ("none", "null", "") else float(text)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one option per :class:`TrainConfig` field."""
    parser = argparse.ArgumentParser(
        prog="python -m training.train",
        description="FSDP supervised fine-tuning under Ray Train. A preset sets defaults; options override them.",
    )
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        # argparse formats every help string with %: a field's help is prose, so its % are literal.
        help_text = f.metadata.get("help", "").replace("%", "%%")
        if f.type in ("bool", bool, "bool | None"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.type in ("int | None",):
            parser.add_argument(flag, type=_parse_optional_int, default=argparse.SUPPRESS, help=help_text + " ('none' allowed)")
        elif f.type in ("int", int):
            parser.add_argument(flag, type=int, default=None, help=help_text)
        elif f.type in ("float", float):
            parser.add_argument(flag, type=float, default=None, help=help_text)
        elif f.type in ("float | None",):
            parser.add_argument(flag, type=_parse_optional_float, default=argparse.SUPPRESS, help=help_text + " ('none' allowed)")
        else:
            parser.add_argument(flag, type=str, default=None, help=help_text)
    return parser


#: MLflow 3.17's database stores (``mlflow/store/db/db_types.py`` ``DATABASE_ENGINES``), which its client
#: opens only where sqlalchemy and alembic are installed (``mlflow/tracking/_tracking_service/utils.py``).
DATABASE_SCHEMES = ("sqlite", "mysql", "postgresql", "mssql")
#: The stores on this machine's disk: MLflow's file store (a folder, ``file:``) and sqlite.
DISK_SCHEMES = ("", "file", "sqlite")


def tracking_problems(config: "TrainConfig") -> list[str]:
    """The tracker's URI must be one MLflow takes (a server, a SageMaker MLflow App or tracking server, any
    store of MLflow's own, its default ``sqlite:///mlflow.db`` included) and one the run's processes all
    reach: a store on the driver's disk only where every worker runs beside it (one machine, outside
    Kubernetes); registering needs a tracker."""
    import importlib.util

    uri, p = config.tracking_uri, []
    scheme = (uri or "").split(":", 1)[0].split("+")[0] if ":" in (uri or "") else ""
    arn = bool(uri) and uri.startswith("arn:") and (":mlflow-app/" in uri or ":mlflow-tracking-server/" in uri)
    elsewhere = config.num_nodes > 1 or bool(os.environ.get("KUBERNETES_SERVICE_HOST"))  # rank 0 on another machine
    where = (f"num_workers({config.num_workers}) / workers_per_node({config.workers_per_node}) spans "
             f"{config.num_nodes} nodes" if config.num_nodes > 1 else "this runs in a Kubernetes pod")
    if uri and not arn and scheme not in ("http", "https", "databricks", "databricks-uc", *DISK_SCHEMES, *DATABASE_SCHEMES):
        p.append(f"tracking_uri={uri!r}: use an MLflow server's http(s):// URL, the ARN of a SageMaker MLflow App "
                 "(arn:aws:sagemaker:<region>:<account>:mlflow-app/<id>) or tracking server, or on one machine a store "
                 "MLflow takes (sqlite:///mlflow.db, its default; a folder); or none")
    elif uri and scheme in DISK_SCHEMES and elsewhere:
        p.append(f"tracking_uri={uri!r} is a store on this machine's disk, but {where}: rank 0 logs each step from its "
                 "own node, which cannot reach it; use an MLflow server's http(s):// URL or the stack's MLflow App "
                 "(its ARN: MLFLOW_TRACKING_URI in the Ray pods)")
    elif uri and scheme in DATABASE_SCHEMES and elsewhere:
        # Rank 0's runtime env installs TRACKING_PACKAGES only (mlflow-skinny: no sqlalchemy, alembic, nor a DB driver).
        p.append(f"tracking_uri={uri!r} is a database MLflow reaches directly, but {where}: rank 0 logs each step from "
                 "its own node, whose runtime has MLflow's client only (no sqlalchemy, alembic or database driver); run "
                 "`mlflow server --backend-store-uri` on it and give that server's http(s):// URL, or the stack's MLflow "
                 "App (its ARN: MLFLOW_TRACKING_URI in the Ray pods)")
    elif uri and scheme in DATABASE_SCHEMES and not all(importlib.util.find_spec(name) for name in ("sqlalchemy", "alembic")):
        p.append(f"tracking_uri={uri!r}: MLflow's database stores need sqlalchemy and alembic beside mlflow-skinny; "
                 "pip install sqlalchemy alembic (requirements-dev.txt pins them), or give an MLflow server's http(s):// URL")
    if config.register_model and not uri:
        p.append(f"register_model={config.register_model!r} needs a tracker: give --tracking-uri (or set MLFLOW_TRACKING_URI)")
    return p


def parse_config(argv: Sequence[str] | None = None, *, storage_path: str | None = None, validate: bool = True) -> TrainConfig:
    """Preset defaults, then command-line overrides, then every check (``validate``).
    ``storage_path``: the default storage path (else ``$RAY_TRAIN_EKS_STORAGE_PATH``)."""
    args = vars(build_parser().parse_args(argv))
    preset = args.get("preset") or TrainConfig.preset
    if preset not in PRESETS:
        raise ConfigError([f"preset={preset!r} is unknown; use one of {', '.join(sorted(PRESETS))}"])
    default_storage = storage_path if storage_path is not None else os.environ.get(STORAGE_PATH_ENV, "")
    values = {**PRESETS[preset], "preset": preset, "storage_path": default_storage}
    values.update({k: v for k, v in args.items() if v is not None or k in _OPTIONAL_INTS})
    kind = lambda v: (v.get("peft", "none"), v.get("objective", "sft"))  # noqa: E731
    if args.get("learning_rate") is None and kind(values) != kind(PRESETS[preset]):
        values.pop("learning_rate", None)  # a preset's rate is for its kind of run: the default of this kind instead
    if values.get("tracking_uri") is None:
        values["tracking_uri"] = os.environ.get("MLFLOW_TRACKING_URI") or None
    if values.get("tracking_uri") == "none":
        values["tracking_uri"] = None
    values.setdefault("experiment_name", os.environ.get("RAY_TRAIN_EKS_MLFLOW_EXPERIMENT") or None)
    config = TrainConfig(**values)
    return config.validate() if validate else config

"""The memory plan: bytes per GPU of a fine-tune, from the model's config alone (no weights),
before any node starts; and what to change when it does not fit.

    python -m training.modeling.plan --model Qwen/Qwen2.5-7B --gpu-type L4 --num-workers 8 --workers-per-node 4

It runs before Ray starts in every GPU run (training/train.py) and at ``cdk synth`` (the stack
knows the GPU type, the node count and ``trainingArgs``); a plan that does not fit stops the run
there. This module (and the model shapes it plans, :mod:`.shapes`) imports nothing but the standard
library: the CDK app imports it too.

What it counts, per GPU, with FSDP2 (``fully_shard`` per decoder layer and on the root, as
training/modeling/parallel.py applies it) and ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, AdamW:

- **parameters**: the sharded fp32 parameters. FSDP2 shards every parameter on dim 0 over the
  shard group, padding dim 0 to a multiple of the group size (torch 2.13
  ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, ``_init_sharded_param``: the padded
  local shard is ``ceil(dim0 / world) x rest``): so ``ceil(dim0 / S) x rest x 4`` bytes each.
  With HSDP the shard group is one node (``S = hsdp_shard_size``), not the world.
- **gradients**: the sharded gradients, in the parameters' dtype (fp32), the same count.
- **optimizer**: AdamW's ``exp_avg`` and ``exp_avg_sq``, fp32, per sharded element (torch
  ``optim/adamw.py``): 8 bytes per element.
- **gathered parameters**: while a layer computes, its parameters are all-gathered in bf16
  (2 bytes), and FSDP2 prefetches the next layer's (implicit forward/backward prefetch): two
  layers at a time; the root's (embedding, final norm, an untied head) stay gathered through
  the loss.
- **gradient buffers**: a layer's unsharded bf16 gradient and its fp32 copy for the
  reduce-scatter (``reduce_dtype``), 6 bytes per element of one layer; at the end of the
  backward, the root's (its own phase, when activations are already freed).
- **activations**: per token and layer, what autograd saves in a Qwen2/Llama block with a
  flash-attention kernel (bf16, 2 bytes; RMSNorm saves its fp32 input): two RMSNorms (6h bytes
  each), the q/k/v projection input (2h), q, k and v (2(q + 2kv), q = heads x head_dim, h
  in most families), the attention output (2q) and its log-sum-exp (4 per head), the MLP input
  (2h), gate, up, act(gate) and their product (4 x 2I): ``16h + 4q + 4kv + 8I + 4a`` bytes (derived as in Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022, section 4.1, for this block; no
  s^2 term: flash-attention keeps no score matrix). With activation checkpointing
  (transformers' ``gradient_checkpointing_enable``, one checkpoint per decoder layer) only each
  layer's input (2h per token per layer) is kept, plus one layer's activations while it is
  recomputed and its backward runs, plus the gradient flowing back (8h).
- **loss**: the final hidden states (bf16, their fp32 norm input and fp32 gradient: 10h per
  token) and one chunk of logits at a time (training/modeling/loss.py): bf16 logits, their fp32 copy,
  the fp32 gradient and the bf16 gradient of the matmul, 12 bytes per token and vocabulary entry
  (bench/train_throughput.py measures the loss step: 1.93 GiB at 8,192 tokens, chunk 1,024,
  vocabulary 151,936, hidden 1,536).
- **CUDA context and NCCL**: an allowance of 1.5 GiB for the CUDA context, cuBLAS workspaces
  and NCCL's buffers, which no formula gives; the first step of every run logs the planned
  peak against ``torch.cuda.max_memory_allocated``, so the allowance is checked on the first run.

- **the head's gradient**: the unsharded bf16 gradient of the head (or the tied embedding),
  ``2 x V x h`` bytes, alive from the first loss chunk's backward to the root's reduce-scatter.
- **the MLP backward's transients**: ``4I + 4h`` bytes per token of the layer whose backward runs.

These terms are never all alive at once. The plan is a list of **moments**, each with the tensors
alive in it (``python -m training.modeling.plan`` prints them), and the peak is the largest:

- *forward*: the states and the root's all-gather at the start of each micro-step's forward, the
  gathered root and the flat buffer it is copied out of (FSDP2 ``foreach_all_gather_copy_out``), which
  outlives the copy until the first layer's all-gather has made its buffer and copy;
- *last layer's forward*: every layer's saved activations, two gathered layers and, with activation
  checkpointing, the layer's own transients at its MLP (``2h + 3I`` bf16 elements a token, ``2I``
  more under LoRA: each adapter's output is added out of place);
- *loss forward*: the saved activations, the hidden states and one chunk's logits in bf16, fp32 and
  their log-softmax (10 bytes an entry; the chunk's checkpoint frees them);
- *load*: the sharded fp32 parameters and the one whole tensor being sent (training/modeling/load.py);
- *loss backward*: the states, the gathered root, the last layer (it keeps its parameters after the
  forward: training/modeling/parallel.py), every saved activation, the hidden states, one logits
  chunk and the head's gradient; no layer is recomputed yet. Where three of the head's gradients
  outweigh a chunk of logits and one (large hidden sizes), the first two chunks' gradients and their
  sum (autograd sums the first out of place: the first chunk's gradient is a transposed view) are
  the moment's largest;
- *last layer's backward*: the states, the gathered root, the saved activations, the recomputed
  layer, the gradient flowing back with the MLP's transients, two gathered layers (this one and
  the prefetched next), one layer's gradient buffers and the head's gradient; the logits are gone;
- *next layer's* and *first layer's backward*: the same, with the previous layer's fp32
  reduce-scatter input still in flight (FSDP2 keeps one until the next post-backward), fewer
  saved activations and more reduced gradients layer by layer (the two ends of a straight line);
- *root reduce*: the states and the root's gradient buffers (FSDP2 frees the gathered root before
  its reduce-scatter: ``_fsdp_param_group.py`` ``post_backward``); under LoRA with checkpointing the
  first layer's fp32 input gradient too;
- *optimizer step*: the states and every sharded gradient (fused AdamW and the clipping's norms make
  no tensor of a parameter's size).

**DPO** (``--objective dpo``, read through ``getattr``: SFT where the config has no such field): a
pair is two segments of one packed sequence, so the tokens a micro-batch holds are SFT's. The
reference (:attr:`Options.reference`, printed on the plan's first line): under LoRA the base with the
adapters off, a no-grad forward of each micro-batch before the policy's (*reference forward*: the
states, the gradients accumulated so far, a gathered layer with its all-gather buffer, the larger of
one layer's activations, ``4h + 3I`` bf16 elements a token, and the loss's hidden states with one chunk's logits; it
is the micro-step's first forward, so the *forward* moment's root all-gather is in it); a full
fine-tune's reference log-probs are computed in one no-grad pass before training (*reference pass*:
the fp32 parameters and the same transients, no gradient, no AdamW state) and kept, a few bytes a
pair; SimPO needs none. Neither is ever the peak.

The sharded gradients: while gradients accumulate over micro-steps, the earlier micro-steps' are
alive in every moment (with HSDP, FSDP2's ``partial_reduce_output`` holds them between the
cross-node all-reduces: the same bytes); with one micro-step per optimizer step, ``zero_grad``
freed them and a layer's appears at its reduce-scatter. A plan fits when the peak, plus a 5% margin
for the caching allocator's fragmentation, is at most the GPU's memory as ``nvidia-smi`` reports it.

**LoRA** (``--peft lora``, training/modeling/lora.py): the base is held frozen in the compute dtype
(no gradient, no optimizer state), the adapters (rank x (in + out) per targeted linear) in fp32 with
their gradients and AdamW state; each adapter adds its rank-wide output to a layer's activations
(with dropout also its mask and dropped input); the frozen head has no gradient; at the root's
reduce the gathered root stays (and, without activation checkpointing, the first layer, whose
post-backward FSDP2's final callback runs).

tests/training/test_plan.py checks every moment against the bytes alive in the project's own load
and step at real sizes (Qwen2.5-1.5B as HSDP 4 x 2, Qwen2.5-7B on 12 ranks, Llama-3.1-8B on 8, and
Qwen2.5-7B under LoRA DPO with dropout and no activation checkpointing, with fake tensors:
tests/training/fake_step_memory.py): none more than 2% under, none more than 10% over;
``python -m bench.plan_vs_fake_memory`` prints every GPU preset's moments (the lowest 0.99 of what
is alive, the layers' backward 2 to 8% above).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from .moments import (  # noqa: F401 - the plan's public names, importable from here
    CONTEXT_ALLOWANCE,
    FRAGMENTATION_MARGIN,
    GIB,
    GPU_MEMORY_MIB,
    REFERENCES,
    Options,
    Plan,
    plan,
)
from .shapes import TABLE_MODELS, ModelShape, model_shape  # noqa: F401 - ModelShape: public here too


def fixes(model: ModelShape, gpu: str, options: Options) -> list[str]:
    """What would make ``options`` fit, cheapest in throughput first, each with its planned
    peak; only the changes that fit (alone or with the ones before them) are named."""
    candidates: list[tuple[str, Options]] = []
    o = options
    if o.shard_size < o.num_workers:
        candidates.append(("--no-hsdp (shard over all workers: more cross-node traffic per micro-step)",
                           replace(o, shard_size=o.num_workers)))
    if not o.activation_checkpointing:
        candidates.append(("--activation-checkpointing (recompute each layer: about a third more compute)",
                           replace(o, activation_checkpointing=True)))
    if o.loss_chunk_tokens > 256:
        candidates.append(("--loss-chunk-tokens 256 (more, smaller head matmuls)", replace(o, loss_chunk_tokens=256)))
    batch = o.micro_batch_size
    while batch > 1:
        batch //= 2
        candidates.append((f"--micro-batch-size {batch} (smaller kernels; keep the global batch with more accumulation)",
                           replace(o, micro_batch_size=batch)))
    for nodes in (2, 3, 4, 6, 8):
        workers = o.workers_per_node * nodes
        if workers > o.num_workers:
            candidates.append((f"{nodes} GPU nodes with --no-hsdp ({workers} workers sharing the states: "
                               f"-c gpuNodeCount={nodes}; more cost, not less speed)",
                               replace(o, num_workers=workers, shard_size=workers)))
    seq = o.seq_len
    while seq > 512:
        seq //= 2
        candidates.append((f"--seq-len {seq} (shorter packed sequences: long samples are truncated)",
                           replace(o, seq_len=seq)))
    out, current = [], o
    for text, changed in candidates:
        alone = plan(model, gpu, changed)
        if alone.fits:
            out.append(f"{text}: {alone.needed / GIB:.1f} GiB")
            continue
        combined = _combine(current, changed)
        together = plan(model, gpu, combined)
        if together.fits:
            out.append(f"{text}, with the changes above: {together.needed / GIB:.1f} GiB")
        current = combined
    return out


def _combine(base: Options, changed: Options) -> Options:
    """``base`` with the fields ``changed`` changed relative to the options it came from."""
    smaller = {
        "shard_size": max(base.shard_size, changed.shard_size) if changed.num_workers == base.num_workers else changed.shard_size,
        "num_workers": max(base.num_workers, changed.num_workers),
        "micro_batch_size": min(base.micro_batch_size, changed.micro_batch_size),
        "seq_len": min(base.seq_len, changed.seq_len),
        "loss_chunk_tokens": min(base.loss_chunk_tokens, changed.loss_chunk_tokens),
        "activation_checkpointing": base.activation_checkpointing or changed.activation_checkpointing,
    }
    return replace(base, **smaller)


class DoesNotFit(ValueError):
    """A plan that does not fit, with the table and the fixes in its message."""

    def __init__(self, found: Plan, suggestions: list[str]):
        self.plan, self.suggestions = found, suggestions
        hint = ("; what would fit, cheapest first: " + "; ".join(suggestions)) if suggestions else \
            "; nothing this plan can change fits it: a larger GPU type (-c gpuInstanceType=p5.48xlarge) or a smaller model"
        super().__init__(f"{found.model.name} does not fit {found.options.num_workers} x {found.gpu}: "
                         f"{found.needed / GIB:.1f} GiB per GPU planned, {found.capacity / GIB:.1f} GiB there{hint}")


def check(model: ModelShape, gpu: str, options: Options) -> Plan:
    """The plan; raises :class:`DoesNotFit` naming the fixes when it does not fit."""
    found = plan(model, gpu, options)
    if not found.fits:
        raise DoesNotFit(found, fixes(model, gpu, options))
    return found


def check_sizes(model: ModelShape, gpu: str, options: Options, worker_counts: tuple[int, ...] = ()) -> list[Plan]:
    """:func:`check` at ``options`` (the run's size) and, for an elastic run (``worker_counts``:
    ``TrainConfig.worker_counts``), at its smallest size too: with HSDP (a shard group a node) a GPU
    holds the same at every size, with full sharding more on fewer GPUs; and more micro-batches
    accumulate. Returns the plans, largest first; :class:`DoesNotFit` names the size that does not fit."""
    return [check(model, gpu, sized) for sized in sizes_to_plan(options, worker_counts)]


def sizes_to_plan(options: Options, worker_counts: tuple[int, ...] = ()) -> list[Options]:
    """``options``, and for an elastic run the same at its smallest of ``worker_counts`` (the shard group
    no larger than the world there), largest first."""
    smallest = min(worker_counts, default=options.num_workers)
    if smallest >= options.num_workers:
        return [options]
    return [options, replace(options, num_workers=smallest, shard_size=min(options.shard_size, smallest))]


def choose_sharding(model: ModelShape, gpu: str, options: Options, *, hsdp_asked: bool | None) -> tuple[Options, str | None]:
    """HSDP only where its shard group has room: when HSDP is the default (not asked for) and
    its plan does not fit but full sharding's does, full sharding, with the reason."""
    if hsdp_asked is not None or options.shard_size >= options.num_workers or plan(model, gpu, options).fits:
        return options, None
    full = replace(options, shard_size=options.num_workers)
    found = plan(model, gpu, full)
    if not found.fits:
        return options, None
    return full, (f"HSDP (shard {options.shard_size}) would need {plan(model, gpu, options).needed / GIB:.1f} GiB per "
                  f"{gpu}; sharding over all {options.num_workers} workers instead ({found.needed / GIB:.1f} GiB)")


#: Micro-batches the plan tries where the user chose none, largest first: past 8 packed sequences
#: per forward (16k tokens at 2048) a GPU's kernels gain little more, and memory keeps growing.
MICRO_BATCH_CHOICES = (8, 4, 2, 1)
#: A configuration the plan chooses itself keeps this share of the GPU free beyond the plan's own
#: margin: no GPU has measured the plan yet (the calibration line of the first run on each GPU
#: type does), and a user who asked for nothing should not get a run at the edge of memory.
CHOICE_HEADROOM = 0.10


def choose_fastest(model: ModelShape, gpu: str, options: Options, *, checkpointing_asked: bool | None,
                   micro_batch_asked: int | None, global_batch_size: int,
                   per_worker: int | None = None) -> tuple[Options, str | None]:
    """The fastest configuration that fits, for what the user left to the plan (None): activation
    checkpointing off where it fits with a micro-batch of at least 2 (checkpointing recomputes every
    layer's forward in the backward, 25 to 33% of a step), else on; then the largest micro-batch of
    :data:`MICRO_BATCH_CHOICES` that fits, with :data:`CHOICE_HEADROOM` to spare, and divides the
    global batch per worker (fewer, larger kernels; the same global batch, so the same training).
    What the user gave is kept. ``per_worker``: the sequences per worker each size divides (an
    elastic run's, ``TrainConfig.sequences_per_worker``); default the global batch per worker. Returns the
    options and the choice with its headroom (None: nothing left to choose, or nothing fits, which
    ``check`` then reports with ``options`` as without a plan)."""
    if checkpointing_asked is not None and micro_batch_asked is not None:
        return options, None
    per_worker = per_worker or global_batch_size // options.num_workers
    micros = ([micro_batch_asked] if micro_batch_asked is not None
              else [m for m in MICRO_BATCH_CHOICES if per_worker % m == 0] or [1])
    for checkpointing in ([checkpointing_asked] if checkpointing_asked is not None else [False, True]):
        for micro in micros:
            if not checkpointing and checkpointing_asked is None and micro < min(2, micros[0]):
                continue  # one sequence per forward without checkpointing: the checkpointed larger batch is faster
            chosen = replace(options, activation_checkpointing=checkpointing, micro_batch_size=micro)
            found = plan(model, gpu, chosen)
            if found.fits and found.headroom >= CHOICE_HEADROOM * found.capacity:
                accumulation = global_batch_size // options.num_workers // micro  # at the run's size
                return chosen, (f"chose activation checkpointing {'on' if checkpointing else 'off'}, micro-batch {micro} "
                                f"({accumulation} accumulation step{'s' if accumulation != 1 else ''}): "
                                f"{found.needed / GIB:.1f} GiB of {found.capacity / GIB:.1f} per {gpu}, "
                                f"{found.headroom / GIB:.1f} GiB headroom (an option on the command line is kept)")
    return options, None


def job_options(model: ModelShape, gpu: str, config) -> tuple[Options, list[str]]:
    """The options a job with TrainConfig ``config`` is planned and run with (training/train.py
    ``plan_memory`` before Ray starts, ``cdk synth``, ``python -m training.modeling.plan``): its
    sharding (:func:`choose_sharding`), then the fastest configuration that fits for what it left
    open (:func:`choose_fastest`), full sharding where HSDP (only a default) fits no micro-batch;
    with the lines saying what was chosen. ValueError: LoRA targets the model does not have."""
    if getattr(config, "peft", "none") == "lora":
        model.lora_targets(config.lora_target_modules)  # ValueError naming this model's linear layers

    def fastest(options: Options) -> tuple[Options, str | None]:
        return choose_fastest(model, gpu, options, checkpointing_asked=config.activation_checkpointing,
                              micro_batch_asked=config.micro_batch_size, global_batch_size=config.global_batch_size,
                              per_worker=getattr(config, "sequences_per_worker", None))

    options, why = choose_sharding(model, gpu, Options.of(config), hsdp_asked=config.hsdp)
    hsdp = options
    options, chose = fastest(options)
    if (config.hsdp is None and hsdp.shard_size < hsdp.num_workers and chose is None
            and not plan(model, gpu, options).fits):
        # HSDP fits no micro-batch: full sharding may, with a smaller one than the defaults'.
        full, chose_full = fastest(replace(hsdp, shard_size=hsdp.num_workers))
        if plan(model, gpu, full).fits:
            why = (f"HSDP (shard {hsdp.shard_size}) fits no micro-batch on {gpu}; sharding over all {hsdp.num_workers} "
                   "workers instead")
            options, chose = full, chose_full
    return options, [line for line in (why, chose) if line]


def gpu_type_of(device_name: str) -> str | None:
    """The plan's GPU type of a CUDA device name (``NVIDIA L4``, ``NVIDIA H100 80GB HBM3``)."""
    for gpu in sorted(GPU_MEMORY_MIB, key=len, reverse=True):
        if f" {gpu}" in f" {device_name}":
            return gpu
    return None


#: The GPU set-ups of the README's table: (label, GPU model, nodes, GPUs per node).
TABLE_SETUPS = (("2 x g6.12xlarge (8 L4)", "L4", 2, 4), ("3 x g6.12xlarge (12 L4)", "L4", 3, 4),
                ("1 x p4d.24xlarge (8 A100 40 GB)", "A100", 1, 8), ("1 x p5.48xlarge (8 H100)", "H100", 1, 8),
                ("2 x p5.48xlarge (16 H100)", "H100", 2, 8))


def fit_table(micro_batch_size: int = 4, seq_len: int = 2048) -> str:
    """The README's table: planned GiB per GPU of each well-known model on each set-up, with the
    default options (micro-batch 4 x 2048, activation checkpointing, chunk 1,024, bf16; HSDP
    across nodes where its shard group has room, else full sharding)."""
    rows = ["| model | " + " | ".join(label for label, *_ in TABLE_SETUPS) + " |",
            "|---|" + "---|" * len(TABLE_SETUPS)]
    for name, shape in TABLE_MODELS.items():
        cells = []
        for _, gpu, nodes, per_node in TABLE_SETUPS:
            workers = nodes * per_node
            options = Options(num_workers=workers, workers_per_node=per_node, shard_size=per_node if nodes > 1 else workers,
                              micro_batch_size=micro_batch_size, seq_len=seq_len)
            options, _ = choose_sharding(shape, gpu, options, hsdp_asked=None)
            found = plan(shape, gpu, options)
            cells.append(f"{found.needed / GIB:.1f}" if found.fits else f"no ({found.needed / GIB:.1f})")
        rows.append(f"| {name} ({shape.parameters / 1e9:.1f} B) | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m training.modeling.plan``: the training options as ``python -m training.train`` takes
    them, plus ``--gpu-type``; prints the table (and the fixes), exit 1 when it does not fit."""
    parser = argparse.ArgumentParser(prog="python -m training.modeling.plan", description=main.__doc__)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--table", action="store_true", help="print the README's table of models and GPU set-ups")
    own, rest = parser.parse_known_args(argv)
    if own.table:
        print(fit_table(), end="")
        return 0
    from ..config import parse_config

    config = parse_config(rest, storage_path="s3://plan-only/runs")  # a plan needs no storage
    if not config.gpu_type:
        parser.error("--gpu-type is needed (L4, A10G, A100, H100 or H200)")
    from ..storage.sources import read_model_config

    shape = model_shape(config.model, config_reader=read_model_config)
    try:
        options, chosen = job_options(shape, config.gpu_type, config)
    except ValueError as error:
        parser.error(str(error))
    found = [plan(shape, config.gpu_type, sized) for sized in sizes_to_plan(options, config.worker_counts)]
    if own.json:  # an elastic run's smallest size beside the largest
        print(json.dumps({**found[0].to_dict(), "chosen": chosen, **({"smallest": found[1].to_dict()} if found[1:] else {})}))
    else:
        for line in chosen:
            print(f"[plan] {line}")
    for each in found:
        if not own.json:
            print(each.table())
        if not each.fits:
            for line in fixes(shape, config.gpu_type, each.options):
                print(f"  fix: {line}")
    return 0 if all(each.fits for each in found) else 1


if __name__ == "__main__":
    sys.exit(main())

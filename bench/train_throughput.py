"""Benchmark: the production training step against dynamic padding (and, on GPU, the AWS
sample's wrapping), on several workers, plus the loss step's memory and the network model.

    python -m bench.train_throughput                    # CPU: a small Qwen2, 2 gloo workers
    python -m bench.train_throughput --json bench.json  # GPU: Qwen2.5-1.5B architecture, one NCCL worker per GPU

Variants (each in fresh processes, ``--workers`` ranks, the same samples in the same order,
the same activation checkpointing and attention implementation):
  ours             packed rows flattened into one row per micro-batch, FSDP2 per decoder
                   layer + root, chunked loss (training.train_step: the production step)
  dynamic-padding  the same samples per micro-step, each micro-batch padded to its longest
                   sample with an attention mask (what Hugging Face's collators do), the
                   same FSDP2 wrapping and loss: the layout is the only difference
  lora             "ours" under --peft lora's defaults (rank 8, alpha 16, every linear layer):
                   the base frozen in the compute dtype, fp32 adapters, AdamW on the adapters
                   alone; the same model, samples and step: LoRA's tokens/s and peak memory
                   against the full fine-tune's
  aws-sample       GPU only: dynamic padding, FSDP1 around the whole model as Ray's
                   ``prepare_model(parallel_strategy="fsdp")`` builds it, transformers' own
                   loss over full logits

Also: the loss step alone at the L4 preset's shape (micro-batch x seq tokens, hidden 1536,
vocabulary 151,936), with and without the chunked loss, each in a fresh process; and the
bytes-per-step model of training.modeling.traffic for FSDP and HSDP at the preset's shape.
On a GPU the "ours" variant also reports the memory plan's tensors (``planned_tensor_gib``,
training/modeling/plan.py) beside the measured ``peak_memory_gib``. On a GPU, the "ours" variant's first measured step runs under ``torch.cuda.set_sync_debug_mode``
and reports the host syncs its forward and backward make (``host_syncs_in_forward_backward``).
Prints figures and a JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.data import IGNORE_INDEX, MicroBatch, pack
from training.modeling.loss import chunked_cross_entropy_sum, full_logits_cross_entropy_sum
from training.telemetry.metrics import device_peak_tflops, flops_shape, mfu, peak_memory_gib, step_flops
from training.modeling.model import CausalLMForSFT
from training.modeling.parallel import apply_activation_checkpointing, apply_fsdp, build_mesh
from training.modeling.traffic import step_traffic

QWEN2_5_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                    tie_word_embeddings=True, rope_theta=1e6)
#: A small Qwen2 for CPU runs: big enough that the step's time is the model's work, not
#: fixed costs (the tiny test model's step is mostly collectives and Python).
SMALL = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
#: The L4 preset (training.config): 8 workers, 4 per node, micro-batch 4 x 2048, 2 micro-steps.
PRESET = dict(num_workers=8, workers_per_node=4, micro_batch=4, seq_len=2048, accumulation=2)


def sft_like_samples(n: int, *, vocab: int, max_len: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Token samples whose lengths follow an SFT-like long tail (median about max_len/6),
    the first 40% of each a prompt (no loss)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(max_len / 6), 0.7, size=n).astype(int), 16, max_len)
    samples = []
    for length in lengths:
        ids = rng.integers(10, vocab, size=length).tolist()
        prompt = int(length * 0.4)
        samples.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return samples


def padded_micro_batch(samples, device: torch.device) -> tuple[dict, torch.Tensor, int, int]:
    """Samples padded to the longest of them, with an attention mask (dynamic padding)."""
    longest = max(len(ids) for ids, _ in samples)
    ids = np.zeros((len(samples), longest), dtype=np.int64)
    labels = np.full((len(samples), longest), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(samples), longest), dtype=np.int64)
    for row, (sample_ids, sample_labels) in enumerate(samples):
        n = len(sample_ids)
        ids[row, :n], labels[row, :n], mask[row, :n] = sample_ids, sample_labels, 1
        labels[row, 0] = IGNORE_INDEX
    inputs = {"input_ids": torch.from_numpy(ids).to(device), "attention_mask": torch.from_numpy(mask).to(device)}
    return inputs, torch.from_numpy(labels).to(device), int(mask.sum()), ids.size


def build_model(name: str, attn: str, checkpointing: bool) -> CausalLMForSFT:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**(SMALL if name == "small" else QWEN2_5_1_5B))
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    lm.config.use_cache = False
    if checkpointing:
        apply_activation_checkpointing(lm)
    lm.train()
    return CausalLMForSFT(lm)


def _rank_main(rank: int, world: int, variant: str, args: argparse.Namespace, store: str, out: str) -> None:
    from training.data import collate
    from training.modeling.step import train_step

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = build_model(args.model, args.attn, args.activation_checkpointing).to(device)
    shape = flops_shape(model)
    if variant == "lora":
        # The same model and step under --peft lora's defaults: the base frozen in the compute dtype,
        # rank-8 fp32 adapters on every linear layer (training/modeling/lora.py), as load_sharded builds it.
        from training.modeling.lora import LoraSettings, add_adapters

        if gpu:
            model.lm.to(torch.bfloat16)
        model.lm = add_adapters(model.lm, LoraSettings(rank=8, alpha=16.0, dropout=0.0), seed=0)
        model.lm.train()
    if variant == "aws-sample":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

        lm = FullyShardedDataParallel(model.lm, device_id=device, mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    else:
        apply_fsdp(model, mesh=build_mesh(device_type=device.type, world_size=world, shard_size=world),
                   mixed_precision="bf16" if gpu else "fp32")
    # FSDP1 moves the parameters into flat parameters of its wrapper: optimise those.
    optimizer = torch.optim.AdamW([p for p in (lm if variant == "aws-sample" else model).parameters() if p.requires_grad],
                                  lr=1e-5)

    samples = sft_like_samples(args.samples, vocab=model.config.vocab_size, max_len=args.seq_len)
    packed = pack(samples, seq_len=args.seq_len, pad_id=0)
    per_row = len(samples) / len(packed)
    # The same samples per micro-step in both layouts: a packed row holds per_row samples on average.
    per_micro_batch = max(1, round(args.micro_batch * per_row))
    useful = computed = 0
    flops = seconds = 0.0
    host_syncs = None  # measured on a GPU only (torch.cuda.set_sync_debug_mode)
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        if variant in ("ours", "lora"):
            rows = np.arange(args.micro_batch) + (step * world + rank) * args.micro_batch
            batches = [collate(packed, rows % len(packed), device)]
            real = sum(b.real_tokens for b in batches)
            lengths = [n for b in batches for n in b.sample_lengths]
            trained = sum(b.label_tokens for b in batches)
            total = args.micro_batch * args.seq_len
        else:
            first = (step * world + rank) * per_micro_batch
            chosen = [samples[i % len(samples)] for i in range(first, first + per_micro_batch)]
            inputs, labels, real, total = padded_micro_batch(chosen, device)
            lengths = [len(ids) for ids, _ in chosen]
            # Position t learns labels[t + 1]: the trained flat positions, on the CPU as in collate.
            targets = np.pad(labels[:, 1:].cpu().numpy(), ((0, 0), (0, 1)), constant_values=IGNORE_INDEX).reshape(-1)
            positions = np.flatnonzero(targets != IGNORE_INDEX)
            trained = len(positions)
        if gpu:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        if variant == "ours" and gpu and step == args.warmup:
            # The first measured step under torch's sync debug mode: every host sync in forward and
            # backward warns (transformers' packed-sequence check did, before the no-mask mapping).
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    train_step(model, batches, normaliser=float(max(1, trained)), cross_node_sync=False)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            host_syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
        elif variant in ("ours", "lora"):
            # The normaliser is a CPU number in production too (the data order gives the global count).
            train_step(model, batches, normaliser=float(max(1, trained)), cross_node_sync=False)
        elif variant == "dynamic-padding":
            batch = MicroBatch(inputs=inputs, labels=labels, trained_positions=torch.from_numpy(positions).to(device),
                               real_tokens=real, label_tokens=trained, sample_lengths=tuple(lengths))
            train_step(model, [batch], normaliser=float(max(1, trained)), cross_node_sync=False)
        else:
            lm(**inputs, labels=labels, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            seconds += time.perf_counter() - started
            useful += real
            computed += total
            flops += step_flops(**shape, tokens=sum(lengths), trained_tokens=trained, squared_lengths=sum(n * n for n in lengths))
    totals = torch.tensor([useful, computed, flops], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    longest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    if rank == 0:
        useful_all, computed_all, flops_all = totals.tolist()
        wall = longest.item()
        with open(out, "w") as handle:
            json.dump({
                "variant": variant,
                "workers": world,
                "steps": args.steps,
                "useful_tokens_per_s": round(useful_all / wall, 1),
                "padding_fraction": round(1 - useful_all / computed_all, 3),
                "mfu": mfu(flops_per_s=flops_all / wall / world, peak_tflops=device_peak_tflops(device)),
                "peak_memory_gib": round(peak_memory_gib(device), 3),
                "samples_per_micro_step": round(per_row * args.micro_batch, 1) if variant in ("ours", "lora") else per_micro_batch,
                "planned_tensor_gib": _planned_tensor_gib(model, device, world, args) if variant == "ours" else None,
                "host_syncs_in_forward_backward": None if host_syncs is None else len(host_syncs),
                "host_sync_sites": sorted(set(host_syncs or [])),
            }, handle)
    dist.destroy_process_group()


def _planned_tensor_gib(model, device: torch.device, world: int, args: argparse.Namespace) -> float | None:
    """On a GPU the memory plan knows: what training/modeling/plan.py plans for this run's tensors (its
    peak less the CUDA context allowance), to set against ``peak_memory_gib`` (torch's
    ``max_memory_allocated``): the check of the plan's activation and buffer terms."""
    from training.modeling.plan import CONTEXT_ALLOWANCE, GIB, ModelShape, Options, gpu_type_of, plan

    gpu = gpu_type_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if gpu is None:
        return None
    options = Options(num_workers=world, workers_per_node=world, shard_size=world, micro_batch_size=args.micro_batch,
                      seq_len=args.seq_len, activation_checkpointing=args.activation_checkpointing)
    found = plan(ModelShape.from_config(model.config.to_dict()), gpu, options)
    return round((found.peak - CONTEXT_ALLOWANCE) / GIB, 3)


def run_variant(variant: str, args: argparse.Namespace, world: int) -> dict:
    """One variant on ``world`` fresh processes (so peak memory is the variant's own)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "result.json")
        mp.spawn(_rank_main, args=(world, variant, args, os.path.join(scratch, "store"), out), nprocs=world, join=True)
        with open(out) as handle:
            return json.load(handle)


def _loss_step(chunked: bool, tokens: int, out: str) -> None:
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, tokens, 1536, generator=generator) * 0.1).to(device, dtype).requires_grad_()
    weight = (torch.randn(151936, 1536, generator=generator) * 0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, 151936, (1, tokens), generator=generator)
    labels[0, : int(tokens * 0.4)] = IGNORE_INDEX  # prompts carry no loss, as in SFT
    labels = labels.to(device)
    if gpu:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    if chunked:
        loss = chunked_cross_entropy_sum(hidden, weight, labels)
    else:
        loss = full_logits_cross_entropy_sum(hidden, weight, labels)
    loss.backward()
    seconds = time.perf_counter() - started
    peak = (torch.cuda.max_memory_allocated(device) if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    with open(out, "w") as handle:
        json.dump({"chunked": chunked, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
                   "peak_gib_above_inputs": round(peak / 2**30, 2), "seconds": round(seconds, 1)}, handle)


def loss_step_memory(chunked: bool, tokens: int) -> dict:
    """Peak memory of one loss forward and backward above its inputs, in a fresh process."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "loss.json")
        process = mp.get_context("spawn").Process(target=_loss_step, args=(chunked, tokens, out))
        process.start()
        process.join()
        with open(out) as handle:
            return json.load(handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpus = torch.cuda.device_count()
    parser.add_argument("--model", default="qwen2.5-1.5b" if gpus else "small", choices=["small", "qwen2.5-1.5b"])
    parser.add_argument("--workers", type=int, default=gpus or 2, help="ranks (one per GPU on GPU)")
    parser.add_argument("--seq-len", type=int, default=2048 if gpus else 256)
    parser.add_argument("--micro-batch", type=int, default=PRESET["micro_batch"], help="packed rows per micro-step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--attn", default="flash_attention_2" if gpus else "sdpa")
    parser.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--loss-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the loss step at the preset's shape (minutes on CPU)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    variants = ["dynamic-padding", "ours", "lora"] + (["aws-sample"] if gpus else [])
    results = [run_variant(variant, args, args.workers) for variant in variants]
    tokens = PRESET["micro_batch"] * PRESET["seq_len"]
    loss_memory = [loss_step_memory(chunked, tokens) for chunked in (False, True)] if args.loss_memory else []
    params = 1_543_714_304  # Qwen2.5-1.5B
    traffic = {
        mode: step_traffic(params=params, num_workers=PRESET["num_workers"], workers_per_node=PRESET["workers_per_node"],
                           accumulation=PRESET["accumulation"], hsdp=mode == "hsdp")
        for mode in ("fsdp", "hsdp")
    }

    device = torch.cuda.get_device_name(0) if gpus else "CPU"
    print(f"\nTraining step, {args.model}, seq_len {args.seq_len}, micro-batch {args.micro_batch} rows, {device}, "
          f"{args.workers} workers, activation checkpointing {'on' if args.activation_checkpointing else 'off'}, {args.attn}")
    print(f"{'variant':<17}{'useful tok/s':>14}{'MFU':>8}{'peak GiB':>10}{'padding':>9}")
    for r in results:
        mfu_text = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(f"{r['variant']:<17}{r['useful_tokens_per_s']:>14,.0f}{mfu_text:>8}{r['peak_memory_gib']:>10.2f}{r['padding_fraction']:>9.0%}")
    by_name = {r["variant"]: r for r in results}
    speedup = by_name["ours"]["useful_tokens_per_s"] / by_name["dynamic-padding"]["useful_tokens_per_s"]
    print(f"ours / dynamic padding, useful tokens per second: {speedup:.2f}x")
    lora, full = by_name["lora"], by_name["ours"]
    print(f"LoRA (rank 8, every linear layer) / full fine-tune, same model and step: tokens per second "
          f"{lora['useful_tokens_per_s'] / full['useful_tokens_per_s']:.2f}x, peak memory "
          f"{lora['peak_memory_gib']:.2f} against {full['peak_memory_gib']:.2f} GiB")
    if loss_memory:
        plain, chunked = loss_memory
        print(f"\nLoss step at the L4 preset's shape ({tokens:,} tokens x vocabulary 151,936, hidden 1,536, {plain['dtype']}):")
        print(f"  full logits: {plain['peak_gib_above_inputs']:.2f} GiB peak ({plain['seconds']} s); "
              f"chunked: {chunked['peak_gib_above_inputs']:.2f} GiB ({chunked['seconds']} s); "
              f"{plain['peak_gib_above_inputs'] / max(chunked['peak_gib_above_inputs'], 1e-9):.1f}x less")
    print(f"\nBytes per rank per optimizer step, Qwen2.5-1.5B, {PRESET['num_workers']} workers on "
          f"{PRESET['num_workers'] // PRESET['workers_per_node']} nodes, {PRESET['accumulation']} micro-steps (model, training/modeling/traffic.py):")
    for mode, t in traffic.items():
        print(f"  {mode.upper():<5} across nodes {t.cross_node / 1e9:6.2f} GB   within a node {t.within_node / 1e9:6.2f} GB")
    payload = {"device": device, "model": args.model, "workers": args.workers, "seq_len": args.seq_len,
               "micro_batch": args.micro_batch, "results": results, "speedup_vs_dynamic_padding": round(speedup, 3),
               "loss_step_memory": loss_memory,
               "traffic_bytes_per_rank_per_step": {mode: vars(t) for mode, t in traffic.items()}}
    print(json.dumps(payload))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)


if __name__ == "__main__":
    main()

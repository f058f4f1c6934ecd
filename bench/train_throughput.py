"""Benchmark: our training step against the AWS sample's approach, same data, same run.

    python -m bench.train_throughput            # CPU: tiny Qwen2; GPU: Qwen2.5-1.5B architecture, random weights
    python -m bench.train_throughput --steps 20 --json bench-result.json

ours:     FSDP2 per decoder layer + root, packed sequences (no padding), activation
          checkpointing as configured (on for the GPU run, as in the production preset)
baseline: FSDP1 with size-based auto-wrapping, no activation checkpointing, every sample
          padded to the sequence length (the AWS sample's approach)

Both see the same SFT-like samples (varied lengths) and report useful (non-padding)
tokens per second, MFU against the device's peak and peak memory. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from training.data import IGNORE_INDEX, pack
from training.metrics import device_peak_tflops, mfu, model_flops_per_token, peak_memory_gib
from training.parallel import apply_activation_checkpointing, apply_fsdp, build_mesh


def sft_like_samples(n: int, *, vocab: int, max_len: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Token samples whose lengths follow an SFT-like long tail (median about max_len/6)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(max_len / 6), 0.7, size=n).astype(int), 16, max_len)
    samples = []
    for length in lengths:
        ids = rng.integers(10, vocab, size=length).tolist()
        prompt = int(length * 0.4)
        samples.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return samples


def padded(samples, *, seq_len: int, pad_id: int):
    """One sample per row, padded to ``seq_len`` (the baseline's input)."""
    rows = len(samples)
    ids = np.full((rows, seq_len), pad_id, dtype=np.int64)
    labels = np.full((rows, seq_len), IGNORE_INDEX, dtype=np.int64)
    real = np.zeros((rows, seq_len), dtype=np.int64)
    for row, (sample_ids, sample_labels) in enumerate(samples):
        n = min(len(sample_ids), seq_len)
        ids[row, :n], labels[row, :n], real[row, :n] = sample_ids[:n], sample_labels[:n], 1
    return ids, labels, real


def build_model(name: str, device: torch.device, attn: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    if name == "tiny":
        config = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    else:  # Qwen2.5-1.5B's architecture, random weights: nothing is downloaded
        config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                             num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                             tie_word_embeddings=True, rope_theta=1e6)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False
    return model.to(device)


def run_variant(variant: str, *, args, device, samples) -> dict:
    model = build_model(args.model, device, args.attn)
    flops = model_flops_per_token(model, args.seq_len)
    bf16 = device.type == "cuda"
    if variant == "ours":
        if args.activation_checkpointing:
            apply_activation_checkpointing(model)
        apply_fsdp(model, mesh=build_mesh(device_type=device.type, world_size=1, shard_size=1),
                   mixed_precision="bf16" if bf16 else "fp32")
        data = pack(samples, seq_len=args.seq_len, pad_id=0)
        batches = [(data.input_ids[i:i + args.micro_batch], data.labels[i:i + args.micro_batch],
                    data.position_ids[i:i + args.micro_batch], data.real[i:i + args.micro_batch])
                   for i in range(0, len(data) - args.micro_batch + 1, args.micro_batch)]
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

        # FSDP1 refuses CPU-only hosts; there the baseline runs unwrapped (one worker:
        # no sharding to compare, padding vs packing is what the CPU figures show).
        model = model if device.type != "cuda" else FSDP(model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=int(1e6) if args.model != "tiny" else 2000),
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None,
                     device_id=device if device.type == "cuda" else None, use_orig_params=True)
        ids, labels, real = padded(samples, seq_len=args.seq_len, pad_id=0)
        batches = [(ids[i:i + args.micro_batch], labels[i:i + args.micro_batch], None, real[i:i + args.micro_batch])
                   for i in range(0, len(ids) - args.micro_batch + 1, args.micro_batch)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    useful_tokens, seconds, steps = 0, 0.0, 0
    for index, (ids, labels, positions, real) in enumerate(batches[: args.steps + args.warmup]):
        inputs = {"input_ids": torch.from_numpy(ids).to(device), "labels": torch.from_numpy(labels).to(device)}
        if positions is not None:
            inputs["position_ids"] = torch.from_numpy(positions).to(device)
        else:
            inputs["attention_mask"] = torch.from_numpy(real).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= args.warmup:
            seconds += time.perf_counter() - start
            useful_tokens += int(real.sum())
            steps += 1
    tokens_per_s = useful_tokens / seconds
    return {
        "variant": variant,
        "steps": steps,
        "useful_tokens_per_s": round(tokens_per_s, 1),
        "mfu": mfu(tokens_per_s=tokens_per_s, flops_per_token=flops, peak_tflops=device_peak_tflops(device)),
        "peak_memory_gib": round(peak_memory_gib(device), 3),
        "padding_fraction": round(1 - useful_tokens / (steps * args.micro_batch * args.seq_len), 3),
        "wrapping": ("FSDP2 per layer" if variant == "ours" else "FSDP1 size-based" if device.type == "cuda" else "none (FSDP1 needs a GPU)"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = torch.cuda.is_available()
    parser.add_argument("--model", default="qwen2.5-1.5b" if gpu else "tiny", choices=["tiny", "qwen2.5-1.5b"])
    parser.add_argument("--seq-len", type=int, default=2048 if gpu else 256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=gpu)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    store = tempfile.mktemp()
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    vocab = 384 if args.model == "tiny" else 151936
    samples = sft_like_samples(args.samples, vocab=vocab, max_len=args.seq_len)
    results = [run_variant(v, args=args, device=device, samples=samples) for v in ("baseline", "ours")]
    dist.destroy_process_group()
    os.path.exists(store) and os.remove(store)

    name = torch.cuda.get_device_name(device) if gpu else "CPU"
    print(f"\nTraining step, {args.model}, seq_len {args.seq_len}, micro-batch {args.micro_batch}, {name}, 1 worker")
    print(f"{'variant':<10}{'useful tok/s':>14}{'MFU':>8}{'peak GiB':>10}{'padding':>9}")
    for r in results:
        mfu_text = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(f"{r['variant']:<10}{r['useful_tokens_per_s']:>14,.0f}{mfu_text:>8}{r['peak_memory_gib']:>10.2f}{r['padding_fraction']:>9.0%}")
    speedup = results[1]["useful_tokens_per_s"] / results[0]["useful_tokens_per_s"]
    print(f"ours / baseline useful tokens per second: {speedup:.2f}x")
    payload = {"device": name, "model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
               "results": results, "speedup": round(speedup, 3)}
    print(json.dumps(payload))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)


if __name__ == "__main__":
    main()

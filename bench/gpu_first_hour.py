"""The first GPU hour, prepared: one process, no Ray, under 8 minutes on one GPU, the figures the
README lacks, one table.

    python -m bench.gpu_first_hour --out /tmp/first-hour          # on the GPU
    python -m bench.gpu_first_hour --cpu --out /tmp/first-hour    # the dry run (the tests run it)

Parts, each with its own time budget, each run even if another failed (its error is its row):

1. step: tokens/s and MFU of the project's step (CausalLMForSFT, FSDP2 on a one-GPU mesh, the
   chunked loss, packed rows through the varlen call) against the seed sample's loop (FSDP1 around
   the whole model as Ray's ``prepare_model`` wraps it, dynamic padding, transformers' loss over
   the full logits), Qwen2.5-1.5B's shape with random weights (nothing downloaded), same samples.
2. attention: the kernel that ran, and one attention call's time per kernel the machine has
   (flash-attn's varlen when importable; PyTorch's fused sdpa per segment).
3. memory: the plan's terms (training/modeling/plan.py) against ``max_memory_allocated`` after a
   step that has optimizer state (the peak reset after the first), reserved over allocated,
   allocator retries, device memory outside the allocator, and the build's peak.
4. syncs: host syncs over a few steps under ``torch.cuda.set_sync_debug_mode("warn")``.
5. families: every family the CPU tests run (training/modeling/families.py), one packed step on
   the device against the per-sample reference (the relative difference of the losses).
6. checkpointing: activation checkpointing off against on (tokens/s, peak memory), and the
   packed rows with their pads run through the model (before) against left out (now): tokens/s
   and the padding share, on the same data.

Uses only the project's code and what the device's image has (torch, transformers, numpy).
``--cpu`` goes through every part at tiny shapes with gloo, skipping the CUDA calls, so the script
has run before it meets its GPU. Writes ``results.json`` and ``table.txt`` under ``--out``.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench.train_throughput import QWEN2_5_1_5B, padded_micro_batch, sft_like_samples
from training.data import collate, pack
from training.modeling.attention import FLASH, hf_attention, sdpa_per_segment_attention
from training.modeling.loss import IGNORE_INDEX
from training.modeling.model import for_training
from training.modeling.parallel import apply_fsdp, build_mesh
from training.modeling.step import train_step
from training.telemetry.metrics import device_peak_tflops, flops_shape, mfu, step_flops

#: Seconds each part may take on the GPU (about 7 minutes together, with the set-up).
BUDGETS = {"step": 150, "attention": 30, "memory": 45, "syncs": 30, "families": 45, "checkpointing": 100}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


class OverBudget(RuntimeError):
    """A part ran out of its time."""


class Run:
    """What the parts share: the device, the shapes, the samples, the kernel, the deadline."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.cpu = args.cpu or not torch.cuda.is_available()
        self.device = torch.device("cpu") if self.cpu else torch.device("cuda", 0)
        self.config = dict(TINY if self.cpu else QWEN2_5_1_5B)
        self.seq_len, self.micro_batch = (128, 2) if self.cpu else (2048, 4)
        self.steps, self.warmup = (2, 1) if self.cpu else (args.steps, 2)
        self.mixed_precision = "fp32" if self.cpu else "bf16"
        self.samples = sft_like_samples(400 if self.cpu else 4000, vocab=self.config["vocab_size"], max_len=self.seq_len)
        self.packed = pack(self.samples, seq_len=self.seq_len, pad_id=0)
        self.kernel_name, self.kernel = self._kernel()
        self.deadline = float("inf")
        self.build_peak_gib: float | None = None

    def _kernel(self):
        if self.cpu:
            from training.modeling.attention import reference_varlen_attention

            return "reference varlen kernel (plain torch, CPU)", reference_varlen_attention
        try:
            from flash_attn import flash_attn_varlen_func

            return "flash-attn varlen", flash_attn_varlen_func
        except Exception:  # noqa: BLE001 - not installed, or built for another torch
            return "sdpa per segment (PyTorch's fused kernels; flash-attn not importable)", sdpa_per_segment_attention

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise OverBudget("over its time budget")

    def sync(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize(self.device)

    def hf_config(self):
        from transformers import Qwen2Config

        return Qwen2Config(**self.config)

    def our_model(self, *, checkpointing: bool = True):
        """The project's model, built on the device with random weights and sharded on a one-rank mesh."""
        from transformers import AutoModelForCausalLM

        gc.collect()  # FSDP's hooks make cycles: the previous part's model goes only now
        if not self.cpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        torch.manual_seed(0)
        name = hf_attention(FLASH, self.device, kernel=self.kernel)
        with torch.device(self.device):
            lm = AutoModelForCausalLM.from_config(self.hf_config(), dtype=torch.float32, attn_implementation=name)
        model = apply_fsdp(for_training(lm, activation_checkpointing=checkpointing, loss_chunk_tokens=1024),
                           mesh=build_mesh(device_type=self.device.type, world_size=1, shard_size=1),
                           mixed_precision=self.mixed_precision)
        if not self.cpu:
            self.build_peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
        return model

    def batches(self, step: int, keep_padding: bool = False):
        rows = (np.arange(self.micro_batch) + step * self.micro_batch) % len(self.packed)
        return [collate(self.packed, rows, self.device, keep_padding=keep_padding)]


def timed_steps(run: Run, step_fn, count_fn) -> dict:
    """``warmup`` + ``steps`` calls of ``step_fn(step)``; tokens/s and MFU of the measured ones
    (``count_fn(step)`` gives real tokens, FLOPs)."""
    seconds = tokens = flops = 0.0
    for step in range(run.warmup + run.steps):
        run.check()
        run.sync()
        started = time.perf_counter()
        step_fn(step)
        run.sync()
        if step >= run.warmup:
            seconds += time.perf_counter() - started
            real, step_flop_count = count_fn(step)
            tokens += real
            flops += step_flop_count
    return {"tokens_per_s": round(tokens / seconds, 1), "seconds_per_step": round(seconds / run.steps, 4),
            "mfu": mfu(flops_per_s=flops / seconds, peak_tflops=device_peak_tflops(run.device))}


def our_step_figures(run: Run, *, checkpointing: bool = True, keep_padding: bool = False) -> dict:
    model = run.our_model(checkpointing=checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not run.cpu)
    shape = flops_shape(model)

    def step(index):
        batches = run.batches(index, keep_padding)
        train_step(model, batches, normaliser=float(max(1, sum(b.label_tokens for b in batches))), cross_node_sync=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def count(index):
        batches = run.batches(index)
        lengths = [n for b in batches for n in b.sample_lengths]
        return (sum(b.real_tokens for b in batches),
                step_flops(**shape, tokens=sum(lengths), trained_tokens=sum(b.label_tokens for b in batches),
                           squared_lengths=sum(n * n for n in lengths)))

    if not run.cpu:
        torch.cuda.reset_peak_memory_stats(run.device)
    figures = timed_steps(run, step, count)
    figures["peak_gib"] = round(torch.cuda.max_memory_allocated(run.device) / 2**30, 2) if not run.cpu else None
    real = sum(b.real_tokens for i in range(run.steps) for b in run.batches(i))
    ran = sum(int(b.inputs["input_ids"].shape[1]) for i in range(run.steps) for b in run.batches(i, keep_padding))
    figures["padding_share"] = round(1 - real / ran, 3)  # of the tokens that ran through the model
    return figures


def seed_loop_figures(run: Run) -> dict:
    """The seed sample's loop: FSDP1 around the whole model (Ray's ``prepare_model(parallel_strategy=
    "fsdp")``; on CPU the bare model), dynamic padding with an attention mask, transformers' loss."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(run.device):
        lm = AutoModelForCausalLM.from_config(run.hf_config(), dtype=torch.float32, attn_implementation="sdpa")
    lm.config.use_cache = False
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    shape = flops_shape(lm)
    wrapped = lm
    if not run.cpu:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

        wrapped = FullyShardedDataParallel(lm, device_id=run.device, mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-5)
    per_batch = max(1, round(run.micro_batch * len(run.samples) / len(run.packed)))  # the same samples per step

    def chosen(index):
        return [run.samples[i % len(run.samples)] for i in range(index * per_batch, (index + 1) * per_batch)]

    def step(index):
        inputs, labels, _real, _total = padded_micro_batch(chosen(index), run.device)
        wrapped(**inputs, labels=labels, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def count(index):
        samples = chosen(index)
        lengths = [len(ids) for ids, _ in samples]
        trained = sum(sum(1 for label in labels[1:] if label != IGNORE_INDEX) for _, labels in samples)
        # The full logits on every position: the head's FLOPs on every token, not only the trained.
        return sum(lengths), step_flops(**shape, tokens=sum(lengths), trained_tokens=sum(lengths) if trained else 0,
                                        squared_lengths=sum(n * n for n in lengths))

    figures = timed_steps(run, step, count)
    return figures


def part_step(run: Run) -> dict:
    ours, seed = our_step_figures(run), seed_loop_figures(run)
    return {"ours": ours, "seed_loop": seed, "speedup": round(ours["tokens_per_s"] / seed["tokens_per_s"], 2),
            "attention": run.kernel_name}


def part_attention(run: Run) -> dict:
    """One attention call at a layer's shape (a packed row of micro-batch x seq-len tokens), per kernel."""
    heads, kv_heads = run.config["num_attention_heads"], run.config["num_key_value_heads"]
    dim = run.config["hidden_size"] // heads
    dtype = torch.float32 if run.cpu else torch.bfloat16
    tokens = run.micro_batch * run.seq_len
    q = torch.randn(tokens, heads, dim, device=run.device, dtype=dtype)
    k, v = (torch.randn(tokens, kv_heads, dim, device=run.device, dtype=dtype) for _ in range(2))
    cu = collate(run.packed, np.arange(run.micro_batch), run.device).inputs["cu_seq_lens_q"]
    longest = int((cu[1:] - cu[:-1]).max())
    kernels = {run.kernel_name: run.kernel}
    if not run.cpu:
        kernels["sdpa per segment"] = sdpa_per_segment_attention
    timings = {}
    for name, kernel in kernels.items():
        run.check()
        kernel(q, k, v, cu, cu, longest, longest, causal=True)
        run.sync()
        started = time.perf_counter()
        for _ in range(5):
            kernel(q, k, v, cu, cu, longest, longest, causal=True)
        run.sync()
        timings[name] = round((time.perf_counter() - started) / 5 * 1000, 3)
    return {"ran": run.kernel_name, "ms_per_call": timings, "tokens": tokens}


def part_memory(run: Run) -> dict:
    from training.modeling.plan import ModelShape, Options, plan

    found = plan(ModelShape.from_config(run.config, name="Qwen2.5-1.5B shape"), "H200",
                 Options(num_workers=1, workers_per_node=1, shard_size=1, micro_batch_size=run.micro_batch,
                         seq_len=run.seq_len, activation_checkpointing=True))
    result = {"plan_terms_gib": {k: round(v / 2**30, 3) for k, v in found.terms.items()},
              "plan_peak_gib": round(found.peak / 2**30, 3)}
    model = run.our_model()
    result["build_peak_gib"] = None if run.build_peak_gib is None else round(run.build_peak_gib, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not run.cpu)
    for index in range(2):
        run.check()
        if index == 1 and not run.cpu:  # the first step made the optimizer's state: measure the second
            torch.cuda.reset_peak_memory_stats(run.device)
        batches = run.batches(index)
        train_step(model, batches, normaliser=float(max(1, sum(b.label_tokens for b in batches))), cross_node_sync=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if not run.cpu:
        stats = torch.cuda.memory_stats(run.device)
        free, total = torch.cuda.mem_get_info(run.device)
        reserved = torch.cuda.memory_reserved(run.device)
        result.update({
            "max_allocated_gib": round(torch.cuda.max_memory_allocated(run.device) / 2**30, 3),
            "max_reserved_over_max_allocated": round(torch.cuda.max_memory_reserved(run.device)
                                                     / max(1, torch.cuda.max_memory_allocated(run.device)), 3),
            "num_alloc_retries": stats.get("num_alloc_retries", 0),
            "outside_allocator_gib": round((total - free - reserved) / 2**30, 3),
        })
    return result


def part_syncs(run: Run) -> dict:
    model = run.our_model()
    if run.cpu:
        for index in range(2):
            train_step(model, run.batches(index), normaliser=1.0, cross_node_sync=False)
        return {"host_syncs": None, "note": "no CUDA: the steps ran, the sync debug mode did not"}
    for index in range(2):  # warm up outside the mode
        train_step(model, run.batches(index), normaliser=1.0, cross_node_sync=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for index in range(3):
                run.check()
                train_step(model, run.batches(index), normaliser=1.0, cross_node_sync=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    return {"host_syncs": len(sites), "per_step": round(len(sites) / 3, 1), "sites": sorted(set(sites))[:10]}


def part_families(run: Run) -> dict:
    from transformers import AutoModelForCausalLM

    from training.modeling.families import FAMILIES, per_sample_loss, tiny_config

    dtype = torch.float32 if run.cpu else torch.bfloat16
    found = {}
    for family in FAMILIES:
        run.check()
        torch.manual_seed(0)
        config = tiny_config(family, 512)
        with torch.device(run.device):
            lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=hf_attention(FLASH, run.device, run.kernel))
            reference = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
        reference.load_state_dict(lm.state_dict())
        model = for_training(lm, activation_checkpointing=False, loss_chunk_tokens=1024)
        samples = sft_like_samples(8, vocab=512, max_len=48, seed=3)
        batch = collate(pack(samples, seq_len=128, pad_id=0), np.arange(1), run.device)
        loss = model(**batch.inputs, labels=batch.labels, trained_positions=batch.trained_positions,
                     normaliser=float(batch.label_tokens))
        loss.backward()
        expected = per_sample_loss(reference, batch) / batch.label_tokens
        found[family] = round(abs(loss.item() - expected.item()) / max(abs(expected.item()), 1e-9), 6)
    return {"relative_loss_difference": found, "dtype": str(dtype).removeprefix("torch.")}


def part_checkpointing(run: Run) -> dict:
    """Activation checkpointing off against on; and the pads of the packed rows run through the
    model (the layout before) against left out (now), on the same data."""
    on, off = our_step_figures(run, checkpointing=True), our_step_figures(run, checkpointing=False)
    padded = our_step_figures(run, checkpointing=True, keep_padding=True)
    return {"on": on, "off": off, "off_over_on": round(off["tokens_per_s"] / on["tokens_per_s"], 2),
            "pads_run": padded, "padding_share_before": padded["padding_share"], "padding_share_now": on["padding_share"],
            "now_over_pads_run": round(on["tokens_per_s"] / padded["tokens_per_s"], 2)}


PARTS = {"step": part_step, "attention": part_attention, "memory": part_memory, "syncs": part_syncs,
         "families": part_families, "checkpointing": part_checkpointing}


def table(results: dict, run: Run) -> str:
    lines = [f"ray-train-eks first GPU hour on {'CPU (dry run)' if run.cpu else torch.cuda.get_device_name(0)}; "
             f"attention: {run.kernel_name}", f"{'part':<14}{'status':<8}figures"]
    for name, entry in results.items():
        figures = entry.get("error") or json.dumps(entry.get("figures"), sort_keys=True)
        lines.append(f"{name:<14}{entry['status']:<8}{figures[:400]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the dry run: tiny shapes, gloo, no CUDA calls")
    parser.add_argument("--out", default="first-hour", help="folder for results.json and table.txt")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per variant on the GPU")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    if not run.cpu:
        torch.cuda.set_device(run.device)
    store = tempfile.mktemp(prefix="first-hour-store-")
    dist.init_process_group("gloo" if run.cpu else "nccl", init_method=f"file://{store}", rank=0, world_size=1)
    results = {}
    try:
        for name in args.parts.split(","):
            started = time.monotonic()
            run.deadline = started + BUDGETS[name] * (4 if run.cpu else 1)
            try:
                results[name] = {"status": "ok", "figures": PARTS[name](run)}
            except Exception as error:  # noqa: BLE001 - one part's failure is its row; the others run
                results[name] = {"status": "failed", "error": f"{type(error).__name__}: {str(error)[:300]}",
                                 "traceback": traceback.format_exc()[-2000:]}
            results[name]["seconds"] = round(time.monotonic() - started, 1)
            gc.collect()
            if not run.cpu:
                torch.cuda.empty_cache()
            print(f"[first-hour] {name}: {results[name]['status']} in {results[name]['seconds']} s", flush=True)
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.remove(store)
    text = table(results, run)
    (out / "results.json").write_text(json.dumps({"device": "cpu" if run.cpu else torch.cuda.get_device_name(0),
                                                  "attention": run.kernel_name, "parts": results}, indent=2))
    (out / "table.txt").write_text(text + "\n")
    print(text)
    return 0 if all(entry["status"] == "ok" for entry in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

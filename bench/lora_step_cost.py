"""Benchmark: what a LoRA step costs, and a LoRA DPO step against an SFT step of the same tokens.

    python -m bench.lora_step_cost            # CPU: bench.train_throughput's small Qwen2, one process

On the same model, the same packed rows (preference pairs, each a chosen and a rejected segment: an
SFT step trains every completion token of them, a DPO step scores the pairs), the production step
(training/modeling/step.py ``train_step``), each variant timed over its own steps:

  full        a full fine-tune: every weight trained
  frozen      the base frozen, no adapter (only the final norm trained): a frozen weight's backward
              computes the activations' gradient, not its own (4 FLOPs a parameter a token, not 6)
  lora        LoRA's defaults (rank 8, alpha 16, every linear layer of the decoder)
  lora-dpo    the same adapters, DPO's sigmoid loss: the reference is the base with the adapters off,
              one more forward (no gradient) of the same tokens

For each: the median step's CPU seconds (one thread, ``time.process_time``: the cost of the step's work,
whatever else the machine runs), the model FLOPs (training/telemetry/metrics.py ``step_flops``) and the
aten operations one step dispatches (a ``TorchDispatchMode`` counting them). The FLOPs model at the
L4 preset's shape (Qwen2.5-1.5B, 8 x 2,048 tokens a forward) says what the same ratios are where
the matmuls, not the operations, take the time. Prints figures; asserts nothing."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.train_throughput import QWEN2_5_1_5B, build_model, sft_like_samples
from training.data import collate
from training.data.preference import pack_pairs
from training.modeling.step import train_step
from training.telemetry.metrics import flops_shape, step_flops

VARIANTS = ("full", "frozen", "lora", "lora-dpo")


class OperationCount(TorchDispatchMode):
    """How many aten operations run inside (each one a kernel launch, or a CPU op's dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def model_for(variant: str, args: argparse.Namespace):
    """The small model as the variant trains it (fp32 on the CPU, activation checkpointing as the preset),
    sharded with FSDP2 as the workers shard it (``--fsdp``: over this one process's group)."""
    from training.modeling.lora import LoraSettings, add_adapters
    from training.modeling.parallel import apply_fsdp, build_mesh

    model = build_model(args.model, "sdpa", args.activation_checkpointing)
    if variant == "frozen":
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name.endswith("model.norm.weight"))
    if variant.startswith("lora"):
        model.lm = add_adapters(model.lm, LoraSettings(rank=8, alpha=16.0, dropout=0.0), seed=0)
        model.lm.train()
    if args.fsdp:
        apply_fsdp(model, mesh=build_mesh(device_type="cpu", world_size=1, shard_size=1), mixed_precision="fp32")
    return model


def run(variant: str, batches: list, args: argparse.Namespace) -> dict:
    """The variant's median step time, its FLOPs and its operation count per step."""
    from training.modeling.preference import PreferenceSettings

    torch.manual_seed(0)
    model = model_for(variant, args)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    preference = PreferenceSettings(loss="sigmoid") if variant == "lora-dpo" else None
    times, operations = [], None
    for step in range(args.warmup + args.steps):
        batch = batches[step % len(batches)]
        normaliser = float(batch.pairs.count if preference else max(1, batch.label_tokens))
        counter = OperationCount() if step == args.warmup else None
        started = time.process_time()
        if counter is not None:
            with counter:
                train_step(model, [batch], normaliser=normaliser, cross_node_sync=False, preference=preference)
            operations = counter.count
        else:
            train_step(model, [batch], normaliser=normaliser, cross_node_sync=False, preference=preference)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > args.warmup:  # the counted step's time is the counter's
            times.append(time.process_time() - started)
    shape = flops_shape(model)
    batch = batches[0]
    flops = step_flops(**shape, tokens=batch.real_tokens, trained_tokens=batch.label_tokens,
                       squared_lengths=sum(n * n for n in batch.sample_lengths), reference_forward=variant == "lora-dpo")
    return {"variant": variant, "step_s": round(float(np.median(times)), 4), "gflops": round(flops / 1e9, 2),
            "gflops_per_cpu_s": round(flops / 1e9 / float(np.median(times)), 2),
            "operations": operations,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def preset_flops() -> dict:
    """The FLOPs model's step at the L4 preset's shape: Qwen2.5-1.5B, one micro-batch of 8 x 2,048
    tokens, samples of 512 tokens, 60% of them trained, full against LoRA (rank 8 on every linear
    layer: 18.5 M adapter parameters) and LoRA DPO."""
    hidden, layers, vocab = QWEN2_5_1_5B["hidden_size"], QWEN2_5_1_5B["num_hidden_layers"], QWEN2_5_1_5B["vocab_size"]
    decoder = 1_543_714_304 - vocab * hidden
    kv = hidden // QWEN2_5_1_5B["num_attention_heads"] * QWEN2_5_1_5B["num_key_value_heads"]
    inter = QWEN2_5_1_5B["intermediate_size"]
    linears = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]
    adapters = layers * sum(8 * (a + b) for a, b in linears)
    tokens = 8 * 2048
    common = {"head_params": vocab * hidden, "num_layers": layers, "hidden_size": hidden, "tokens": tokens,
              "trained_tokens": int(0.6 * tokens), "squared_lengths": (tokens // 512) * 512 * 512}
    full = step_flops(decoder_params=decoder, **common)
    lora = step_flops(decoder_params=decoder + adapters, frozen_decoder_params=decoder, frozen_head=True, **common)
    dpo = step_flops(decoder_params=decoder + adapters, frozen_decoder_params=decoder, frozen_head=True,
                     reference_forward=True, **common)
    # Activation checkpointing (the preset's) runs each layer's forward again in the backward: what the
    # hardware does is the model FLOPs and one more forward, for both.
    recompute = (2.0 * (decoder + adapters) * tokens + 2.0 * common["head_params"] * common["trained_tokens"]
                 + 4.0 * layers * hidden * common["squared_lengths"])
    return {"full_tflops": round(full / 1e12, 1), "lora_tflops": round(lora / 1e12, 1), "lora_dpo_tflops": round(dpo / 1e12, 1),
            "recompute_tflops": round(recompute / 1e12, 1), "adapter_params": adapters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", choices=["small", "qwen2.5-1.5b"])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True,
                        help="shard with FSDP2 as the workers do (a group of this one process)")
    args = parser.parse_args()
    # One thread, timed in CPU seconds (time.process_time): what a step costs, whatever else the machine runs.
    torch.set_num_threads(1)
    if args.fsdp:
        import tempfile

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)

    vocab = 8192 if args.model == "small" else QWEN2_5_1_5B["vocab_size"]
    samples = sft_like_samples(400, vocab=vocab, max_len=args.seq_len // 2, seed=1)
    packed = pack_pairs(list(zip(samples[0::2], samples[1::2])), seq_len=args.seq_len, pad_id=0)
    batches = [collate(packed, np.array([row, row + 1]), torch.device("cpu")) for row in range(0, 16, 2)]
    results = {variant: run(variant, batches, args) for variant in VARIANTS}
    model = preset_flops()

    print(f"\nOne step of {args.model} on the CPU, 2 packed rows of {args.seq_len} tokens (preference pairs), activation "
          f"checkpointing {'on' if args.activation_checkpointing else 'off'}, {'FSDP2' if args.fsdp else 'unsharded'}:")
    print(f"{'variant':<10}{'CPU s':>9}{'GFLOPs':>9}{'aten ops':>10}{'trainable':>12}")
    for r in results.values():
        print(f"{r['variant']:<10}{r['step_s']:>9.3f}{r['gflops']:>9.1f}{r['operations']:>10,}{r['trainable']:>12,}")
    full, frozen, lora, dpo = (results[v] for v in VARIANTS)
    print(f"LoRA DPO / LoRA SFT, same tokens: {dpo['step_s'] / lora['step_s']:.2f}x the time "
          f"({dpo['gflops'] / lora['gflops']:.2f}x the FLOPs: the reference forward is the only extra)")
    print(f"frozen base / full: {frozen['step_s'] / full['step_s']:.2f}x the time, {frozen['gflops'] / full['gflops']:.2f}x "
          f"the FLOPs; LoRA / full: {lora['step_s'] / full['step_s']:.2f}x the time, {lora['gflops'] / full['gflops']:.2f}x "
          f"the FLOPs, {lora['operations'] / full['operations']:.2f}x the operations")
    print(f"At the L4 preset's shape (Qwen2.5-1.5B, 8 x 2,048 tokens): full {model['full_tflops']} TFLOPs a micro-step, "
          f"LoRA {model['lora_tflops']} ({model['lora_tflops'] / model['full_tflops']:.2f}x), LoRA DPO "
          f"{model['lora_dpo_tflops']} ({model['lora_dpo_tflops'] / model['lora_tflops']:.2f}x LoRA SFT; with activation "
          f"checkpointing's second forward, what the GPU runs: "
          f"{(model['lora_dpo_tflops'] + model['recompute_tflops']) / (model['lora_tflops'] + model['recompute_tflops']):.2f}x)")
    print(json.dumps({"results": results, "preset_flops": model}))


if __name__ == "__main__":
    main()

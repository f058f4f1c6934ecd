"""What every Ray Train worker runs: the training loop, as a list of steps that live
elsewhere (data, parallel, checkpoint, metrics, preflight, export)."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ray.train
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import TrainConfig
from training.data import DataOrder, build_packed_dataset, collate
from training.export import export_final_model, final_model_uri, stop_notice_uri
from training.metrics import device_peak_tflops, mfu, model_flops_per_token, peak_memory_gib
from training.parallel import apply_activation_checkpointing, apply_fsdp, build_mesh
from training.preflight import prepare_nccl_logging, run_preflight
from training.sources import resolve_dataset, resolve_model
from training.storage import write_text


def cosine_schedule(config: TrainConfig):
    """Linear warm-up to the peak, then cosine decay to ``min_lr_ratio`` x peak at ``max_steps``."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _maybe_inject_failure(config: TrainConfig, step: int, rank: int) -> None:
    """Testing aid: worker 1 dies once, hard, after ``inject_failure_at_step``. A marker
    in the run folder makes it happen only once across restarts."""
    if config.inject_failure_at_step is None or step != config.inject_failure_at_step or rank != 1:
        return
    if "://" in config.storage_path:
        raise ValueError("inject_failure_at_step works with a local storage_path only")
    marker = Path(config.storage_path) / config.run_name / ".injected-failure"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"worker 1 killed after step {step}\n")
    print(f"[train] injected failure: worker 1 exits after step {step}", flush=True)
    os._exit(1)


def train_loop_per_worker(config_dict: dict) -> None:
    """Ray Train entry point of each worker."""
    config = TrainConfig.from_dict(config_dict)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    invocation_id = config_dict["_invocation_id"]

    if config.use_gpu:
        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
        prepare_nccl_logging()
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world, 1)))
    run_preflight(device=device, size_mib=config.preflight_mb, expect_efa=config.expect_efa)

    # ---- model and data (every worker builds the same packed data set, deterministically)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = build_packed_dataset(
        tokenizer, resolve_dataset(config.dataset, seed=config.seed), seq_len=config.seq_len, seed=config.seed,
        split=config.dataset_split, max_samples=config.max_samples,
    )
    order = DataOrder(num_sequences=len(dataset), global_batch=config.global_batch_size,
                      micro_batch=config.micro_batch_size, num_workers=world, seed=config.seed)
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=config.attn_implementation)
    model.config.use_cache = False
    flops_per_token = model_flops_per_token(model, config.seq_len)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    model.to(device)
    mesh = build_mesh(device_type=device.type, world_size=world, shard_size=config.shard_size)
    apply_fsdp(model, mesh=mesh, mixed_precision=config.mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.95), fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(config))

    # ---- resume: from an earlier run with this name, or after a worker failure in this one
    start_step, first_loss, resumed_from_step = 0, None, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            state = load_checkpoint(directory, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
        start_step = state["step"]
        if state["invocation_id"] == invocation_id:  # restarted after a failure: same invocation
            first_loss, resumed_from_step = state["first_loss"], state["resumed_from_step"]
        else:  # a new invocation resuming an earlier run
            resumed_from_step = start_step
        if rank == 0:
            print(f"[train] restored step {start_step} from {checkpoint.path}", flush=True)

    peak = device_peak_tflops(device)
    loss = state["loss"] if checkpoint else float("nan")
    throughput: list[float] = []
    metrics: dict = {}
    for step in range(start_step, config.max_steps):
        started = time.perf_counter()
        micro_batches = [collate(dataset, indices, device) for indices in order.micro_batches(step, rank)]
        # Token-weighted loss over the global batch: every rank divides its summed loss by
        # the global label count (times world size, since FSDP averages gradients).
        label_tokens = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches), device=device, dtype=torch.float64)
        dist.all_reduce(label_tokens)
        normaliser = (label_tokens / world).to(torch.float32)
        loss_sum = torch.zeros((), device=device)
        for batch in micro_batches:
            output = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False,
                           num_items_in_batch=normaliser)
            output.loss.backward()
            loss_sum += output.loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        loss = (loss_sum / world).item()
        seconds = time.perf_counter() - started
        real_tokens = sum(int(b["real"].sum()) for b in micro_batches)
        tokens_per_s = real_tokens / seconds
        if first_loss is None:
            first_loss = loss
        if step > start_step:  # the first step of an invocation includes warm-up
            throughput.append(tokens_per_s)
        metrics = {
            "step": step + 1,
            "loss": loss,
            "learning_rate": scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm),
            "tokens_per_s_per_worker": tokens_per_s,
            "mfu": mfu(tokens_per_s=tokens_per_s, flops_per_token=flops_per_token, peak_tflops=peak),
            "peak_memory_gib": peak_memory_gib(device),
            "first_loss": first_loss,
            "resumed_from_step": resumed_from_step,
            "epoch": step // order.steps_per_epoch,
        }
        if rank == 0:
            mfu_text = f"{metrics['mfu']:.1%}" if metrics["mfu"] is not None else "n/a (CPU)"
            print(f"[train] {time.strftime('%H:%M:%S')} step {step + 1}/{config.max_steps} loss {loss:.4f} lr {metrics['learning_rate']:.2e} "
                  f"grad_norm {metrics['grad_norm']:.3f} tok/s/worker {tokens_per_s:,.0f} mfu {mfu_text} "
                  f"peak_mem {metrics['peak_memory_gib']:.2f} GiB", flush=True)
        if not math.isfinite(loss):
            # Every rank sees the same global loss, so all stop here together; no retry
            # (it would fail the same way), and the last good checkpoint stays.
            # Ray keeps only checkpointed metrics, so the reason goes to the run folder.
            if rank == 0:
                write_text(stop_notice_uri(config.storage_path, config.run_name),
                           json.dumps({"error": f"non-finite loss {loss} at step {step + 1}", "step": step + 1}))
            ray.train.report(metrics)
            return
        last = step + 1 == config.max_steps
        if last:
            metrics.update(_finish(config, model, tokenizer, rank, throughput))
        if (step + 1) % config.checkpoint_every == 0 or last:
            _save_and_report(config, model, optimizer, scheduler, rank, metrics, {
                "step": step + 1, "invocation_id": invocation_id, "first_loss": first_loss,
                "resumed_from_step": resumed_from_step, "loss": loss,
            })
        else:
            ray.train.report(metrics)
        _maybe_inject_failure(config, step + 1, rank)

    if start_step >= config.max_steps:
        # Nothing left to train (a rerun with the same --max-steps): export and report again.
        metrics = {"step": start_step, "loss": loss, "first_loss": first_loss, "resumed_from_step": resumed_from_step,
                   **_finish(config, model, tokenizer, rank, throughput)}
        _save_and_report(config, model, optimizer, scheduler, rank, metrics, state)


def _finish(config: TrainConfig, model, tokenizer, rank: int, throughput: list[float]) -> dict:
    """Export the consolidated model (collective) and the run's summary figures."""
    uri = final_model_uri(config.storage_path, config.run_name)
    dtype = torch.bfloat16 if config.mixed_precision == "bf16" else torch.float32
    export_final_model(model=model, tokenizer=tokenizer, rank=rank, uri=uri, dtype=dtype)
    return {
        "final_model": uri,
        # Median over this invocation's steps, the first (warm-up) excluded.
        "tokens_per_s_per_worker": sorted(throughput)[len(throughput) // 2] if throughput else None,
    }


def _save_and_report(config: TrainConfig, model, optimizer, scheduler, rank: int, metrics: dict, train_state: dict) -> None:
    """Write a sharded checkpoint and hand it, with ``metrics``, to Ray Train (collective)."""
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(directory, model=model, optimizer=optimizer, scheduler=scheduler, train_state=train_state, rank=rank)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))

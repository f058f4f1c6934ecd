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
from training.data import DataOrder, MicroBatch, build_packed_dataset, collate
from training.export import export_final_model, final_model_uri, stop_notice_uri
from training.cloudwatch import publisher_from_env
from training.metrics import device_peak_tflops, matmul_parameters, mfu, peak_memory_gib, step_flops
from training.model import load_model
from training.parallel import apply_fsdp, build_mesh, is_hsdp, set_cross_node_gradient_sync
from training.preflight import nccl_warnings, prepare_nccl_logging, run_preflight
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


def global_normaliser(micro_batches: list[MicroBatch], *, device: torch.device, world_size: int) -> float:
    """Token-weighted loss over the global batch: each rank divides its summed loss by the
    global count of trained tokens over the world size (FSDP averages gradients over
    ranks). A Python number, so mixed precision cannot round it (see CausalLMForSFT.forward)."""
    count = torch.tensor(float(sum(b.label_tokens for b in micro_batches)), device=device, dtype=torch.float64)
    dist.all_reduce(count)
    return count.item() / world_size


def train_step(model, micro_batches: list[MicroBatch], *, device: torch.device, world_size: int, cross_node_sync: bool) -> float:
    """Forward and backward of every micro-batch, gradients accumulated; returns the
    step's global loss. With HSDP the cross-node all-reduce runs on the last micro-step only."""
    normaliser = global_normaliser(micro_batches, device=device, world_size=world_size)
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    for index, batch in enumerate(micro_batches):
        if cross_node_sync:
            set_cross_node_gradient_sync(model, enabled=index == len(micro_batches) - 1)
        loss = model(**batch.inputs, labels=batch.labels, normaliser=normaliser)
        loss.backward()
        loss_sum += loss.detach()  # the loss only: nothing of this micro-batch outlives its backward
        del loss
    dist.all_reduce(loss_sum)
    return (loss_sum / world_size).item()


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

    nccl_log = None
    if config.use_gpu:
        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
        nccl_log = prepare_nccl_logging()
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world, 1)))
    preflight = run_preflight(device=device, size_mib=config.preflight_mb, expect_efa=config.expect_efa,
                              attn_implementation=config.attn_implementation, timeout_s=config.preflight_timeout_s,
                              nccl_log=nccl_log)
    if preflight.problems:
        # Not an exception: Ray Train would retry it max_failures times (and the RayJob
        # with a new cluster). Every worker got the same verdict and stops here.
        for line in nccl_warnings(nccl_log):
            print(f"[preflight] {line}", flush=True)
        if rank == 0:
            write_text(stop_notice_uri(config.storage_path, config.run_name),
                       json.dumps({"error": "preflight failed: " + " | ".join(preflight.problems), "step": 0}))
        return

    publisher = publisher_from_env(run_name=config.run_name, use_gpu=config.use_gpu) if rank == 0 else None
    if publisher:
        publisher.preflight(transport=preflight.transport, bus_bandwidth_gbps=preflight.bus_bandwidth_gbps)

    # ---- model and data (every worker builds the same packed data set, deterministically)
    from transformers import AutoTokenizer

    model_dir = resolve_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = build_packed_dataset(
        tokenizer, resolve_dataset(config.dataset, seed=config.seed), seq_len=config.seq_len, seed=config.seed,
        split=config.dataset_split, max_samples=config.max_samples,
    )
    order = DataOrder(num_sequences=len(dataset), global_batch=config.global_batch_size,
                      micro_batch=config.micro_batch_size, num_workers=world, seed=config.seed)
    torch.manual_seed(config.seed)
    model = load_model(model_dir, attn_implementation=config.attn_implementation,
                       activation_checkpointing=config.activation_checkpointing, loss_chunk_tokens=config.loss_chunk_tokens)
    flops_shape = {"matmul_params": matmul_parameters(model), "num_layers": model.config.num_hidden_layers,
                   "hidden_size": model.config.hidden_size}
    model.to(device)
    mesh = build_mesh(device_type=device.type, world_size=world, shard_size=config.shard_size)
    apply_fsdp(model, mesh=mesh, mixed_precision=config.mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.95), fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(config))
    if rank == 0:
        layout = f"HSDP (shard {config.shard_size} x replicate {world // config.shard_size})" if is_hsdp(mesh) else f"FSDP over {world}"
        print(f"[train] {layout}, micro-batch {config.micro_batch_size} x {config.seq_len} flattened, "
              f"accumulation {config.grad_accum_steps}, {config.attn_implementation}", flush=True)

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
        loss = train_step(model, micro_batches, device=device, world_size=world, cross_node_sync=is_hsdp(mesh))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        real_tokens = sum(b.real_tokens for b in micro_batches)
        tokens_per_s = real_tokens / seconds
        flops = step_flops(**flops_shape, sample_lengths=[n for b in micro_batches for n in b.sample_lengths])
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
            "mfu": mfu(flops_per_s=flops / seconds, peak_tflops=peak),
            "peak_memory_gib": peak_memory_gib(device),
            "first_loss": first_loss,
            "resumed_from_step": resumed_from_step,
            "epoch": step // order.steps_per_epoch,
        }
        if publisher:
            publisher.step(step + 1, {
                "loss": loss, "grad_norm": metrics["grad_norm"], "step_seconds": seconds,
                "tokens_per_s": tokens_per_s * world,  # the run's: every worker trains the same shape of batch
                "mfu_percent": None if metrics["mfu"] is None else 100 * metrics["mfu"],
            })
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

    if publisher:
        publisher.flush()
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

"""What every Ray Train worker runs: ``train_loop_per_worker``, a short loop over named steps
(:func:`prepare`, :func:`train_one_step`, :func:`evaluate`, :func:`log_step`,
:func:`save_and_report`, :func:`stop_run`) whose parts live in their own modules (data,
parallel, checkpoint, metrics, preflight, export, runlog)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import ray.train
from .storage.checkpoint import CheckpointWriter, load_checkpoint
from .telemetry.cloudwatch import MetricsPublisher, publisher_from_env
from .config import TrainConfig
from .data import DataError, DataOrder, TrainingData, build_training_data, collate, eval_micro_batches
from .resilience.faults import (NODE_NAME_ENV, UNHEALTHY_TAINT_ENV, Fault, hardware_fault, maybe_fake_fault,
                                maybe_fake_start_fault, record_followed, start_fault, take_node_out)
from .resilience.health import (CONDITION_DRAIN_S, check_gpus, describe_speeds, here, node_condition_fault, probe_speeds,
                                slowest_share)
from .modeling.export import export_final_model, final_model_uri, run_uri, stop_notice_uri
from .telemetry.metrics import device_peak_tflops, flops_shape, mfu, peak_memory_gib, step_flops
from .modeling.load import load_sharded
from .modeling.parallel import build_mesh, is_hsdp
from .modeling.step import train_step
from .telemetry.memory import calibration, describe, reset_peak
from .resilience.preemption import COUNTS, PREEMPTED, hold_until_replaced, preemption_notice, release, retries_seen, seconds_left
from .resilience.nccl_log import maybe_fake_nccl_abort
from .resilience.preflight import PRESTOP_CHECK_ENV, run_preflight, start_nccl_logging
from .telemetry.runlog import RunLog
from .storage.sources import resolve_dataset, resolve_model
from .storage.files import write_text


class DeliberateStop(Exception):
    """The run ends on purpose, on every worker at once, with ``reason`` and no retry: a failed
    preflight, a data set with nothing to train, a non-finite loss. Raising anything else
    from the training function makes Ray Train retry it ``max_failures`` times (and the
    RayJob start a new cluster), which would fail the same way."""

    def __init__(self, reason: str, *, step: int) -> None:
        super().__init__(reason)
        self.reason, self.step = reason, step


@dataclass
class Worker:
    """What one worker carries between steps."""

    config: TrainConfig
    invocation_id: str
    rank: int
    world: int
    device: torch.device
    nccl_log: str | None = None
    #: The process that prints NCCL's warnings into the job log (training/resilience/nccl_log.py).
    nccl_follower: object = None
    tokenizer: object = None
    data: TrainingData | None = None
    order: DataOrder | None = None
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    hsdp: bool = False
    flops_shape: dict = field(default_factory=dict)
    peak_tflops: float | None = None
    #: The memory plan of this run on this GPU (training/modeling/plan.py), when one can be made.
    memory_plan: object = None
    #: The plan against the GPU over a step with optimizer state (training/telemetry/memory.py), once measured.
    memory_calibration: dict | None = None
    calibrating: bool = False
    publisher: MetricsPublisher | None = None
    run_log: RunLog | None = None
    checkpoints: CheckpointWriter | None = None
    #: Where this invocation starts, and the run's history that a checkpoint carries.
    start_step: int = 0
    first_loss: float | None = None
    resumed_from_step: int | None = None
    #: Why this invocation resumed ("failure", "preemption", "new run"), for the first step's record.
    resume_cause: str | None = None
    #: Earlier invocations' restarts (carried by the checkpoints); this one's are Ray Train's.
    earlier: dict = field(default_factory=lambda: {count: 0 for count in COUNTS})
    restored: dict | None = None
    #: Where the learning-rate schedule was re-anchored (a resume with another --max-steps).
    lr_anchor: tuple[int, float] | None = None
    #: Tokens/s of this invocation's steps, the first (warm-up) excluded.
    throughput: list[float] = field(default_factory=list)
    #: Step times since the last health probe.
    step_times: list[float] = field(default_factory=list)
    #: This worker took its node out of the run (a node condition); the notice follows.
    node_out: bool = False
    #: This worker is its node's first rank (it reads the node's conditions), and when it last did.
    reads_node: bool = False
    node_read_at: float = 0.0

    @property
    def preemptions(self) -> int:
        """The run's preemptions: earlier invocations' and those Ray Train counted in this one."""
        return self.earlier["preemptions"] + retries_seen()["preemptions"]

    @property
    def failures(self) -> int:
        """The run's failures (without notice), counted alike."""
        return self.earlier["failures"] + retries_seen()["failures"]

    @property
    def hardware_faults(self) -> int:
        """The run's hardware faults (a worker found its GPU broken and took its node out), counted alike."""
        return self.earlier.get("hardware_faults", 0) + retries_seen()["hardware_faults"]


# ---------------------------------------------------------------------- the loop

def train_loop_per_worker(config_dict: dict) -> None:
    """Ray Train entry point of each worker."""
    config = TrainConfig.from_dict(config_dict)
    worker = start_worker_or_take_node_out(config, config_dict["_invocation_id"])
    try:
        prepare(worker)
        for step in range(worker.start_step, config.max_steps):
            metrics = train_one_step(worker, step)
            maybe_fake_fault(step + 1)
            maybe_fake_nccl_abort(step + 1, worker.nccl_log)
            if eval_due(config, step + 1):
                metrics["eval_loss"] = evaluate(worker)
            check_health(worker, metrics)
            read_node_on_clock(worker)
            log_step(worker, metrics)
            stop_if_not_finite(worker, metrics)
            notice = preemption_notice(step + 1, config.preemption_check_every) if step + 1 < config.max_steps else None
            if notice:
                checkpoint_at_notice(worker, metrics, notice)
                hold_until_replaced()
            save_and_report(worker, metrics)
            _maybe_inject_failure(config, step + 1, worker.rank)
            if config.step_pause_s:
                time.sleep(config.step_pause_s)
        if worker.start_step >= config.max_steps:
            finish_again(worker)
    except DeliberateStop as stop:
        stop_run(worker, stop)
    except Exception as error:
        what = hardware_fault(error)
        if what is None:
            raise
        take_node_out(Fault("gpu error", f"{what}: {str(error).splitlines()[0][:300]}", **here(worker.device, worker.rank)),
                      invocation_id=worker.invocation_id)
        hold_until_replaced()
    finally:
        close(worker)


def start_worker_or_take_node_out(config: TrainConfig, invocation_id: str) -> Worker:
    """:func:`start_worker`; a GPU found broken there (``torch.cuda.set_device``, CUDA's
    initialisation) is a hardware fault like one in a step: the node is taken out and the run
    resumes elsewhere, nothing charged to ``--max-failures``."""
    try:
        return start_worker(config, invocation_id)
    except Exception as error:
        what = start_fault(error)
        if what is None:
            raise
        rank = ray.train.get_context().get_world_rank()
        take_node_out(Fault("gpu error", f"{what} at the worker's start: {str(error).splitlines()[0][:300]}",
                            **here(torch.device("cpu"), rank)), invocation_id=invocation_id)
        hold_until_replaced()
        raise


def start_worker(config: TrainConfig, invocation_id: str) -> Worker:
    """This worker's rank, world and device (NCCL's logging prepared before any communicator)."""
    maybe_fake_start_fault()
    context = ray.train.get_context()
    worker = Worker(config=config, invocation_id=invocation_id, rank=context.get_world_rank(),
                    world=context.get_world_size(), device=torch.device("cpu"))
    if config.use_gpu:
        worker.device = ray.train.torch.get_device()
        torch.cuda.set_device(worker.device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(worker.world, 1)))
    if config.use_gpu or os.environ.get(NODE_NAME_ENV):
        # NCCL's warnings into the job log; and, in a pod, the node taken out when a GPU fault ends
        # this process before Python can act (torch's NCCL watchdog): the follower outlives it.
        take_out = {**here(worker.device, worker.rank), "invocation_id": invocation_id,
                    "gcs_address": ray.get_runtime_context().gcs_address} if os.environ.get(NODE_NAME_ENV) else None
        worker.nccl_log, worker.nccl_follower = start_nccl_logging(take_out=take_out)
        if take_out:
            record_followed(invocation_id)
    return worker


def eval_due(config: TrainConfig, step: int) -> bool:
    """Whether the eval loss is computed after ``step`` (1-based): every ``eval_every`` steps
    and at the last, when there is held-out data."""
    held_out = config.eval_fraction > 0 or config.eval_split is not None
    return held_out and (step % config.eval_every == 0 or step == config.max_steps)


# ---------------------------------------------------------------------- prepare

def prepare(worker: Worker) -> None:
    """Preflight, data, model, optimizer, resume, and the run's log: everything before the
    first step. Raises :class:`DeliberateStop` when the preflight fails or the data set has
    nothing to train."""
    config = worker.config
    # In our pods: their preStop hook, checked once per pod.
    prestop = os.environ.get(PRESTOP_CHECK_ENV)
    if prestop and ray.train.get_context().get_local_rank() != 0:
        prestop = None
    preflight = run_preflight(device=worker.device, size_mib=config.preflight_mb, expect_efa=config.expect_efa,
                              attn_implementation=config.attn_implementation, timeout_s=config.preflight_timeout_s,
                              nccl_log=worker.nccl_log, prestop_check=prestop,
                              node_id=ray.get_runtime_context().get_node_id() if prestop else None)
    if preflight.problems:
        raise DeliberateStop("preflight failed: " + " | ".join(preflight.problems), step=0)
    preflight_gpus(worker)
    if worker.rank == 0:
        worker.publisher = publisher_from_env(run_name=config.run_name, use_gpu=config.use_gpu)
    if worker.publisher:
        worker.publisher.preflight(transport=preflight.transport, bus_bandwidth_gbps=preflight.bus_bandwidth_gbps)

    prepare_data(worker)
    prepare_model(worker)
    restore(worker)
    worker.checkpoints = CheckpointWriter(asynchronous=config.checkpoint_mode == "async", rank=worker.rank,
                                          run_name=config.run_name, invocation_id=worker.invocation_id)
    if worker.rank == 0:
        from .telemetry.curves import draw_if_possible

        worker.run_log = RunLog(run_uri(config.storage_path, config.run_name), resume_step=worker.start_step,
                                about={"run_name": config.run_name, "model": config.model, "dataset": config.dataset,
                                       "preset": config.preset, "max_steps": config.max_steps},
                                draw=draw_if_possible)


def preflight_gpus(worker: Worker) -> None:
    """The preflight's GPU checks (training/resilience/health.py ``check_gpus``): a GPU missing, a straggler or
    a node condition the node monitoring agent set false takes its node out of the run (the rank
    that found it) and every worker waits for Ray Train to restart the run on healthy nodes; nothing
    is charged to ``--max-failures``."""
    in_pod = bool(os.environ.get(NODE_NAME_ENV) and os.environ.get(UNHEALTHY_TAINT_ENV))
    faults, lines, worker.reads_node = check_gpus(worker.device, worker.rank, worker.config.straggler_share,
                                                  read_node=in_pod)
    worker.node_read_at = time.monotonic()  # the node's first rank just read it
    if worker.rank == 0:
        for line in lines:
            print(f"[preflight] {line}", flush=True)
    if not faults:
        return
    if worker.rank == 0:
        for fault in faults:
            print(f"[preflight] GPU check failed: {fault.describe()}", flush=True)
    broken = {fault.ray_node for fault in faults}
    for fault in faults:
        if fault.rank == worker.rank:
            take_node_out(fault, invocation_id=worker.invocation_id)
    mine = here(worker.device, worker.rank)["ray_node"]
    print(f"[preflight] rank {worker.rank}: {'this node is out of the run' if mine in broken else 'waiting'} for a "
          "restart on healthy nodes", flush=True)
    hold_until_replaced()


def check_health(worker: Worker, metrics: dict) -> None:
    """Every ``health_check_every`` steps (collective): each GPU's matmul throughput and each rank's
    mean step time since the last probe; rank 0 logs the slowest GPU against the median (a
    straggler named with its node and GPU) and puts the figures into the step's metrics
    (``health``: metrics.jsonl; ``slowest_gpu_share``: CloudWatch, the dashboard)."""
    worker.step_times.append(metrics["step_seconds"])
    every = worker.config.health_check_every
    if not every or metrics["step"] % every:
        return
    speeds = probe_speeds(worker.device, worker.rank, sum(worker.step_times) / len(worker.step_times))
    worker.step_times.clear()
    if worker.reads_node:  # its node's first rank, in a pod (the preflight found it)
        check_node_conditions(worker)
    if worker.rank != 0:
        return
    print(describe_speeds(metrics["step"], speeds, worker.config.straggler_share), flush=True)
    metrics["slowest_gpu_share"] = slowest_share(speeds)
    metrics["health"] = {"gpu_tflops": [round(s.tflops, 3) for s in speeds],
                         "step_seconds": [round(s.step_seconds, 4) for s in speeds if s.step_seconds is not None]}


#: How often a node's first rank reads the node's conditions, whatever the step time: both
#: repairs act 10 minutes after a condition turns false (Karpenter deleting the pods with a 1 s
#: grace), so the checkpoint at the notice must start well before.
NODE_READ_PERIOD_S = 60.0


def read_node_on_clock(worker: Worker) -> None:
    """After a step: the node's conditions, once ``NODE_READ_PERIOD_S`` passed since the last read
    (the preflight's, a health check's or this one's); not collective."""
    if worker.reads_node and time.monotonic() - worker.node_read_at >= NODE_READ_PERIOD_S:
        check_node_conditions(worker)


def check_node_conditions(worker: Worker) -> None:
    """The node's first rank (in a pod that may taint its node) reads the node's conditions: one the
    node monitoring agent set false takes the node out with notice (training/resilience/health.py
    ``node_condition_fault``), once; the run checkpoints at the notice and resumes elsewhere."""
    name = os.environ.get(NODE_NAME_ENV)
    if worker.node_out or not name or not os.environ.get(UNHEALTHY_TAINT_ENV):
        return
    worker.node_read_at = time.monotonic()
    try:
        condition = node_condition_fault(name)
    except Exception as error:  # noqa: BLE001 - the agent's view is extra; training goes on
        print(f"[health] could not read node {name}'s conditions ({type(error).__name__}: {error})", flush=True)
        return
    if condition:
        worker.node_out = True
        take_node_out(Fault("node condition", condition, **here(worker.device, worker.rank)),
                      invocation_id=worker.invocation_id, notice_s=CONDITION_DRAIN_S)


def prepare_data(worker: Worker) -> None:
    """Every worker builds the same packed training and eval sets, deterministically, and
    the data order; rank 0 reports the rows that were skipped or truncated, once."""
    from transformers import AutoTokenizer

    config = worker.config
    worker.tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model))
    try:
        worker.data = build_training_data(
            worker.tokenizer, resolve_dataset(config.dataset, seed=config.seed), seq_len=config.seq_len, seed=config.seed,
            split=config.dataset_split, max_samples=config.max_samples, eval_fraction=config.eval_fraction,
            eval_split=config.eval_split, eval_max_sequences=config.eval_max_sequences, name=config.dataset,
        )
        worker.order = DataOrder(num_sequences=len(worker.data.train), global_batch=config.global_batch_size,
                                 micro_batch=config.micro_batch_size, num_workers=worker.world, seed=config.seed)
        worker.order.global_batch_indices(0)  # fewer sequences than one batch: say so now
    except DataError as error:
        raise DeliberateStop(f"data: {error}", step=0) from error
    if worker.rank == 0:
        report, held_out = worker.data.report, len(worker.data.eval) if worker.data.eval is not None else 0
        print(f"[data] {report.used} of {report.rows} rows train, packed into {len(worker.data.train)} sequences of "
              f"{config.seq_len} tokens; eval: {held_out} sequences", flush=True)
        for line in report.lines(config.seq_len):
            print(f"[data] {line}", flush=True)


def prepare_model(worker: Worker) -> None:
    """Load the model, shard it (FSDP2, or HSDP across nodes), and build the optimizer and
    learning-rate schedule."""
    config = worker.config
    torch.manual_seed(config.seed)
    mesh = build_mesh(device_type=worker.device.type, world_size=worker.world, shard_size=config.shard_size)
    # Never the whole model on a GPU: built on the meta device, sharded, filled from rank 0 (modeling/load.py).
    model = load_sharded(resolve_model(config.model), mesh=mesh, device=worker.device, rank=worker.rank,
                         attn_implementation=config.attn_implementation, activation_checkpointing=config.activation_checkpointing,
                         mixed_precision=config.mixed_precision, loss_chunk_tokens=config.loss_chunk_tokens)
    worker.flops_shape = flops_shape(model)
    worker.model = model
    worker.hsdp = is_hsdp(mesh)
    worker.optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay,
                                         betas=(0.9, 0.95), fused=worker.device.type == "cuda")
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, cosine_schedule(config))
    worker.peak_tflops = device_peak_tflops(worker.device)
    worker.memory_plan = memory_plan_here(config, model, worker.device)
    if worker.rank == 0:
        layout = (f"HSDP (shard {config.shard_size} x replicate {worker.world // config.shard_size})" if worker.hsdp
                  else f"FSDP over {worker.world}")
        print(f"[train] {layout}, micro-batch {config.micro_batch_size} x {config.seq_len} flattened, "
              f"accumulation {config.grad_accum_steps}, {config.attn_implementation}", flush=True)


def memory_plan_here(config: TrainConfig, model, device: torch.device):
    """The memory plan for this model on this worker's GPU, to log against the measured peak
    at the first step; None on CPU or for a model or GPU the plan does not know."""
    from .modeling.plan import ModelShape, Options, gpu_type_of, plan

    gpu = gpu_type_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if gpu is None:
        return None
    try:
        return plan(ModelShape.from_config(model.config.to_dict(), name=config.model), gpu, Options.of(config))
    except ValueError:
        return None


def calibrate_memory(worker: Worker, *, before_step: bool) -> None:
    """The plan against the GPU, once per invocation, over the first step that starts with the
    optimizer's state in memory (training/telemetry/memory.py): the peak reset before it, the three
    numbers logged after it and kept for the summary."""
    if worker.memory_calibration is not None or worker.memory_plan is None or worker.device.type != "cuda":
        return
    if before_step:
        worker.calibrating = bool(worker.optimizer.state)
        if worker.calibrating:
            reset_peak(worker.device)
        return
    if worker.calibrating:
        worker.memory_calibration = calibration(worker.memory_plan, worker.device)
        print(describe(worker.rank, worker.memory_calibration), flush=True)


def restore(worker: Worker) -> None:
    """Resume from the run's latest checkpoint, if any: from an earlier run with this name,
    or after a worker failure in this one (then the run's first loss carries over)."""
    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return
    with checkpoint.as_directory() as directory:
        state = load_checkpoint(directory, model=worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler,
                                rank=worker.rank)
    worker.restored, worker.start_step = state, state["step"]
    continue_schedule(worker, state)
    if state["invocation_id"] == worker.invocation_id:  # restarted by Ray Train: same invocation
        worker.first_loss, worker.resumed_from_step = state["first_loss"], state["resumed_from_step"]
        # What Ray Train charged the restart to (a preemption: a drained node's death after its
        # deadline, or the deadline passed; else a failure), not what this checkpoint is.
        worker.resume_cause = retries_seen()["last"] or ("preemption" if state.get(PREEMPTED) else "failure")
        worker.earlier = {count: state.get("earlier", {}).get(count, 0) for count in COUNTS}
    else:  # a new invocation resuming an earlier run: its counts carry over
        worker.resumed_from_step, worker.resume_cause = worker.start_step, "new run"
        worker.earlier = {count: state.get(count, 0) for count in COUNTS}
    if worker.rank == 0:
        print(f"[train] restored step {worker.start_step} from {checkpoint.path}", flush=True)
        faults = retries_seen()["faults"]
        if worker.resume_cause == "hardware fault" and faults:
            print(f"[train] resumed after a hardware fault (hardware faults so far: {worker.hardware_faults}; not charged "
                  f"to --max-failures): {Fault.from_record(faults[-1]).describe()}",
                  flush=True)


def cosine_schedule(config: TrainConfig, anchor: tuple[int, float] | None = None):
    """Linear warm-up to the peak, then cosine decay to ``min_lr_ratio`` x peak at ``max_steps``.

    ``anchor`` (step, factor): a run resumed with another ``max_steps`` continues from the
    factor its schedule had reached at that step and decays it to the floor over the steps
    left, on a half cosine (continuous at the resume step; the original schedule would jump:
    from its floor at the old end to the new schedule's rate)."""

    def factor(step: int) -> float:
        if anchor is not None and step >= anchor[0]:
            start, value = anchor
            progress = min(1.0, (step - start) / max(1, config.max_steps - start))
            return config.min_lr_ratio + (value - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def continue_schedule(worker: Worker, state: dict) -> None:
    """After a restore: the schedule the checkpoint was on (its ``lr_schedule``), or, when this
    run has another ``--max-steps``, one that continues from the factor reached (the rate is
    continuous at the resume step: the step after it uses the restored scheduler's last rate,
    which is the anchor's factor)."""
    config, step = worker.config, state["step"]
    saved = state.get("lr_schedule") or {}
    anchor = tuple(saved["anchor"]) if saved.get("anchor") else None
    if saved.get("max_steps", config.max_steps) != config.max_steps and step >= config.warmup_steps:
        base = worker.scheduler.base_lrs[0]
        anchor = (step, worker.scheduler.get_last_lr()[0] / base if base else 1.0)
    worker.lr_anchor = anchor
    worker.scheduler.lr_lambdas = [cosine_schedule(config, anchor)] * len(worker.scheduler.lr_lambdas)


# ---------------------------------------------------------------------- step

def trained_tokens_of(data, indices: np.ndarray) -> int:
    """Trained tokens of the packed sequences ``indices``, on the CPU."""
    return int(data.trained_tokens[indices].sum())


def train_one_step(worker: Worker, step: int) -> dict:
    """One optimizer step at global ``step`` (0-based): its micro-batches, forward and
    backward, clipping, the update; returns the step's metrics. One host sync, for the
    loss and the gradient norm together."""
    config, data = worker.config, worker.data.train
    started = time.perf_counter()
    global_batch = worker.order.global_batch_indices(step)
    micro_batches = [collate(data, indices, worker.device, flatten=config.flattened_rows)
                     for indices in worker.order.micro_batches(step, worker.rank)]
    calibrate_memory(worker, before_step=True)
    loss = train_step(worker.model, micro_batches, normaliser=trained_tokens_of(data, global_batch) / worker.world,
                      cross_node_sync=worker.hsdp)
    dist.all_reduce(loss)
    grad_norm = torch.nn.utils.clip_grad_norm_(worker.model.parameters(), config.max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    learning_rate = worker.scheduler.get_last_lr()[0]  # the rate this update uses
    worker.optimizer.step()
    worker.scheduler.step()
    worker.optimizer.zero_grad(set_to_none=True)
    loss_value, norm_value = torch.stack([loss / worker.world, grad_norm.float()]).tolist()  # the sync
    seconds = time.perf_counter() - started
    calibrate_memory(worker, before_step=False)

    counts = data.flop_counts(global_batch)  # the whole step's, all workers', from the CPU copy of the data
    tokens_per_s = counts["tokens"] / seconds  # the run's (all workers)
    flops_per_worker = step_flops(**worker.flops_shape, **counts) / worker.world
    if worker.first_loss is None:
        worker.first_loss = loss_value
    if step > worker.start_step:  # the first step of an invocation includes warm-up
        worker.throughput.append(tokens_per_s / worker.world)
    return {
        "step": step + 1,
        "loss": loss_value,
        "learning_rate": learning_rate,
        "grad_norm": norm_value,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_worker": tokens_per_s / worker.world,
        "mfu": mfu(flops_per_s=flops_per_worker / seconds, peak_tflops=worker.peak_tflops),
        "step_seconds": seconds,
        "peak_memory_gib": peak_memory_gib(worker.device),
        "first_loss": worker.first_loss,
        "resumed_from_step": worker.resumed_from_step,
        "preemptions": worker.preemptions,
        "failures": worker.failures,
        "hardware_faults": worker.hardware_faults,
        "epoch": step // worker.order.steps_per_epoch,
    }


# ---------------------------------------------------------------------- evaluate

def evaluate(worker: Worker) -> float | None:
    """The eval loss over the held-out sequences: same packing and masking as training, no
    gradients, every worker its share (collective). Token-weighted: summed losses over
    trained tokens; the token count is known on the CPU."""
    evaluation = worker.data.eval
    if evaluation is None:
        return None
    config, model = worker.config, worker.model
    total = torch.zeros((), device=worker.device, dtype=torch.float32)
    model.eval()  # dropout off: the loss of the model as it is, not of a random thinning of it
    try:
        with torch.no_grad():
            for indices in eval_micro_batches(len(evaluation), num_workers=worker.world,
                                              micro_batch=config.micro_batch_size, rank=worker.rank):
                batch = collate(evaluation, indices, worker.device, flatten=worker.config.flattened_rows)
                total += model(**batch.inputs, labels=batch.labels, trained_positions=batch.trained_positions,
                               normaliser=1.0).float()
    finally:
        model.train()
    dist.all_reduce(total)
    return total.item() / max(1, int(evaluation.trained_tokens.sum()))


# ---------------------------------------------------------------------- log, report, checkpoint

def log_step(worker: Worker, metrics: dict) -> None:
    """The step's line in the job log, its record in metrics.jsonl and its CloudWatch data (rank 0)."""
    if worker.rank != 0:
        return
    config, step = worker.config, metrics["step"]
    mfu_text = f"{metrics['mfu']:.1%}" if metrics["mfu"] is not None else "n/a (CPU)"
    eval_text = f" eval_loss {metrics['eval_loss']:.4f}" if metrics.get("eval_loss") is not None else ""
    print(f"[train] {time.strftime('%H:%M:%S')} step {step}/{config.max_steps} loss {metrics['loss']:.4f}{eval_text} "
          f"lr {metrics['learning_rate']:.2e} grad_norm {metrics['grad_norm']:.3f} "
          f"tok/s/worker {metrics['tokens_per_s_per_worker']:,.0f} mfu {mfu_text} "
          f"peak_mem {metrics['peak_memory_gib']:.2f} GiB", flush=True)
    record = {key: metrics.get(key) for key in ("step", "loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_s",
                                                 "mfu", "step_seconds", "peak_memory_gib", "epoch", "slowest_gpu_share",
                                                 "health")}
    record["time"] = time.time()
    if step == worker.start_step + 1 and worker.resume_cause:
        record.update(resumed_from_step=worker.start_step, resume_cause=worker.resume_cause)
    worker.run_log.record({k: v for k, v in record.items() if v is not None})
    if worker.publisher:
        worker.publisher.step(step, {
            "loss": metrics["loss"], "eval_loss": metrics.get("eval_loss"), "grad_norm": metrics["grad_norm"],
            "step_seconds": metrics["step_seconds"], "tokens_per_s": metrics["tokens_per_s"],
            "mfu_percent": None if metrics["mfu"] is None else 100 * metrics["mfu"],
            "slowest_gpu_percent": None if metrics.get("slowest_gpu_share") is None else 100 * metrics["slowest_gpu_share"],
        })


def stop_if_not_finite(worker: Worker, metrics: dict) -> None:
    """A non-finite loss ends the run: every rank sees the same global loss, so all stop
    here together; no retry (it would fail the same way), and the last good checkpoint
    stays. The step's metrics are reported (without a checkpoint) first."""
    if math.isfinite(metrics["loss"]):
        return
    report_written_checkpoint(worker, wait=True)  # the last good one, if it was still being written
    ray.train.report(metrics)
    raise DeliberateStop(f"non-finite loss {metrics['loss']} at step {metrics['step']}", step=metrics["step"])


def save_and_report(worker: Worker, metrics: dict) -> None:
    """Hand the step's metrics to Ray Train, with a checkpoint every ``checkpoint_every`` steps
    and at the last (after the final model's export).

    Asynchronously (``--checkpoint-mode async``) a checkpoint step starts the write and training
    goes on; the checkpoint is reported at the first step boundary where every rank has written
    its part (or before the next one starts), and uploaded by Ray Train in the background. The
    last step's checkpoint is written before the run ends."""
    config, step = worker.config, metrics["step"]
    report_written_checkpoint(worker)
    last = step == config.max_steps
    if last:
        metrics.update(finish(worker))
    if step % config.checkpoint_every and not last:
        report_metrics(worker, metrics)
        return
    report_written_checkpoint(worker, wait=True)  # one write in flight at a time
    worker.checkpoints.start(model=worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler,
                             train_state=train_state(worker, metrics), metrics=metrics)
    if last or not worker.checkpoints.asynchronous:
        report_written_checkpoint(worker, wait=True)
    else:
        report_metrics(worker, metrics)


def report_metrics(worker: Worker, metrics: dict) -> None:
    """Hand a step's metrics to Ray Train without waiting for a checkpoint upload in flight.

    In Ray 2.58 reports are delivered in order: a SYNC report waits until every earlier report
    is delivered (``_wait_then_report``, ray/train/v2/_internal/execution/context.py), an
    ASYNC checkpoint's upload included, so with asynchronous checkpoints a plain
    ``ray.train.report(metrics)`` after one stalls the loop for the whole upload. An ASYNC report
    without a checkpoint goes to Ray's upload thread pool and waits its turn there instead; the
    loop goes on. (The last step's report and a stop's are synchronous: they wait for everything.)"""
    asynchronous = worker.checkpoints is not None and worker.checkpoints.asynchronous
    ray.train.report(metrics, checkpoint_upload_mode=(ray.train.CheckpointUploadMode.ASYNC if asynchronous
                                                      else ray.train.CheckpointUploadMode.SYNC))


def report_written_checkpoint(worker: Worker, *, wait: bool = False, upload: str | None = None) -> None:
    """Report the pending checkpoint once every rank has written it (``wait``: block for it);
    collective. The run's metrics.jsonl is written first, so the checkpoint a run resumes from
    has every step up to it in the file; the picture follows in the background."""
    writer = worker.checkpoints
    if writer is None or writer.pending is None:
        return
    if not (wait or writer.written_everywhere()):
        return
    pending = writer.take()
    if worker.rank == 0:
        print(f"[train] checkpoint of step {pending.metrics['step']} reported ({writer.mode}; rank 0: "
              f"{pending.describe()})", flush=True)
    if worker.run_log:
        worker.run_log.flush(picture=True, wait=False)
    ray.train.report(pending.metrics, checkpoint=ray.train.Checkpoint.from_directory(str(pending.directory)),
                     checkpoint_upload_mode=(ray.train.CheckpointUploadMode.ASYNC
                                             if writer.asynchronous and upload != "sync"
                                             else ray.train.CheckpointUploadMode.SYNC),
                     delete_local_checkpoint_after_upload=True)


def train_state(worker: Worker, metrics: dict, **extra) -> dict:
    """What a checkpoint carries besides the model and optimizer: the step (the data position)
    and the run's history (the preemptions, failures and hardware faults of earlier invocations apart)."""
    return {"step": metrics["step"], "invocation_id": worker.invocation_id, "first_loss": worker.first_loss,
            "resumed_from_step": worker.resumed_from_step, "loss": metrics["loss"], "eval_loss": metrics.get("eval_loss"),
            "preemptions": worker.preemptions, "failures": worker.failures, "hardware_faults": worker.hardware_faults,
            "earlier": dict(worker.earlier),
            "lr_schedule": {"max_steps": worker.config.max_steps, "anchor": list(worker.lr_anchor) if worker.lr_anchor else None},
            **extra}


def checkpoint_at_notice(worker: Worker, metrics: dict, notice) -> None:
    """Every rank (the notice is the same on all) writes and reports one checkpoint of this
    step, marked as taken at a preemption notice, without waiting to report it later: the node
    is about to go. The run's log and metrics go out."""
    if worker.rank == 0:
        left = seconds_left(notice)
        print(f"[train] preemption notice for node(s) {', '.join(n[:12] for n in notice.preempted_node_ids)} "
              f"(ranks {notice.preempted_ranks}; {'%.0f s left' % left if left is not None else 'no deadline'}): "
              f"checkpoint at step {metrics['step']}, then waiting to be resumed elsewhere", flush=True)
    started = time.monotonic()
    report_written_checkpoint(worker, wait=True)
    worker.checkpoints.start(model=worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler,
                             train_state=train_state(worker, metrics, **{PREEMPTED: True}), metrics=metrics)
    # Uploaded before anything else: Ray Train restarts from it as soon as the nodes are released.
    report_written_checkpoint(worker, wait=True, upload="sync")
    dist.barrier()  # every rank's report is in Ray Train's hands
    if worker.rank == 0:
        print(f"[train] checkpoint at the notice written and uploaded in {time.monotonic() - started:.1f} s", flush=True)
        release(notice)
    if worker.publisher:
        worker.publisher.close()
        worker.publisher = None


def finish(worker: Worker) -> dict:
    """Export the consolidated model (collective) and the run's summary figures."""
    config = worker.config
    uri = final_model_uri(config.storage_path, config.run_name)
    dtype = torch.bfloat16 if config.mixed_precision == "bf16" else torch.float32
    export_final_model(model=worker.model, tokenizer=worker.tokenizer, rank=worker.rank, uri=uri, dtype=dtype)
    throughput = worker.throughput
    return {
        "final_model": uri,
        # The memory plan against rank 0's GPU (None on CPU): what the first run on a GPU type measures.
        "memory": worker.memory_calibration,
        # What happened to the rows: skipped by cause with the first of each, truncated.
        "data": worker.data.report.summary(),
        # Median over this invocation's steps, the first (warm-up) excluded.
        "tokens_per_s_per_worker": sorted(throughput)[len(throughput) // 2] if throughput else None,
    }


def finish_again(worker: Worker) -> None:
    """Nothing left to train (a rerun with the same ``--max-steps``): export and report again."""
    state = worker.restored
    metrics = {"step": worker.start_step, "loss": state["loss"], "eval_loss": state.get("eval_loss"),
               "first_loss": worker.first_loss, "resumed_from_step": worker.resumed_from_step, **finish(worker)}
    worker.checkpoints.start(model=worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler,
                             train_state=state, metrics=metrics)
    report_written_checkpoint(worker, wait=True)


# ---------------------------------------------------------------------- stop

def stop_run(worker: Worker, stop: DeliberateStop) -> None:
    """Record why the run stopped on purpose (rank 0, in the run's folder, where the driver
    reads it) and return normally on every worker: Ray Train then retries nothing."""
    if worker.rank == 0:
        config = worker.config
        write_text(stop_notice_uri(config.storage_path, config.run_name), json.dumps({"error": stop.reason, "step": stop.step}))


def close(worker: Worker) -> None:
    """On every way out: the last CloudWatch data and the run's log and picture are written."""
    if worker.publisher:
        worker.publisher.close()
    if worker.run_log:
        worker.run_log.flush(picture=True, wait=True)
        worker.run_log.close()


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

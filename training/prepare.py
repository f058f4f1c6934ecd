"""Everything a worker does before its first step (:func:`prepare`): the preflight and its GPU
checks, the data, the model sharded and its optimizer, the resume from the run's latest
checkpoint with its learning-rate schedule, and the run's log."""

from __future__ import annotations

import math
import os
import time

import torch

import ray.train
from .storage.checkpoint import CheckpointWriter, load_checkpoint
from .telemetry.cloudwatch import publisher_from_env
from .config import TrainConfig
from .evaluation.best import Best
from .data import DataError, DataOrder, build_training_data
from .resilience.faults import NODE_NAME_ENV, UNHEALTHY_TAINT_ENV, Fault, take_node_out
from .resilience.health import check_gpus, here
from .modeling.export import run_uri
from .telemetry.metrics import device_peak_tflops, flops_shape
from .modeling.load import load_sharded
from .modeling.lora import LoraSettings, seed_dropout, trainable_parameters
from .modeling.parallel import build_mesh, is_hsdp
from .resilience.elastic import ElasticSizes
from .resizing import resized_from
from .resilience.preemption import COUNTS, PREEMPTED, hold_until_replaced, retries_seen
from .resilience.preflight import PRESTOP_CHECK_ENV, run_preflight
from .telemetry.runlog import RunLog
from .storage.sources import resolve_dataset, resolve_model
from .worker import DeliberateStop, Worker


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
    prepare_reference(worker)
    worker.checkpoints = CheckpointWriter(asynchronous=config.checkpoint_mode == "async", rank=worker.rank,
                                          run_name=config.run_name, invocation_id=worker.invocation_id)
    from .telemetry.cost import run_cost

    worker.cost = run_cost(config, worker.rank, worker.world, started=worker.started or time.time(),
                           earlier_usd=worker.earlier_usd, cluster_start=worker.cluster_start)
    if worker.rank == 0 and worker.cost is not None:  # a restarted or resized group: from the last step's figure on
        from .storage.files import read_text
        from .telemetry.runlog import METRICS_FILE, parse_lines

        worker.cost.continue_from((parse_lines(read_text(f"{run_uri(config.storage_path, config.run_name)}/{METRICS_FILE}"))
                                   or [None])[-1])
    if worker.rank == 0:
        from .telemetry.curves import draw_if_possible
        from .telemetry.metrics import parameter_count

        worker.run_log = RunLog(run_uri(config.storage_path, config.run_name), resume_step=worker.start_step,
                                about={"run_name": config.run_name, "model": config.model, "dataset": config.dataset,
                                       "preset": config.preset, "max_steps": config.max_steps, "objective": config.objective,
                                       # The rate used (LoRA's default unless given) and the base's commit (a Hub
                                       # model's; a resume loads it again: training/train.py ``check_model``).
                                       "peft": config.peft, "learning_rate": config.learning_rate,
                                       "model_revision": config.model_revision,
                                       "parameters": parameter_count(worker.model),
                                       **(worker.deadline.record() if worker.deadline else {}),
                                       # An elastic run's sizes, for `ray-train-eks status` (training/resilience/elastic.py).
                                       **({"nodes": config.num_nodes, "min_nodes": config.min_nodes,
                                           "workers_per_node": config.workers_per_node}
                                          if ElasticSizes.of(config) else {}),
                                       **({"cost": worker.cost.record()} if worker.cost else {})},
                                draw=draw_if_possible)
        from .telemetry.tracking import step_tracker

        worker.tracker = step_tracker(worker.tracking, worker.start_step)


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


def prepare_data(worker: Worker) -> None:
    """Every worker builds the same packed training and eval sets, deterministically, and
    the data order; rank 0 reports the rows that were skipped or truncated, once."""
    from transformers import AutoTokenizer

    config = worker.config
    worker.tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model),
                                                     **({"revision": config.model_revision} if config.model_revision else {}))
    try:
        worker.data = build_training_data(
            worker.tokenizer, resolve_dataset(config.dataset, seed=config.seed), seq_len=config.seq_len, seed=config.seed,
            split=config.dataset_split, max_samples=config.max_samples, eval_fraction=config.eval_fraction,
            eval_split=config.eval_split, eval_max_sequences=config.eval_max_sequences, name=config.dataset,
            samples=config.sample_prompts, objective=config.objective,
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
                         mixed_precision=config.mixed_precision, loss_chunk_tokens=config.loss_chunk_tokens,
                         lora=LoraSettings.of(config), seed=config.seed, revision=config.model_revision)
    seed_dropout(config.seed, worker.rank)  # each rank its own dropout masks; the init above is the same on all
    worker.flops_shape = flops_shape(model)
    worker.model = model
    worker.hsdp = is_hsdp(mesh)
    # Under LoRA the adapters alone (the frozen base has no gradient and no state).
    worker.optimizer = torch.optim.AdamW(trainable_parameters(model), lr=config.learning_rate,
                                         weight_decay=config.weight_decay, betas=(0.9, 0.95),
                                         fused=worker.device.type == "cuda")
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, cosine_schedule(config))
    worker.peak_tflops = device_peak_tflops(worker.device)
    worker.memory_plan = memory_plan_here(config, model, worker.device)
    if worker.rank == 0:
        layout = (f"HSDP (shard {config.shard_size} x replicate {worker.world // config.shard_size})" if worker.hsdp
                  else f"FSDP over {worker.world}")
        # The accumulation of this size: an elastic run keeps its global batch at every size (training/resilience/elastic.py).
        accumulation = config.global_batch_size // (worker.world * config.micro_batch_size)
        print(f"[train] {layout}, micro-batch {config.micro_batch_size} x {config.seq_len} flattened, "
              f"accumulation {accumulation}, {config.attn_implementation}", flush=True)


def prepare_reference(worker: Worker) -> None:
    """Preference tuning's loss, and its reference: the base with the adapters off under LoRA (nothing
    to prepare), none for SimPO, else the reference table of a full fine-tune, read from the run's
    folder or computed before the first step (training/modeling/reference.py)."""
    from .modeling.lora import is_lora
    from .modeling.preference import PreferenceSettings
    from .modeling.reference import ReferenceMissing, load_or_compute

    worker.preference = PreferenceSettings.of(worker.config)
    if worker.preference is None or not worker.preference.needs_reference or is_lora(worker.model):
        if worker.preference is not None and worker.rank == 0:
            how = "none (SimPO)" if not worker.preference.needs_reference else "the base with the adapters off, each step"
            gamma = f", gamma {worker.preference.gamma_value:g}" if worker.preference.loss == "simpo" else ""
            print(f"[dpo] {worker.preference.loss} loss, beta {worker.preference.beta_value}{gamma}; reference: {how}", flush=True)
        return
    try:
        worker.reference = load_or_compute(worker)
    except ReferenceMissing as error:
        raise DeliberateStop(str(error), step=worker.start_step) from error


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


def restore(worker: Worker) -> None:
    """Resume from the run's latest checkpoint, if any: from an earlier run with this name,
    or after a worker failure in this one (then the run's first loss carries over)."""
    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return
    # Each rank reads its own shards where the checkpoint is stored (not the whole of it, copied to every node).
    state = load_checkpoint(checkpoint, model=worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler,
                            rank=worker.rank)
    worker.restored, worker.start_step = state, state["step"]
    saved_by = state.get("workers", worker.world)  # another size: DCP resharded the state above
    worker.best = Best.from_state(state.get("best"))
    continue_schedule(worker, state)
    if state["invocation_id"] == worker.invocation_id:  # restarted by Ray Train: same invocation
        worker.first_loss, worker.resumed_from_step = state["first_loss"], state["resumed_from_step"]
        # What Ray Train charged the restart to (a preemption: a drained node's death after its
        # deadline, or the deadline passed; else a failure), not what this checkpoint is.
        worker.resume_cause = retries_seen()["last"] or ("preemption" if state.get(PREEMPTED) else "failure")
        worker.earlier = {count: state.get("earlier", {}).get(count, 0) for count in COUNTS}
        worker.resized_from = resized_from(worker.config, worker.world, retries_seen().get("workers_before"))
    else:  # a new invocation resuming an earlier run: its counts carry over
        worker.resumed_from_step, worker.resume_cause = worker.start_step, "new run"
        worker.earlier = {count: state.get(count, 0) for count in COUNTS}
    if worker.rank == 0:
        resharded = (f", saved by {saved_by} workers, resharded onto {worker.world}"
                     + (" (resumed at another size)" if worker.resume_cause == "new run" else "") if saved_by != worker.world else "")
        print(f"[train] restored step {worker.start_step} from {checkpoint.path}{resharded}", flush=True)
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

"""What every Ray Train worker runs: ``train_loop_per_worker``, a short loop over named steps
(:func:`~training.prepare.prepare`, :func:`train_one_step`, :func:`evaluate`,
:func:`~training.reporting.log_step`, :func:`~training.reporting.save_and_report`,
:func:`~training.reporting.stop_run`). The worker's state and start are in ``worker.py``,
everything before the first step in ``prepare.py``, what follows a step in ``reporting.py``;
the parts they use live in the rooms (data, modeling, storage, resilience, telemetry)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .config import TrainConfig
from .data import collate, eval_micro_batches
from .evaluation.best import RANK_METRIC, rank_of
from .evaluation.samples import write_samples
from .resilience.faults import (NODE_NAME_ENV, UNHEALTHY_TAINT_ENV, Fault, ProgramError, classify_cuda_error, maybe_fake_fault,
                                record_suspect, take_node_out)
from .resilience.health import CONDITION_DRAIN_S, describe_speeds, here, node_condition_fault, probe_speeds, slowest_share
from .telemetry.metrics import mfu, peak_memory_gib, step_flops
from .modeling.step import train_step
from .telemetry.memory import calibration, describe, reset_peak
from .resilience.preemption import hold_until_replaced, preemption_notice
from .resilience.nccl_log import maybe_fake_nccl_abort
from .prepare import prepare
from .reporting import (checkpoint_at_notice, checkpoint_for_growth, close, finish_again, hold_for_growth, log_step,
                        save_and_report, stop_before_stop_time, stop_if_not_finite, stop_run)
from .resizing import growth_asked_at
from .resilience import deadline as stop_times
from .resilience.deadline import Deadline
from .telemetry.notify import keep_for_this_worker
from .worker import DeliberateStop, Worker, start_worker_or_take_node_out


def train_loop_per_worker(config_dict: dict) -> None:
    """Ray Train entry point of each worker."""
    config = TrainConfig.from_dict(config_dict)
    notifier = keep_for_this_worker(config_dict.get("_notify"))  # before the NCCL log follower starts: it inherits it
    worker = start_worker_or_take_node_out(config, config_dict["_invocation_id"])
    worker.tracking, worker.notifier = config_dict.get("_tracking"), notifier
    worker.deadline = Deadline.from_dict(config_dict.get("_deadline"))
    worker.started, worker.earlier_usd = config_dict.get("_started") or time.time(), config_dict.get("_earlier_usd") or 0.0
    worker.cluster_start = config_dict.get("_cluster_started")
    current = None  # the step being trained (1-based), for the judgment of an error in it
    try:
        prepare(worker)
        stopped = worker.best.stop_reason(config.early_stopping_patience) if worker.restored else None
        for step in range(worker.start_step, worker.start_step if stopped else config.max_steps):
            current = step + 1
            metrics = train_one_step(worker, step)
            maybe_fake_fault(step + 1)
            maybe_fake_nccl_abort(step + 1, worker.nccl_log)
            if eval_due(config, step + 1):
                metrics["eval_loss"] = evaluate(worker, metrics)
                note_evaluation(worker, metrics)
            check_health(worker, metrics)
            read_node_on_clock(worker)
            log_step(worker, metrics)
            stop_if_not_finite(worker, metrics)
            if stop_time_due(worker, metrics):
                stop_before_stop_time(worker, metrics)
                break
            notice = preemption_notice(step + 1, config.preemption_check_every) if step + 1 < config.max_steps else None
            if notice:
                checkpoint_at_notice(worker, metrics, notice)
                hold_until_replaced()
            ask = growth_asked_at(worker, metrics)  # an elastic run's nodes came back: grow from this step
            if not ask:
                save_and_report(worker, metrics)
            elif checkpoint_for_growth(worker, metrics, ask):  # this step's checkpoint; the controller heard the answer
                hold_for_growth(worker, metrics)
            if metrics.get("stopped_early"):
                break
            _maybe_inject_failure(config, step + 1, worker.rank, loss=metrics["loss"])
            if config.step_pause_s:
                time.sleep(config.step_pause_s)
        if worker.start_step >= config.max_steps or stopped:
            if stopped and worker.rank == 0:
                print(f"[train] nothing to train: the run stopped early at step {worker.start_step} ({stopped}); "
                      "raise or drop --early-stopping-patience to train on", flush=True)
            finish_again(worker, stopped_early=stopped)
    except DeliberateStop as stop:
        stop_run(worker, stop)
    except Exception as error:
        what = judge_cuda_error(worker, error, step=current)
        if what is None:
            raise
        take_node_out(Fault("gpu error", f"{what}: {str(error).splitlines()[0][:300]}", **here(worker.device, worker.rank)),
                      invocation_id=worker.invocation_id)
        hold_until_replaced()
    finally:
        close(worker)


def judge_cuda_error(worker: Worker, error: BaseException, step: int | None = None) -> str | None:
    """The hardware fault ``error`` is, on evidence (training/resilience/faults.py), or None for an
    error to raise as it is (Ray Train retries it against ``--max-failures``):

    - the device says so (an uncorrectable ECC or NVLink error, a GPU off the bus): hardware;
    - the CUDA documentation gives the program as the cause (an illegal address, an assert): the
      program's, said so, never a node taken out; when it comes back at the same ``step`` after a
      restart from the last checkpoint (a deterministic bug; an out-of-memory at another step is
      fragmentation or another process, and is retried), the run stops with it
      (:class:`ProgramError`, which the controller does not retry) instead of spending
      ``--max-failures`` on it;
    - an unspecified launch failure or unknown error: hardware when the node's monitoring agent
      reports a GPU fault, or when the same error comes back on the same node; the program's when
      it comes back on another node (it follows the code): then the run stops with it and every
      node stays in."""
    judged = classify_cuda_error(error)
    if judged is None:
        return None
    kind, what = judged
    where = os.environ.get(NODE_NAME_ENV) or ""
    if kind == "hardware":
        return what
    if kind == "ambiguous":
        condition = None
        if where and os.environ.get(UNHEALTHY_TAINT_ENV):
            try:
                condition = node_condition_fault(where)
            except Exception as reading:  # noqa: BLE001 - the evidence is missing, not the decision
                print(f"[health] could not read node {where}'s conditions ({type(reading).__name__}: {reading})", flush=True)
        if condition:
            return f"{what}, and the node's monitoring agent reports {condition}"
    import ray

    from .resilience.preemption import COUNTS, retries_seen

    node = where or ray.get_runtime_context().get_node_id()[:12]  # a host's name outlives its Ray node's id
    seen = retries_seen()
    earlier = record_suspect(worker.invocation_id, error, node, sum(seen[count] for count in COUNTS), worker.rank, step=step)
    if kind == "program":
        again = [seen for seen in earlier if step is not None and seen[2] == step]
        if again:
            raise ProgramError(f"{what} on node {node} (rank {worker.rank}) at step {step}, as before the restart from the last "
                               f"checkpoint (on node(s) {', '.join(sorted({seen[1] for seen in again}))}): the program's error, not the "
                               f"GPU's, and retrying does not make it go away: the run stops with it and no node is taken "
                               f"out. {str(error).splitlines()[0][:500]}") from error
        print(f"[health] {what}: the program's error, not the GPU's (CUDA's documentation gives the program as its cause); "
              "no node is taken out; retried once from the last checkpoint, and the run stops if it comes back", flush=True)
        return None
    others = sorted({seen[1] for seen in earlier if seen[1] != node})
    if others:
        raise ProgramError(f"{what} on node {node} (rank {worker.rank}), as in an earlier attempt on node(s) "
                           f"{', '.join(others)}: the same error on another node follows the code, not a GPU: the run stops "
                           f"with it and no node is taken out. {str(error).splitlines()[0][:500]}") from error
    if earlier:
        return f"{what}, a second time on this node (it follows the node, not the code)"
    print(f"[health] {what} on node {node}: not known to be the GPU's (no fault on the node's conditions); "
          "retried from the last checkpoint as a failure. Again on this node takes it out; on another node stops the run "
          "as the program's error", flush=True)
    return None


def stop_time_due(worker: Worker, metrics: dict) -> bool:
    """Whether the run checkpoints and stops after this step, before its stop time
    (training/resilience/deadline.py): where the next step and a checkpoint would pass it, on any rank
    (collective: every rank agrees, as at a preemption notice). Never at the last step or an early
    stop, which end the run anyway. A Capacity Block's end is read again first: an extension moves it."""
    deadline = worker.deadline
    if deadline is None or metrics["step"] >= worker.config.max_steps or metrics.get("stopped_early"):
        return False
    due = stop_times.should_stop(stop_times.now(), deadline.stop_at, step_seconds=metrics["step_seconds"],
                                 checkpoint_seconds=worker.checkpoint_seconds)
    flag = torch.tensor([1.0 if due else 0.0], device=worker.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item() or deadline.block_id is None:
        return bool(flag.item())
    # A Capacity Block's end: an extended block ends later (same id). Rank 0 asks EC2, every rank takes its answer.
    later = [stop_times.extended(deadline) if worker.rank == 0 else None]
    dist.broadcast_object_list(later, src=0)
    if later[0] is None:
        return True
    worker.deadline = later[0]
    if worker.rank == 0:
        print(f"[train] the capacity block was extended: {later[0].reason}; the run goes on and stops by "
              f"{stop_times.iso(later[0].stop_at)}", flush=True)
        worker.run_log.update_about(later[0].record())
    return stop_time_due(worker, metrics)


def eval_due(config: TrainConfig, step: int) -> bool:
    """Whether the eval loss is computed after ``step`` (1-based): every ``eval_every`` steps
    and at the last, when there is held-out data."""
    held_out = config.eval_fraction > 0 or config.eval_split is not None
    return held_out and (step % config.eval_every == 0 or step == config.max_steps)


def note_evaluation(worker: Worker, metrics: dict) -> None:
    """After an evaluation (every rank alike: the eval loss is all-reduced): the best so far, the
    checkpoint's rank by it, early stopping (the run ends at this step as finished, exported and
    checkpointed like a last step), and the samples (training/evaluation/samples.py)."""
    config, step = worker.config, metrics["step"]
    metrics["new_best"] = worker.best.update(step, metrics["eval_loss"])
    metrics[RANK_METRIC] = rank_of(metrics["eval_loss"], step)
    metrics["best_step"], metrics["best_eval_loss"] = worker.best.step, worker.best.eval_loss
    reason = worker.best.stop_reason(config.early_stopping_patience)
    if reason and step < config.max_steps:
        metrics["stopped_early"] = reason
        if worker.rank == 0:
            print(f"[train] {reason}: the run ends at step {step}", flush=True)
    if config.sample_prompts and worker.data.samples:
        write_samples(worker, metrics)


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


def loss_units_of(data, indices: np.ndarray) -> int:
    """What the loss of the packed sequences ``indices`` averages over, on the CPU: their trained
    tokens, or their preference pairs."""
    return int(data.loss_units[indices].sum())


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
    loss = train_step(worker.model, micro_batches, normaliser=loss_units_of(data, global_batch) / worker.world,
                      cross_node_sync=worker.hsdp, preference=worker.preference,
                      reference_table=worker.reference_on_device("train"))
    loss, stats = loss if worker.preference else (loss, None)
    dist.all_reduce(loss)
    if stats is not None:
        dist.all_reduce(stats)
    grad_norm = torch.nn.utils.clip_grad_norm_(worker.model.parameters(), config.max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    learning_rate = worker.scheduler.get_last_lr()[0]  # the rate this update uses
    worker.optimizer.step()
    worker.scheduler.step()
    worker.optimizer.zero_grad(set_to_none=True)
    values = torch.cat([torch.stack([loss / worker.world, grad_norm.float()]), stats if stats is not None else loss.new_zeros(0)])
    loss_value, norm_value, *stat_values = values.tolist()  # the sync
    seconds = time.perf_counter() - started
    calibrate_memory(worker, before_step=False)

    counts = data.flop_counts(global_batch)  # the whole step's, all workers', from the CPU copy of the data
    tokens_per_s = counts["tokens"] / seconds  # the run's (all workers)
    reference_pass = bool(worker.preference and worker.preference.needs_reference and worker.reference is None)
    flops_per_worker = step_flops(**worker.flops_shape, **counts, reference_forward=reference_pass) / worker.world
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
        RANK_METRIC: rank_of(None, step + 1),  # after every evaluated checkpoint, unless evaluated (note_evaluation)
        **preference_metrics(stat_values, pairs=loss_units_of(data, global_batch) if stat_values else 0),
    }


def preference_metrics(values: list[float], *, pairs: int, prefix: str = "") -> dict:
    """TRL's preference metrics from the ``STATS`` summed over ``pairs`` pairs (every worker's: the
    count is known on the CPU), each a mean over the pairs; nothing for supervised steps."""
    from .modeling.preference import STATS

    if not values:
        return {}
    return {f"{prefix}{name}": value / max(1, pairs) for name, value in zip(STATS, values)}


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


def evaluate(worker: Worker, metrics: dict | None = None) -> float | None:
    """The eval loss over the held-out sequences: same packing and masking as training, no
    gradients, every worker its share (collective). Token-weighted: summed losses over
    trained tokens; the token count is known on the CPU. Preference pairs: the mean loss over the
    held-out pairs, and their reward accuracy and margin into ``metrics`` (``eval_rewards/...``)."""
    from .modeling.preference import preference_step_loss

    evaluation = worker.data.eval
    if evaluation is None:
        return None
    config, model = worker.config, worker.model
    total = torch.zeros((), device=worker.device, dtype=torch.float32)
    stats = None
    table = worker.reference_on_device("eval")
    model.eval()  # dropout off: the loss of the model as it is, not of a random thinning of it
    try:
        with torch.no_grad():
            for indices in eval_micro_batches(len(evaluation), num_workers=worker.world,
                                              micro_batch=config.micro_batch_size, rank=worker.rank):
                batch = collate(evaluation, indices, worker.device, flatten=worker.config.flattened_rows)
                if worker.preference:
                    loss, batch_stats = preference_step_loss(model, batch, worker.preference, normaliser=1.0, table=table)
                    total += loss.float()
                    stats = batch_stats if stats is None else stats + batch_stats
                    continue
                total += model(**batch.inputs, labels=batch.labels, trained_positions=batch.trained_positions,
                               normaliser=1.0).float()
    finally:
        model.train()
    values = torch.cat([total.reshape(1), stats]) if stats is not None else total.reshape(1)
    dist.all_reduce(values)
    values = values.tolist()
    if stats is not None and metrics is not None:
        found = preference_metrics(values[1:], pairs=int(evaluation.loss_units.sum()), prefix="eval_")
        metrics.update({key: found[key] for key in ("eval_rewards/accuracies", "eval_rewards/margins")})
    return values[0] / max(1, int(evaluation.loss_units.sum()))


def _maybe_inject_failure(config: TrainConfig, step: int, rank: int, loss: float | None = None) -> None:
    """Testing aid: worker 1 dies once, hard, after ``inject_failure_at_step``. A marker
    in the run folder makes it happen only once across restarts; it holds the step's loss as trained
    before the failure (``loss``), for a test to compare with the same step trained again.

    It dies once Ray Train has taken every report before this point (the checkpoints reported
    so far, their uploads done: ``ray.train.get_all_reported_checkpoints`` in COMMITTED mode
    waits for that, ray/train/v2/_internal/execution/checkpoint/checkpoint_manager.py), so the
    checkpoint a test expects the run to resume from is the same on a fast machine and a loaded
    one; a checkpoint started at this step and not reported yet is still being written."""
    if config.inject_failure_at_step is None or step != config.inject_failure_at_step or rank != 1:
        return
    if "://" in config.storage_path:
        raise ValueError("inject_failure_at_step works with a local storage_path only")
    marker = Path(config.storage_path) / config.run_name / ".injected-failure"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"worker 1 killed after step {step} (loss {loss!r})\n")
    import ray.train

    ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=120)
    print(f"[train] injected failure: worker 1 exits after step {step}", flush=True)
    os._exit(1)

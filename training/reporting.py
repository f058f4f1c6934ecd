"""After a step: its line in the job log and its record (:func:`log_step`), its report to Ray
Train with or without a checkpoint (:func:`save_and_report`, asynchronous where asked), the
checkpoint at a preemption notice, the final model's export, and the ways out of the run
(:func:`stop_run`, :func:`close`)."""

from __future__ import annotations

import json
import math
import time

import torch
import torch.distributed as dist

import ray.train
from .evaluation.best import RANK_METRIC, choose_export, load_model_weights, rank_of, ranks_by_eval
from .modeling.export import export_final_model, final_model_uri, run_uri, stop_notice_uri
from .modeling.lora import MERGED_FOLDER, adapter_base_name, export_lora, is_lora
from .storage.sources import resolve_model
from .resilience.elastic import say_ready
from .resilience.preemption import PREEMPTED, hold_until_replaced, release, seconds_left
from .resizing import announce_resize, size_text
from .storage.files import write_text
from .worker import DeliberateStop, Worker


#: A preference step's metrics (training/modeling/preference.py ``STATS``) and its evaluation's.
PREFERENCE_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                   "logps/rejected", "eval_rewards/accuracies", "eval_rewards/margins")


def log_step(worker: Worker, metrics: dict) -> None:
    """The step's line in the job log, its record in metrics.jsonl and its CloudWatch data (rank 0)."""
    if worker.rank != 0:
        return
    config, step = worker.config, metrics["step"]
    mfu_text = f"{metrics['mfu']:.1%}" if metrics["mfu"] is not None else "n/a (CPU)"
    eval_text = f" eval_loss {metrics['eval_loss']:.4f}" if metrics.get("eval_loss") is not None else ""
    if "rewards/margins" in metrics:  # preference pairs (training/modeling/preference.py), TRL's names
        eval_text += (f" margin {metrics['rewards/margins']:.4f} accuracy {metrics['rewards/accuracies']:.2f} "
                      f"chosen {metrics['rewards/chosen']:.4f} rejected {metrics['rewards/rejected']:.4f}")
    print(f"[train] {time.strftime('%H:%M:%S')} step {step}/{config.max_steps} loss {metrics['loss']:.4f}{eval_text} "
          f"lr {metrics['learning_rate']:.2e} grad_norm {metrics['grad_norm']:.3f} "
          f"tok/s/worker {metrics['tokens_per_s_per_worker']:,.0f} mfu {mfu_text} "
          f"peak_mem {metrics['peak_memory_gib']:.2f} GiB{size_text(worker, step)}", flush=True)
    record = {key: metrics.get(key) for key in ("step", "loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_s",
                                                 "mfu", "step_seconds", "peak_memory_gib", "epoch", "slowest_gpu_share",
                                                 "health", "best_step", "best_eval_loss", "sample_seconds",
                                                 *PREFERENCE_KEYS)}
    # The size the step trained at: its step time, tokens/s and MFU are that size's (an elastic run's changes).
    record["time"], record["workers"] = time.time(), worker.world
    record.update(cost_figures(worker, metrics))
    if step == worker.start_step + 1 and worker.resume_cause:
        record.update(resumed_from_step=worker.start_step, resume_cause=worker.resume_cause)
        if worker.resized_from:
            record["resized_from_workers"] = worker.resized_from
            announce_resize(worker, metrics)
    worker.run_log.record({k: v for k, v in record.items() if v is not None})
    if worker.tracker:
        worker.tracker.step(record)
    if worker.publisher:
        worker.publisher.step(step, {
            "loss": metrics["loss"], "eval_loss": metrics.get("eval_loss"), "grad_norm": metrics["grad_norm"],
            "step_seconds": metrics["step_seconds"], "tokens_per_s": metrics["tokens_per_s"],
            "mfu_percent": None if metrics["mfu"] is None else 100 * metrics["mfu"],
            "slowest_gpu_percent": None if metrics.get("slowest_gpu_share") is None else 100 * metrics["slowest_gpu_share"],
        })


def cost_figures(worker: Worker, metrics: dict) -> dict:
    """Rank 0's cost figures of a step (training/telemetry/cost.py): so far and projected at the recent
    steps' median time, into its record; the rate into the metrics Ray Train hands the driver."""
    if worker.cost is None:
        return {}
    metrics["cost"] = worker.cost.record()
    seconds = [r["step_seconds"] for r in worker.run_log.records if r.get("step_seconds")] + [metrics["step_seconds"]]
    projected = worker.cost.projected(steps_left=worker.config.max_steps - metrics["step"], step_seconds=seconds)
    return {"cost_usd": round(worker.cost.so_far(), 4),
            "cost_usd_projected": None if projected is None else round(projected, 4)}


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
    last = step == config.max_steps or bool(metrics.get("stopped_early"))
    best = bool(metrics.get("new_best")) and ranks_by_eval(config)  # the export may need these weights
    if step % config.checkpoint_every and not last and not best:
        report_metrics(worker, metrics)
        return
    report_written_checkpoint(worker, wait=True)  # one write in flight at a time
    worker.checkpoints.start(model=worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler,
                             train_state=train_state(worker, metrics), metrics=metrics)
    if last:  # staged (or written): the export may load the best step's weights into the model now
        metrics.update(finish(worker, last_step=step, last_eval_loss=metrics.get("eval_loss")))
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
    if pending.written_s is not None:
        worker.checkpoint_seconds = pending.written_s
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
            "best": worker.best.to_state(),
            # The size that saved it (a restore at another size reshards it: training/prepare.py). The step is the
            # position in the data at every size (training/data/order.py); ``rows`` (step x the global batch) counts
            # the packed sequences trained so far, for a reader: a restore does not read it.
            "workers": worker.world, "rows": metrics["step"] * worker.config.global_batch_size, **extra}


def checkpoint_at_notice(worker: Worker, metrics: dict, notice) -> None:
    """Every rank (the notice is the same on all) writes and reports one checkpoint of this
    step, marked as taken at a preemption notice, without waiting to report it later: the node
    is about to go. The run's log and metrics go out."""
    if worker.rank == 0:
        left = seconds_left(notice)
        print(f"[train] preemption notice for node(s) {', '.join(n[:12] for n in notice.preempted_node_ids)} "
              f"(ranks {notice.preempted_ranks}; {'%.0f s left' % left if left is not None else 'no deadline'}): "
              f"checkpoint at step {metrics['step']}, then waiting to be resumed elsewhere", flush=True)
    # Uploaded before anything else: Ray Train restarts from it as soon as the nodes are released.
    seconds = checkpoint_now(worker, metrics, **{PREEMPTED: True})
    if worker.rank == 0:
        print(f"[train] checkpoint at the notice written and uploaded in {seconds:.1f} s", flush=True)
    release_at_notice(worker, metrics, notice, "taken at the notice")


def release_at_notice(worker: Worker, metrics: dict, notice, checkpoint_is: str) -> None:
    """Once every rank reported this step's checkpoint (``checkpoint_is``: which one it is), rank 0 says
    the notice (unless a worker took the nodes out) and releases its nodes: Ray Train restarts the run
    from that checkpoint at once, not at the notice's deadline (training/resilience/preemption.py)."""
    if worker.rank == 0:
        if worker.notifier and not taken_out(worker, notice):  # before the release: Ray Train tears the workers down
            worker.notifier.publish(
                "preempted", f"a preemption notice for node(s) {', '.join(n[:12] for n in notice.preempted_node_ids)} (ranks "
                             f"{notice.preempted_ranks}): every rank checkpointed step {metrics['step']} and the nodes were "
                             "released; Ray Train restarts the run from that checkpoint", quick=True,
                step=metrics["step"], loss=metrics["loss"], max_steps=worker.config.max_steps,
                checkpoint=f"{run_uri(worker.config.storage_path, worker.config.run_name)}/checkpoint_* (step "
                           f"{metrics['step']}'s, {checkpoint_is})")
        release(notice)
    if worker.publisher:
        worker.publisher.close()
        worker.publisher = None


def checkpoint_for_growth(worker: Worker, metrics: dict, ask: dict) -> bool:
    """An elastic run's nodes came back (training/resizing.py ``growth_asked_at``): every rank checkpoints
    this step, uploaded, and rank 0 tells the controller, which restarts the worker group on the larger
    set of nodes from it (training/resilience/elastic.py). Whether rank 0 could answer (collective): if
    not, the workers train on and answer at a later checkpoint."""
    if worker.rank == 0:
        print(f"[elastic] {ask['nodes']} whole nodes are there: checkpoint at step {metrics['step']}, then the run restarts "
              "on them from it", flush=True)
    seconds = checkpoint_now(worker, metrics)
    answered = torch.tensor([1], device=worker.device)
    if worker.rank == 0:
        worker.run_log.flush()  # every step to this one in metrics.jsonl before the workers go
        answered[0] = int(say_ready(worker.invocation_id, ask["generation"], metrics["step"]))
        print(f"[elastic] checkpoint of step {metrics['step']} written and uploaded in {seconds:.1f} s"
              + ("" if answered.item() else "; the controller was not told: training on, asked again at the next checkpoint"),
              flush=True)
    dist.broadcast(answered, src=0)
    if answered.item() and worker.publisher:  # the workers go: the run's picture out first
        worker.publisher.close()
        worker.publisher = None
    return bool(answered.item())


def hold_for_growth(worker: Worker, metrics: dict, look_every_s: float = 1.0) -> None:
    """The workers wait for the controller to restart them on more nodes, from the checkpoint they just
    reported. A preemption notice meanwhile (Ray Train's controller then waits for the notice's deadline,
    not for the growth) releases the nodes at once, as at any notice: that checkpoint is the one the run
    resumes from. Never returns (every rank looks for the notice; rank 0 releases the nodes)."""
    while True:
        notice = ray.train.get_preemption_info()
        if notice is not None:
            if worker.rank == 0:
                print(f"[elastic] preemption notice for node(s) {', '.join(n[:12] for n in notice.preempted_node_ids)} "
                      f"while waiting to grow: the checkpoint of step {metrics['step']} is reported, releasing the "
                      "node(s) now", flush=True)
            release_at_notice(worker, metrics, notice, "written for the growth")
            hold_until_replaced()
        time.sleep(look_every_s)


def checkpoint_now(worker: Worker, metrics: dict, **mark) -> float:
    """Every rank writes this step's checkpoint (its train state with ``mark``) and reports it with the
    upload waited for (and every earlier one's: Ray keeps reports in order), then the ranks meet: Ray
    Train holds every rank's report. Returns the seconds it took."""
    started = time.monotonic()
    report_written_checkpoint(worker, wait=True)
    worker.checkpoints.start(model=worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler,
                             train_state=train_state(worker, metrics, **mark), metrics=metrics)
    report_written_checkpoint(worker, wait=True, upload="sync")
    dist.barrier()
    return time.monotonic() - started


def taken_out(worker: Worker, notice) -> bool:
    """Whether every node of a notice was taken out of the run by a worker (a node condition: its own
    message said so, training/resilience/faults.py), rather than preempted."""
    from .resilience.faults import faults_recorded

    try:
        return set(notice.preempted_node_ids) <= set(faults_recorded(worker.invocation_id))
    except Exception:  # noqa: BLE001 - unknown: a preemption's message too
        return False


def stop_before_stop_time(worker: Worker, metrics: dict) -> None:
    """The next step and a checkpoint would pass the run's stop time (training/loop.py ``stop_time_due``):
    every rank checkpoints this step and reports it, the upload waited for, marked with why; the loop
    then ends, and the run with it, finished to Ray Train (nothing retried), resumable from here. Nothing
    is exported: the run is not done."""
    reason = f"{worker.deadline.stop_reason()} (checkpointed at step {metrics['step']} of {worker.config.max_steps})"
    metrics["stopped_before"] = reason
    if worker.rank == 0:
        print(f"[train] stop time: {reason}", flush=True)
    seconds = checkpoint_now(worker, metrics)
    if worker.rank == 0:
        print(f"[train] checkpoint of step {metrics['step']} written and uploaded in {seconds:.1f} s; the run ends here",
              flush=True)


def finish(worker: Worker, *, last_step: int, last_eval_loss: float | None) -> dict:
    """Export the consolidated model (collective) and the run's summary figures. The export is the
    best evaluated step's weights (loaded from its checkpoint into the model: the model holds them
    after) unless they are the last step's, or ``--export last`` or no eval data says the last
    (training/evaluation/best.py ``choose_export``)."""
    config = worker.config
    choice = choose_export(config, worker.best, last_step=last_step, last_eval_loss=last_eval_loss,
                           evaluated=worker.data.eval is not None, reported=best_checkpoints(worker, last_step))
    if choice.checkpoint is not None:
        started = time.monotonic()
        load_model_weights(choice.checkpoint, worker.model)  # each rank its model shards, from storage
        if worker.rank == 0:
            print(f"[train] loaded step {choice.step}'s weights for the export in {time.monotonic() - started:.1f} s",
                  flush=True)
    if worker.rank == 0:
        print(f"[train] exporting step {choice.step} ({choice.which}): {choice.reason}", flush=True)
    uri = final_model_uri(config.storage_path, config.run_name)
    dtype = torch.bfloat16 if config.mixed_precision == "bf16" else torch.float32
    merged = None
    if is_lora(worker.model):
        merged = f"{run_uri(config.storage_path, config.run_name)}/{MERGED_FOLDER}" if config.merge_lora else None
        base_dir = resolve_model(config.model)
        merge_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(config.merge_lora_dtype, dtype)
        export_lora(worker.model, tokenizer=worker.tokenizer, rank=worker.rank, uri=uri, merged_uri=merged, base_dir=base_dir,
                    base_name=adapter_base_name(config.model, base_dir), dtype=merge_dtype, revision=config.model_revision)
    else:
        export_final_model(model=worker.model, tokenizer=worker.tokenizer, rank=worker.rank, uri=uri, dtype=dtype)
    throughput = worker.throughput
    return {
        "final_model": uri,
        # --merge-lora: the base with the adapters merged in (the adapter alone is in final/).
        "merged_model": merged,
        # The memory plan against rank 0's GPU (None on CPU): what the first run on a GPU type measures.
        "memory": worker.memory_calibration,
        # What happened to the rows: skipped by cause with the first of each, truncated.
        "data": worker.data.report.summary(),
        # Median over this invocation's steps, the first (warm-up) excluded; at this invocation's size.
        "tokens_per_s_per_worker": sorted(throughput)[len(throughput) // 2] if throughput else None,
        "workers": worker.world,
        # Which step's weights final/ holds, and why (the best's eval loss against the last's).
        "export": choice.summary(),
    }


def best_checkpoints(worker: Worker, last_step: int) -> list | None:
    """Ray Train's reported checkpoints (every upload committed), where the export may need the best
    step's: a run ranked by eval loss whose best is not its last step. Every rank asks: the list is
    the controller's, the same for all."""
    step = worker.best.step
    if not ranks_by_eval(worker.config) or step is None or step == last_step:
        return None
    return ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def finish_again(worker: Worker, *, stopped_early: str | None = None) -> None:
    """Nothing left to train (a rerun with the same ``--max-steps``, or of a run that stopped early):
    export and report again, the restored state checkpointed first (the export may load the best's weights)."""
    state = worker.restored
    metrics = {"step": worker.start_step, "loss": state["loss"], "eval_loss": state.get("eval_loss"),
               "first_loss": worker.first_loss, "resumed_from_step": worker.resumed_from_step,
               RANK_METRIC: rank_of(state.get("eval_loss"), worker.start_step), "stopped_early": stopped_early}
    worker.checkpoints.start(model=worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler,
                             train_state=state, metrics=metrics)
    metrics.update(finish(worker, last_step=worker.start_step, last_eval_loss=state.get("eval_loss")))
    report_written_checkpoint(worker, wait=True)


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
    if worker.run_log:  # first: metrics.jsonl is the record of truth (the driver logs the tracker's gaps from it)
        worker.run_log.flush(picture=True, wait=True)
        worker.run_log.close()
    if worker.tracker:
        worker.tracker.close(timeout_s=5)

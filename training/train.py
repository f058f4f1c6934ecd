"""``python -m training.train``: validate the configuration (and a local data set), start (or
join) Ray, run the fine-tune with Ray Train, and print a one-line JSON summary as the last
line of stdout (and into ``--summary-file``).

    python -m training.train --preset tiny-cpu --storage-path /tmp/runs      # local, CPU
    python -m training.train --storage-path s3://bucket/runs --expect-efa    # what the RayJob runs
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Sequence

from .config import ConfigError, TrainConfig, parse_config

#: Lines Ray's driver must never collapse into ``[repeated Nx across cluster]``: it folds lines
#: that differ only in digits (Ray 2.58 ``_private/ray_logging``, ``_canonicalise_log_line``), so
#: of eight ranks' NCCL warnings, GPU checks or memory figures one would be shown and which rank
#: or peer failed would be lost. ``RAY_DEDUP_LOGS_ALLOW_REGEX`` is Ray's setting for such lines; it
#: is read once, when ``ray`` is imported (``ray_constants``), so it is set here, before.
NEVER_COLLAPSED = r"^\[(nccl|health|preflight|memory)\] "
os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", NEVER_COLLAPSED)

#: The run's summary, also beside its metrics (the last line of stdout, and --summary-file).
SUMMARY_FILE = "summary.json"

#: Seconds Ray Train waits for its workers to be placed before it tries again: 15 minutes, what a
#: replacement GPU node takes at worst (launch, join, an image pull of tens of GB).
WORKER_GROUP_START_TIMEOUT_S = 900



def check_dataset(config: TrainConfig) -> None:
    """The data set is read and tokenized on the driver, before Ray starts, exactly as every
    worker will (``training.data.build_training_data``: the same rows held out, the same
    ``--max-samples``, ``--seq-len`` and chat template), from a local path, ``s3://`` or the
    Hub: a data set with too few usable rows fails in seconds, naming each cause and its first
    row, instead of on every worker after the nodes started."""
    from transformers import AutoTokenizer

    from .data import DataError, build_training_data
    from .storage.sources import resolve_dataset, resolve_tokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer(config.model))
    except Exception as error:  # a Hub id that does not exist, no network, no access
        raise ConfigError([f"model={config.model!r}: cannot load its tokenizer ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else error}); check --model and the network"]) from error
    try:
        build_training_data(tokenizer, resolve_dataset(config.dataset, seed=config.seed), seq_len=config.seq_len,
                            seed=config.seed, split=config.dataset_split, max_samples=config.max_samples,
                            eval_fraction=config.eval_fraction, eval_split=config.eval_split,
                            eval_max_sequences=config.eval_max_sequences, name=config.dataset, objective=config.objective)
    except (DataError, FileNotFoundError) as error:
        raise ConfigError([str(error)]) from error


def check_eval_tasks(config: TrainConfig) -> None:
    """``--eval-tasks``: each a task lm-evaluation-harness knows and can load the data of, before Ray
    starts (training/evaluation/harness.py)."""
    from .evaluation.harness import TaskProblem, check_tasks, harness_here

    if not harness_here():  # checked once Ray is up, where the benchmark runs (training/evaluation/harness.py)
        return
    try:
        check_tasks(config)
    except TaskProblem as error:
        raise ConfigError([str(error)]) from None


def check_model(config: TrainConfig) -> TrainConfig:
    """Checks that need the model's config, before any worker starts, and the memory plan
    (:func:`plan_memory`); returns the config with the sharding the plan chose. (flash-attention
    is checked on the GPU workers, in the preflight: the driver runs on a CPU pod.)"""
    from .config import learning_rate_notes
    from .modeling.export import run_uri
    from .storage.files import read_text
    from .storage.sources import pinned_revision, read_model_config, resolve_model
    from .telemetry.runlog import RUN_FILE

    for line in learning_rate_notes(config):
        print(line, flush=True)
    try:  # a Hub model at one commit for the whole run, a resume's included (its run.json has it)
        recorded = json.loads(read_text(f"{run_uri(config.storage_path, config.run_name)}/{RUN_FILE}") or "{}")
        config = dataclasses.replace(config, model_revision=pinned_revision(config.model, config.model_revision, recorded))
        model_config = read_model_config(resolve_model(config.model), config.model_revision)
    except Exception as error:  # a Hub id that does not exist, no network, no access
        raise ConfigError([f"model={config.model!r}: cannot read its config.json ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else error}); check --model and the network"]) from error
    config.check_against_model(max_position_embeddings=model_config["max_position_embeddings"])
    for line in merge_notes(config, model_config):
        print(line, flush=True)
    return plan_memory(config, model_config)


#: A merged model built on rank 0's host above this many bytes is worth a word before the run.
MERGE_HOST_WARNING_BYTES = 64 * 2**30


def merge_notes(config: TrainConfig, model_config: dict) -> list[str]:
    """``--merge-lora`` builds the whole base, merged, on rank 0's host at the end of the run
    (training/modeling/lora.py ``export_merged``): in fp32 that is 4 bytes a parameter (131 GB for a
    32B model), beside the node's other workers. Said before the run, with the figure."""
    from .modeling.plan import ModelShape

    if config.peft != "lora" or not config.merge_lora:
        return []
    try:
        parameters = ModelShape.from_config(model_config, name=config.model).parameters
    except ValueError:
        return []
    width = 4 if (config.merge_lora_dtype or ("fp32" if config.mixed_precision == "fp32" else "bf16")) == "fp32" else 2
    needed = parameters * width
    if needed < MERGE_HOST_WARNING_BYTES:
        return []
    return [f"[train] warning: --merge-lora builds the merged model on rank 0's host in "
            f"{'fp32' if width == 4 else 'bf16'}: {needed / 1e9:.0f} GB of host memory at the end of the run, beside the "
            "node's other workers; the adapter (final/) is uploaded first, so an out-of-memory there loses the merged copy "
            "only" + ("; --merge-lora-dtype bf16 halves it" if width == 4 else "")]


def plan_memory(config: TrainConfig, model_config: dict) -> TrainConfig:
    """The memory plan (training/modeling/plan.py) of a GPU run whose GPU type is known, printed; a plan
    that does not fit stops the run here, before Ray starts, naming what would fit. HSDP, when
    it is only the default, gives way to full sharding where its shard group has no room."""
    from .modeling.plan import DoesNotFit, ModelShape, check_sizes, job_options

    if not config.use_gpu or not config.gpu_type:
        return config.with_defaults()
    try:
        shape = ModelShape.from_config(model_config, name=config.model)
    except ValueError as error:
        print(f"[plan] no memory plan: {error}", flush=True)
        return config.with_defaults()
    try:
        options, chosen = job_options(shape, config.gpu_type, config)
    except ValueError as error:  # LoRA targets this model does not have
        raise ConfigError([str(error)]) from None
    for line in chosen:
        print(f"[plan] {line}", flush=True)
    if options.shard_size != config.shard_size:  # HSDP's shard group had no room: full sharding
        config = dataclasses.replace(config, hsdp=False)
    config = dataclasses.replace(config, activation_checkpointing=options.activation_checkpointing,
                                 micro_batch_size=options.micro_batch_size)
    try:
        found = check_sizes(shape, config.gpu_type, options, config.worker_counts)
    except DoesNotFit as error:
        print(error.plan.table(), flush=True)
        at = (f" at the smallest size --min-nodes {config.min_nodes} allows"
              if error.plan.options.num_workers < config.num_workers else "")
        raise ConfigError([f"memory{at}: {error}"]) from None
    for plan in found:
        print(plan.table(), flush=True)
    return config


def start_ray(config: TrainConfig) -> None:
    """Join the cluster named by ``RAY_ADDRESS`` (as inside a RayJob), or start a local
    Ray for this run, bound to 127.0.0.1."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return
    # Logical CPUs: the workers plus Ray Train's controller, whatever this machine has.
    # address="local": a new Ray, never a cluster another process left recorded on this machine
    # (/tmp/ray/ray_current_cluster), which ray.init() would join and then refuse num_cpus.
    # Ray's state API, which Ray Train's PlacementGroupCleaner asks every second whether the
    # controller lives (train/v2/_internal/execution/controller/placement_group_cleaner.py), finds
    # its server through that same file, which only `ray start` writes (ray/scripts/scripts.py): a
    # local Ray's workers would ask another (or no) cluster, each call hanging 40 s, and every run
    # would end with the cleaner's 12 s stop timeout. This Ray's own dashboard answers instead.
    dashboard_port = free_port(preferred=8265)  # Ray's own default, where it is free
    with state_api_of_new_ray(f"http://127.0.0.1:{dashboard_port}"):
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, config.num_workers + 1),
                 _node_ip_address="127.0.0.1", dashboard_host="127.0.0.1", dashboard_port=dashboard_port,
                 log_to_driver=True)


#: Ray's override of the state and job API server's address (ray_constants.RAY_API_SERVER_ADDRESS_ENVIRONMENT_VARIABLE,
#: read by ray/dashboard/utils.py get_address_for_submission_client before any other way of finding it).
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"


@contextlib.contextmanager
def state_api_of_new_ray(url: str):
    """Around the start of a Ray head in this process: its raylet, and so every worker of the node
    (Ray Train's PlacementGroupCleaner among them), inherits ``url`` as the state API's server; this
    process's own clients (a ``ray job submit`` from it, say) keep finding theirs as before."""
    saved = os.environ.get(API_SERVER_ENV)
    os.environ[API_SERVER_ENV] = url
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(API_SERVER_ENV, None)
        else:
            os.environ[API_SERVER_ENV] = saved


def free_port(preferred: int = 0) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: ``preferred`` where it is free."""
    import socket

    for port in dict.fromkeys((preferred, 0)):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def run(config: TrainConfig) -> dict:
    """Run the fine-tune under Ray Train and return the summary."""
    from .evaluation.best import rank_earlier_checkpoints
    from .evaluation.harness import check_tasks_where_they_run, run_benchmarks
    from .modeling.export import run_uri, stop_notice_uri
    from .resilience.elastic import ElasticSizes
    from .resilience.elastic_policy import installed as elastic_policy_installed
    from .storage.files import read_text, remove
    from .telemetry.cost import RunCost, earlier_cost, ray_cluster_started
    from .telemetry.notify import Notifier
    from .telemetry.run_end import last_figures, notify_end, notify_error
    from .telemetry.tracking import RunTracking

    started = time.time()  # the job's start: its GPU nodes are billed from here (training/telemetry/cost.py)
    config = config.with_defaults()  # what no memory plan chose (plan_memory chooses where it can)
    if "://" not in config.storage_path:  # workers may not share the driver's working directory
        config = dataclasses.replace(config, storage_path=os.path.abspath(config.storage_path))
    set_ray_train_environment()
    start_ray(config)
    folder = run_uri(config.storage_path, config.run_name)
    check_tasks_where_they_run(config)  # the benchmark's tasks, where the driver has no harness: before training
    rank_earlier_checkpoints(config, folder)
    tracking = RunTracking.open(config, folder)  # None: not tracked (none asked, or the tracker unreachable)
    notifier = Notifier.from_env(run_name=config.run_name, run_folder=folder)  # None: no topic, nothing is sent
    deadline = stop_time(config)
    invocation_id = f"{time.time_ns()}-{os.getpid()}"
    trainer = build_trainer(config, invocation_id=invocation_id, tracking=tracking.for_workers() if tracking else None,
                            notify=notifier.for_workers() if notifier else None, deadline=deadline,
                            cost={"_started": started, "_earlier_usd": earlier_cost(folder),
                                  "_cluster_started": ray_cluster_started()})  # its nodes' time before the driver
    notice = stop_notice_uri(config.storage_path, config.run_name)
    remove(notice)
    try:
        with elastic_policy_installed(ElasticSizes.of(config), invocation_id):  # an elastic run: our policy, not Ray's
            result = trainer.fit()
    except BaseException as error:
        killed = isinstance(error, (KeyboardInterrupt, SystemExit))  # SystemExit: SIGTERM (ray job stop, the RayJob
        if notifier:  # deleted) through Ray's driver handler; first, in the seconds before the SIGKILL
            notify_error(notifier, error, config, folder, killed=killed)
        if tracking and killed:
            tracking.finish("KILLED", run_folder=folder)
        stop_ray()  # the failed workers' last lines (NCCL's warnings among them) reach the log first
        if tracking and not killed:
            tracking.finish("FAILED", run_folder=folder)
        raise
    stopped = read_text(notice)
    if stopped:
        stop_ray()
        if tracking:
            tracking.finish("FAILED", run_folder=folder)
        last_good = result.checkpoint.path if result.checkpoint else "none"
        if notifier:
            notifier.publish("stopped", json.loads(stopped)["error"], **last_figures(folder, config),
                             checkpoint=last_good)
        raise TrainingStopped(f"{json.loads(stopped)['error']}; the last good checkpoint stays: {last_good}")
    summary = summary_of(result, config)
    if deadline and summary.get("stopped_before"):
        print(f"[train] stopped at step {summary['steps']}: {summary['stopped_before']}", flush=True)
    write_summary(folder, summary)  # beside the metrics: `ray-train-eks status` reads it (again after the benchmark)
    # On the job's GPUs, Ray Train's workers gone; never fails the run. None for a run stopped before its stop time.
    benchmarks = None if summary.get("stopped_before") else run_benchmarks(config, summary)
    if benchmarks is not None:
        summary["benchmarks"] = benchmarks
    cost = RunCost.from_record((result.metrics or {}).get("cost"))
    if cost is not None:  # the nodes were held through the benchmark too
        summary["cost"] = cost.final()
    write_summary(folder, summary)
    stop_ray()
    if tracking:
        summary["tracking"] = tracking.finish("FINISHED", run_folder=folder, summary=summary, register_as=config.register_model)
    if notifier:
        notify_end(notifier, summary, config)
    return summary


def stop_time(config: TrainConfig):
    """When the run must have checkpointed and stopped (training/resilience/deadline.py), said; None: never."""
    from .resilience.deadline import iso, resolve

    deadline = resolve(config.stop_before)
    if deadline is not None:
        print(f"[train] stop time {iso(deadline.stop_at)} ({deadline.reason}): the run checkpoints and stops, resumable, "
              "where the next step and a checkpoint would pass it", flush=True)
    return deadline


def write_summary(folder: str, summary: dict) -> None:
    """The summary into the run's folder; a storage error is said, never fails a finished run."""
    from .storage.files import write_text

    try:
        write_text(f"{folder}/{SUMMARY_FILE}", json.dumps(summary) + "\n")
    except Exception as error:  # noqa: BLE001 - the summary line on stdout stands
        print(f"[train] could not write {folder}/{SUMMARY_FILE} ({type(error).__name__}: {error})", file=sys.stderr, flush=True)


def set_ray_train_environment() -> None:
    """Ray Train's settings for this driver, unless the environment sets them already."""
    # Ray Train's controller collects reports at this interval (default 2 s); a worker
    # blocks when a few are pending, so short steps would wait on it.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    # Ray Train also copies worker prints into its logger, which reaches the driver a
    # second time; one copy is enough.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # A lost node's replacement takes minutes (launch, join, image pull): wait for the worker
    # group in one long placement-group wait rather than a retry with a traceback every 60 s
    # (ray/train/v2/_internal/constants.py; each timeout counts against
    # controller_failure_limit, unlimited below). An elastic run's policy keeps it for a wait below
    # --min-nodes and uses Ray's own 60 s for a start on nodes that are there (training/resilience/elastic_policy.py).
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(WORKER_GROUP_START_TIMEOUT_S))
    # A local Ray's workers inherit this (the RayJob's runtime env sets it on a cluster): PyTorch's
    # allocator grows segments rather than caching fixed blocks (less fragmentation).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def build_trainer(config: TrainConfig, *, invocation_id: str, tracking: dict | None = None, notify: dict | None = None,
                  deadline=None, cost: dict | None = None):
    """The ``TorchTrainer`` of the run: the worker loop, its scaling, storage and failure budgets."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from .evaluation.best import checkpoint_config
    from .loop import train_loop_per_worker
    from .resilience.elastic import ElasticSizes
    from .resilience.elastic_policy import growth_reports
    from .resilience.preemption import REPLACEMENT_TIMEOUT_ENV, retry_counter

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={**config.to_dict(), "_invocation_id": invocation_id, "_tracking": tracking, "_notify": notify,
                           "_deadline": deadline.to_dict() if deadline else None, **(cost or {})},
        torch_config=TorchConfig(backend="nccl" if config.use_gpu else "gloo"),
        # An elastic run's sizes as Ray Train's (min, max): training/resilience/elastic_policy.py decides within them.
        scaling_config=ScalingConfig(num_workers=(min(config.worker_counts), config.num_workers)
                                     if len(config.worker_counts) > 1 else config.num_workers, use_gpu=config.use_gpu),
        run_config=RunConfig(
            name=config.run_name,
            storage_path=config.storage_path,
            # The --keep-checkpoints lowest by eval loss and the latest (training/evaluation/best.py), or the last ones.
            checkpoint_config=checkpoint_config(config),
            # Three budgets (ray/train/v2/_internal/execution/failure_handling/default.py): failures
            # without notice (a dead process or node), preemptions with notice (a drained node),
            # and the controller's own (waiting for a replacement node): never give up on those.
            # The first is kept by the retry counter, not by Ray: Ray charges a worker that torch's
            # NCCL watchdog ended at a GPU fault to it, and only the counter knows it was the GPU.
            failure_config=FailureConfig(max_failures=-1, max_preemption_failures=config.max_preemptions,
                                         controller_failure_limit=-1),
            # What the failure policy charged to which budget reaches the workers, and the summary;
            # a restart after a worker recorded a hardware fault counts as one (training/resilience/faults.py).
            # An elastic run's policy restarts its workers for a growth once their checkpoint is registered.
            callbacks=[retry_counter(invocation_id, max_failures=config.max_failures,
                                     replacement_timeout_s=float(os.environ.get(REPLACEMENT_TIMEOUT_ENV) or 0) or None,
                                     max_hardware_faults=config.max_hardware_faults),
                       *([growth_reports(invocation_id)] if ElasticSizes.of(config) else [])],
        ),
    )


def summary_of(result, config: TrainConfig) -> dict:
    """The run's one-line summary, from Ray Train's result and the run's own metrics."""
    from .modeling.export import run_uri
    from .telemetry.runlog import CURVES_FILE, METRICS_FILE

    metrics = result.metrics or {}
    per_worker = metrics.get("tokens_per_s_per_worker")
    checkpoint = result.checkpoint.path if result.checkpoint else None
    scheme = config.storage_path.split("://")[0] + "://" if "://" in config.storage_path else ""
    if checkpoint and scheme and "://" not in checkpoint:  # Ray gives the path within its filesystem
        checkpoint = scheme + checkpoint
    return {
        "first_loss": metrics.get("first_loss"),
        "final_loss": metrics.get("loss"),
        "steps": metrics.get("step"),
        "resumed_from_step": metrics.get("resumed_from_step"),
        # At the size the run ended at (an elastic run's may be smaller than --num-workers).
        "tokens_per_s": per_worker * (metrics.get("workers") or config.num_workers) if per_worker else None,
        "tokens_per_s_per_worker": per_worker,
        "eval_loss": metrics.get("eval_loss"),
        "preemptions": metrics.get("preemptions", 0),
        "failures": metrics.get("failures", 0),
        "hardware_faults": metrics.get("hardware_faults", 0),
        "mfu": metrics.get("mfu"),
        "peak_memory_gib": metrics.get("peak_memory_gib"),
        # The memory plan against rank 0's GPU over a step with optimizer state (training/telemetry/memory.py).
        "memory": metrics.get("memory"),
        "checkpoint": checkpoint,
        "final_model": metrics.get("final_model"),
        # Which step's weights final/ holds and why; why the run ended before --max-steps.
        "export": metrics.get("export"),
        **({"stopped_early": metrics["stopped_early"]} if metrics.get("stopped_early") else {}),
        # Checkpointed and stopped before the run's stop time (training/resilience/deadline.py): resumable.
        **({"stopped_before": metrics["stopped_before"]} if metrics.get("stopped_before") else {}),
        **({"merged_model": metrics["merged_model"]} if metrics.get("merged_model") else {}),
        "data": metrics.get("data"),
        **({"preference": preference_summary(config, metrics)} if config.objective == "dpo" else {}),
        "metrics": f"{run_uri(config.storage_path, config.run_name)}/{METRICS_FILE}",
        "curves": f"{run_uri(config.storage_path, config.run_name)}/{CURVES_FILE}",
    }


def preference_summary(config: TrainConfig, metrics: dict) -> dict:
    """A preference run's loss, beta, reference and last metrics (TRL's names), for the summary."""
    from .modeling.preference import STATS, PreferenceSettings
    from .modeling.reference import REFERENCE_FILE
    from .modeling.export import run_uri

    settings = PreferenceSettings.of(config)
    if not settings.needs_reference:
        reference = "none (SimPO is reference-free)"
    elif config.peft == "lora":
        reference = "the base with the adapters off, computed in each step"
    else:
        reference = f"precomputed before the first step: {run_uri(config.storage_path, config.run_name)}/{REFERENCE_FILE}"
    keys = (*STATS, "eval_rewards/accuracies", "eval_rewards/margins")
    return {"loss": settings.loss, "beta": settings.beta_value, "reference": reference,
            **({"gamma": settings.gamma_value} if settings.loss == "simpo" else {}),
            **{key: metrics[key] for key in keys if metrics.get(key) is not None}}


def stop_ray() -> None:
    """Disconnect from Ray before the summary is printed: Ray's log monitor prints worker lines
    on the driver's stdout asynchronously, after whatever the driver printed last, until the
    driver disconnects (``ray.shutdown`` closes the log subscriber and joins its printing
    thread). The pause first lets the workers' last lines, flushed at their end, arrive."""
    import ray

    time.sleep(1.0)
    ray.shutdown()


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (a non-finite loss); its last good checkpoint stays."""


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    from .evaluation.harness import TaskProblem

    try:
        config = parse_config(argv)
        check_dataset(config)
        check_eval_tasks(config)
        config = check_model(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        summary = run(config)
    except TaskProblem as error:  # a benchmark task, checked where the harness runs, before training
        print(f"error: 1 problem(s) in the training configuration:\n  - {error}", file=sys.stderr)
        return 2
    except TrainingStopped as error:
        print(f"error: training stopped: {error}", file=sys.stderr)
        return 1
    line = json.dumps(summary)
    if config.summary_file:
        from .storage.files import write_text

        write_text(config.summary_file if "://" in config.summary_file else os.path.abspath(config.summary_file), line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

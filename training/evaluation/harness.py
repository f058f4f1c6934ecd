"""Benchmark scores of the exported model (``--eval-tasks``): EleutherAI's lm-evaluation-harness
(``lm-eval``, pinned: :data:`~.options.HARNESS_PACKAGES`) after training, on the job's own GPUs,
against the base model's scores on the same tasks (computed once per model, task set and
harness version, kept under the storage path).

- Before Ray starts (:func:`check_tasks`, on the driver): every name must be a task the harness
  knows (its own, or a YAML in ``--eval-tasks-path``), and every task must load its data (the
  harness reads each data set when it builds the task: a Hub data set with no network, a local
  file that is not there, a task whose extra packages are missing fail here, in seconds).
- After training (:func:`run_benchmarks`, on the driver): one Ray task with a node's GPUs
  (``--workers-per-node``; the harness's ``hf`` model spreads a model that one GPU cannot hold
  across them, ``parallelize=True``: accelerate's ``device_map="auto"``) downloads ``final/``,
  evaluates it (a LoRA adapter on its base, the harness's ``peft`` argument) and the base where
  its scores are not kept yet, and returns both. The driver writes ``eval_results.json`` beside
  the model and returns what the summary shows; whatever fails, the run's outputs stand and the
  summary says what failed.

lm-eval's API as read in 0.4.13 (``lm_eval/evaluator.py`` ``simple_evaluate``, ``lm_eval/tasks/__init__.py``
``TaskManager``, ``lm_eval/models/huggingface.py`` ``HFLM``): metrics are ``results[task]["<metric>,<filter>"]``;
``config.model_dtype`` is a ``torch.dtype`` (``lm_eval.utils.handle_non_serializable`` writes it);
``limit`` below 1.0 is a fraction of the examples, so it is passed as an int or None."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from .options import task_names

#: Beside the exported model: the scores of the model and the base, and how they were computed.
RESULTS_FILE = "eval_results.json"
#: Under the storage path: the base models' scores, one file per model, task set and harness version.
BASE_SCORES_FOLDER = ".benchmarks"
#: Examples the harness runs at once (``auto`` probes at the model's whole context, 32k tokens for Qwen2.5).
BATCH_SIZE = 16


#: The benchmark's longest wait, after which it is cancelled and the summary says so (``RAY_TRAIN_EKS_BENCHMARK_TIMEOUT_S``).
TIMEOUT_S = 3 * 3600


class TaskProblem(ValueError):
    """A benchmark task that cannot run, said before training starts."""


def harness_here() -> bool:
    """Whether this process can import lm-evaluation-harness (a local run, the tests)."""
    import importlib.util

    return importlib.util.find_spec("lm_eval") is not None


def harness_runtime_env() -> dict | None:
    """The runtime env of the benchmark's Ray tasks: this process's where it has the harness, else Ray's
    ``pip`` env of :data:`~.options.HARNESS_PACKAGES` (and PEFT, accelerate) for those tasks alone (a virtualenv over the image's
    packages on the node that runs them): the job's training never sees the harness's dependencies."""
    from ..config import LORA_PACKAGES
    from .options import HARNESS_PACKAGES

    return None if harness_here() else {"pip": {"packages": [*HARNESS_PACKAGES, *LORA_PACKAGES], "pip_check": False}}


def check_tasks_where_they_run(config) -> None:
    """:func:`check_tasks` in this process where it has the harness (before Ray starts), else, once Ray
    is up and before training, in a Ray task with the harness's environment on a worker node (where the
    benchmark reads the data too)."""
    if not task_names(config.eval_tasks) or harness_here():
        return
    import ray

    check = ray.remote(num_cpus=1, max_retries=0, runtime_env=harness_runtime_env())(_check_remotely)
    problem = ray.get(check.remote(config.to_dict(), task_files(config)))
    if problem:
        raise TaskProblem(problem)


def _check_remotely(config_dict: dict, files: dict[str, bytes]) -> str | None:
    from dataclasses import replace

    from ..config import TrainConfig

    config = TrainConfig.from_dict(config_dict)
    with tempfile.TemporaryDirectory() as local:
        if files:
            config = replace(config, eval_tasks_path=place_task_files(files, tasks_path(config), f"{local}/tasks"))
        try:
            check_tasks(config)
        except TaskProblem as problem:
            return str(problem)
    return None


def task_manager(names: list[str], include_path: str | None):
    """The harness's task index: ``include_path``'s YAML files, and its own tasks where ``names`` needs
    them (indexing its thousands of YAML files costs seconds)."""
    from lm_eval.tasks import TaskManager

    if include_path:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in manager.all_tasks for name in names):
            return manager
    return TaskManager(include_path=include_path)


def tasks_path(config) -> str | None:
    """``--eval-tasks-path`` as an absolute path."""
    return os.path.abspath(os.path.expanduser(config.eval_tasks_path)) if config.eval_tasks_path else None


def check_tasks(config) -> None:
    """Every ``--eval-tasks`` name is a task the harness knows, and loads its data; else
    :class:`TaskProblem` naming the task, the cause and the fix."""
    names = task_names(config.eval_tasks)
    if not names:
        return
    try:
        import lm_eval.models.huggingface  # noqa: F401 - the hf model's imports (accelerate) too
    except ImportError as error:
        raise TaskProblem(f"eval_tasks={config.eval_tasks!r} needs lm-evaluation-harness ({error}); pip install "
                          "lm-eval==0.4.13 (the Ray job installs it where --eval-tasks is given)") from None
    manager = task_manager(names, tasks_path(config))
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise TaskProblem(f"eval_tasks: {', '.join(map(repr, unknown))} is not a task lm-evaluation-harness "
                          f"{_version()} knows (e.g. gsm8k, ifeval, mmlu, hellaswag, arc_easy); for a task of your "
                          "own give its YAML's folder with --eval-tasks-path")
    for name in names:
        try:
            manager.load([name])
        except Exception as error:  # noqa: BLE001 - no network to its data, a missing file, a missing extra package
            raise TaskProblem(f"eval_tasks: task {name!r} cannot load ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:300] if str(error) else ''}); check the network to its "
                              "data set, its files, or its extra packages, or drop it from --eval-tasks") from None


#: At most this much of --eval-tasks-path travels to the benchmark's node.
MAX_TASK_FILES_BYTES = 64 * 2**20


def task_files(config) -> dict[str, bytes]:
    """``--eval-tasks-path``'s files (the YAML and the data beside it), which the benchmark's Ray task
    writes on its own node (the driver's folder is on another pod)."""
    root = tasks_path(config)
    if not root:
        return {}
    files = {str(path.relative_to(root)): path.read_bytes() for path in sorted(Path(root).rglob("*")) if path.is_file()}
    size = sum(map(len, files.values()))
    if size > MAX_TASK_FILES_BYTES:
        raise TaskProblem(f"eval_tasks_path={config.eval_tasks_path!r} holds {size / 2**20:.0f} MiB; at most "
                          f"{MAX_TASK_FILES_BYTES // 2**20} MiB travels to the benchmark's node: put large data on S3")
    return files


def place_task_files(files: dict[str, bytes], original: str, local: str) -> str:
    """Write ``files`` under ``local``, with the YAML files' mentions of the driver's folder
    ``original`` (a data file's absolute path) turned into ``local``; returns ``local``."""
    for name, data in files.items():
        path = Path(local) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix in (".yaml", ".yml"):
            data = data.decode().replace(original, local).encode()
        path.write_bytes(data)
    return local


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm-eval")
    except PackageNotFoundError:
        return "unknown"


def settings_of(config) -> dict:
    """How the scores are computed: what a base's kept scores must match to be reused."""
    digest = None
    if config.eval_tasks_path:
        files = sorted(Path(os.path.expanduser(config.eval_tasks_path)).rglob("*.y*ml"))
        digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()[:16]
    return {"tasks": task_names(config.eval_tasks), "limit": config.eval_limit, "lm_eval": _version(),
            "tasks_path_digest": digest, "batch_size": BATCH_SIZE}


def base_scores_uri(config) -> str:
    """Where the base model's scores under :func:`settings_of` are kept."""
    pinned = {"revision": config.model_revision} if getattr(config, "model_revision", None) else {}  # the base's commit
    key = hashlib.sha256(json.dumps({"model": config.model, **pinned, **settings_of(config)}, sort_keys=True).encode()).hexdigest()[:20]
    return f"{config.storage_path.rstrip('/')}/{BASE_SCORES_FOLDER}/{key}.json"


def scores_of(results: dict | None) -> dict:
    """``{task: {metric: value}}``: the numbers of the harness's ``results`` (the filter ``none`` left
    out of the name, any other kept after a slash; stderr entries left out)."""
    scores: dict = {}
    for task, metrics in ((results or {}).get("results") or {}).items():
        for key, value in metrics.items():
            name, _, where = key.partition(",")
            if not where or "_stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            scores.setdefault(task, {})[name if where == "none" else f"{name}/{where}"] = value
    return scores


def difference(scores: dict, base: dict) -> dict:
    """The model's scores minus the base's, where both have the number."""
    return {task: {name: value - base[task][name] for name, value in metrics.items() if name in base.get(task, {})}
            for task, metrics in scores.items() if task in base}


def run_benchmarks(config, summary: dict, *, log=print) -> dict | None:
    """After training, on the driver (Ray up): the benchmark of ``summary['final_model']`` and of the
    base (its kept scores where they exist), ``eval_results.json`` written beside the model; what the
    summary shows (``error`` where something failed: the run's outputs stand)."""
    names = task_names(config.eval_tasks)
    if not names or not summary.get("final_model"):
        return None
    from ..storage.files import read_text, write_text

    started = time.monotonic()
    kept_uri = base_scores_uri(config)
    try:
        kept = json.loads(read_text(kept_uri) or "null")
        done = _evaluate_in_ray(config, summary, base=kept is None, log=log)
        if kept is None and done.get("base") is not None:
            kept = {"model": config.model, "settings": settings_of(config), "results": done["base"]}
            write_text(kept_uri, json.dumps(kept, indent=1))
        results_uri = f"{summary['final_model'].rstrip('/')}/{RESULTS_FILE}"
        write_text(results_uri, json.dumps({"settings": settings_of(config), "model": done["model"],
                                            "base": {"model": config.model, "results": (kept or {}).get("results")}}, indent=1))
    except Exception as error:  # noqa: BLE001 - a benchmark never fails the run it measures
        line = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:400] if str(error).strip() else ''}"
        log(f"[benchmark] failed, the run's outputs stand: {line}")
        return {"error": line}
    scores, base = scores_of(done["model"]), scores_of((kept or {}).get("results"))
    shown = {"results": results_uri, "scores": scores, "base": base, "difference": difference(scores, base),
             "base_scores": kept_uri, "seconds": round(time.monotonic() - started, 1)}
    for task, metrics in scores.items():
        log(f"[benchmark] {task}: " + ", ".join(
            f"{name} {value:.4f} (base {base.get(task, {}).get(name, float('nan')):.4f})" for name, value in metrics.items()))
    return shown


def _evaluate_in_ray(config, summary: dict, *, base: bool, log) -> dict:
    """:func:`evaluate_models` in one Ray task with a node's GPUs (the harness's environment), waited
    for at most :data:`TIMEOUT_S` (then cancelled: a benchmark never holds the cluster for ever)."""
    import ray

    gpus = config.workers_per_node if config.use_gpu else 0
    timeout = float(os.environ.get("RAY_TRAIN_EKS_BENCHMARK_TIMEOUT_S") or TIMEOUT_S)
    task = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=0, runtime_env=harness_runtime_env())(evaluate_models)
    log(f"[benchmark] {', '.join(task_names(config.eval_tasks))} on {summary['final_model']}"
        f"{' and on the base ' + config.model if base else ''} ({gpus or 'no'} GPU(s); at most {timeout / 60:.0f} min)")
    running = task.remote(config.to_dict(), summary["final_model"], summary.get("merged_model"), base=base,
                          files=task_files(config))
    try:
        return ray.get(running, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(running, force=True)
        raise TimeoutError(f"the benchmark took more than {timeout / 60:.0f} min and was cancelled; bound it with "
                           "--eval-limit") from None


def evaluate_models(config_dict: dict, final_uri: str, merged_uri: str | None, *, base: bool,
                    files: dict[str, bytes]) -> dict:
    """In a Ray task with the job's GPUs: the harness on the exported model (and on the base)."""
    from ..config import TrainConfig
    from ..storage.files import download
    from ..storage.sources import resolve_model

    config = TrainConfig.from_dict(config_dict)
    base_dir = resolve_model(config.model)
    with tempfile.TemporaryDirectory() as local:
        include = place_task_files(files, tasks_path(config), f"{local}/tasks") if files else None
        model_dir = str(download(merged_uri or final_uri, Path(local) / "model"))
        adapter = not merged_uri and os.path.isfile(os.path.join(model_dir, "adapter_config.json"))
        # A Hub base at the commit the run trained on (training/storage/sources.py ``pinned_revision``).
        pinned = {"revision": config.model_revision} if config.model_revision and base_dir == config.model else {}
        model_args = {"pretrained": base_dir, "peft": model_dir, **pinned} if adapter else {"pretrained": model_dir}
        done = {"model": harness(config, model_args, include)}
        done["base"] = harness(config, {"pretrained": base_dir, **pinned}, include) if base else None
    return done


def harness(config, model_args: dict, include_path: str | None) -> dict:
    """``lm_eval.simple_evaluate`` with the ``hf`` model on this process's GPUs (all of them, one
    model spread across them) or its CPU; the results without the per-example records."""
    import lm_eval
    import torch
    from lm_eval.utils import handle_non_serializable
    from transformers import AutoTokenizer

    gpus = torch.cuda.device_count() if config.use_gpu else 0
    args = {**model_args, "dtype": "bfloat16" if gpus else "float32", "device": "cuda" if gpus else "cpu",
            **({"parallelize": True} if gpus > 1 else {})}
    chat = bool(AutoTokenizer.from_pretrained(model_args["pretrained"], **({"revision": model_args["revision"]}
                                                                            if model_args.get("revision") else {})).chat_template)
    names = task_names(config.eval_tasks)
    manager = task_manager(names, include_path)
    results = lm_eval.simple_evaluate(model="hf", model_args=args, tasks=names, task_manager=manager,
                                      limit=config.eval_limit, batch_size=BATCH_SIZE, apply_chat_template=chat,
                                      bootstrap_iters=0, log_samples=False)
    slim = {key: value for key, value in (results or {}).items() if key not in ("samples", "pretty_env_info")}
    slim["chat_template"] = chat
    return json.loads(json.dumps(slim, default=handle_non_serializable))

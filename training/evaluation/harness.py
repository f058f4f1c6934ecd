"""Benchmark scores of the exported model (``--eval-tasks``): EleutherAI's lm-evaluation-harness
(``lm-eval``, pinned: :data:`~.options.HARNESS_PACKAGES`) after training, on the job's own GPUs,
against the base model's scores on the same tasks (computed once per model, task, harness version
and exported tokenizer and generation config, kept under the storage path).

- Before Ray starts (:func:`check_tasks`, on the driver): every name must be a task the harness
  knows (its own, or a YAML in ``--eval-tasks-path``), and every task must load its data (the
  harness reads each data set when it builds the task: a Hub data set with no network, a local
  file that is not there, a task whose extra packages are missing fail here, in seconds).
- After training (:func:`run_benchmarks`, on the driver): Ray tasks on a node's GPUs (one GPU each,
  the tasks dealt out among them, where the model fits a GPU; else one task with the node's GPUs and the
  model spread across them, the harness's ``parallelize``: training/evaluation/scoring.py ``placement``)
  download ``final/``, evaluate it (a LoRA adapter merged onto its base: :func:`merged_adapter`) and the
  base, both under the exported tokenizer, chat template and generation config (scoring.py
  ``scoring_base``), the base's scores read where they are kept already (one file per base, task and
  how it is scored: the harness's version where it runs and the exported files' digest), and return
  them. The driver writes ``eval_results.json`` beside the model and returns what the summary shows;
  whatever fails, the run's outputs stand and the summary says what failed.

lm-eval's API as read in 0.4.13 (``lm_eval/evaluator.py`` ``simple_evaluate``, ``lm_eval/tasks/__init__.py``
``TaskManager``, ``lm_eval/models/huggingface.py`` ``HFLM``): metrics are ``results[task]["<metric>,<filter>"]``;
``config.model_dtype`` is a ``torch.dtype`` (``lm_eval.utils.handle_non_serializable`` writes it);
``limit`` below 1.0 is a fraction of the examples, so it is passed as an int or None."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .options import task_names

#: Beside the exported model: the scores of the model and the base, and how they were computed.
RESULTS_FILE = "eval_results.json"
#: Under the storage path: the base models' scores, one file per model, task and how it is scored (``settings_of``).
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
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401 - the hf model's imports (accelerate) too
    except ImportError as error:
        raise TaskProblem(f"eval_tasks={config.eval_tasks!r} needs lm-evaluation-harness ({error}); pip install "
                          "lm-eval==0.4.13 (the Ray job installs it where --eval-tasks is given)") from None
    manager = task_manager(names, tasks_path(config))
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise TaskProblem(f"eval_tasks: {', '.join(map(repr, unknown))} is not a task lm-evaluation-harness "
                          f"{lm_eval.__version__} knows (e.g. gsm8k, ifeval, mmlu, hellaswag, arc_easy); for a task of your "
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


def settings_of(config, *, task: str, scoring: str) -> dict:
    """How a task's scores are computed, in the process that computes them (it has the harness): what a
    base's kept scores must match to be reused."""
    import lm_eval

    digest = None
    if config.eval_tasks_path:
        files = sorted(Path(os.path.expanduser(config.eval_tasks_path)).rglob("*.y*ml"))
        digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()[:16]
    return {"task": task, "limit": config.eval_limit, "lm_eval": lm_eval.__version__, "tasks_path_digest": digest,
            "batch_size": BATCH_SIZE, "scoring": scoring}


def base_scores_uri(config, settings: dict) -> str:
    """Where the base model's scores of one task under ``settings`` are kept."""
    pinned = {"revision": config.model_revision} if getattr(config, "model_revision", None) else {}  # the base's commit
    key = hashlib.sha256(json.dumps({"model": config.model, **pinned, **settings}, sort_keys=True).encode()).hexdigest()[:20]
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
    base, ``eval_results.json`` written beside the model; what the summary shows (``error`` where
    something failed: the run's outputs stand)."""
    names = task_names(config.eval_tasks)
    if not names or not summary.get("final_model"):
        return None
    from ..storage.files import write_text
    from .scoring import merged_results

    started = time.monotonic()
    try:
        done = _evaluate_in_ray(config, summary, log=log)
        model, base = merged_results([part["model"] for part in done]), merged_results([part["base"] for part in done])
        settings = {"tasks": names, **{k: v for k, v in done[0]["settings"].items() if k != "task"}}
        results_uri = f"{summary['final_model'].rstrip('/')}/{RESULTS_FILE}"
        write_text(results_uri, json.dumps({"settings": settings, "model": model, "base": {"model": config.model, "results": base}},
                                           indent=1))
    except Exception as error:  # noqa: BLE001 - a benchmark never fails the run it measures
        line = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:400] if str(error).strip() else ''}"
        log(f"[benchmark] failed, the run's outputs stand: {line}")
        return {"error": line}
    scores, base_scores = scores_of(model), scores_of(base)
    shown = {"results": results_uri, "scores": scores, "base": base_scores, "difference": difference(scores, base_scores),
             "base_scores": sorted({part["base_scores"] for part in done}), "seconds": round(time.monotonic() - started, 1)}
    for task, metrics in scores.items():
        log(f"[benchmark] {task}: " + ", ".join(
            f"{name} {value:.4f} (base {base_scores.get(task, {}).get(name, float('nan')):.4f})" for name, value in metrics.items()))
    return shown


def _evaluate_in_ray(config, summary: dict, *, log) -> list[dict]:
    """:func:`evaluate_group` in Ray tasks laid out on a node's GPUs (scoring.py ``placement``), in the
    harness's environment, waited for at most :data:`TIMEOUT_S` (then cancelled: a benchmark never holds
    the cluster for ever). One result per task name."""
    import ray

    from .scoring import placement, task_groups

    shape = model_shape(config)
    gpus, parallelize = placement(config, shape and shape.parameters, shape and shape.vocab, batch_size=BATCH_SIZE)
    groups = task_groups(task_names(config.eval_tasks), gpus, config.workers_per_node)
    timeout = float(os.environ.get("RAY_TRAIN_EKS_BENCHMARK_TIMEOUT_S") or TIMEOUT_S)
    task = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=0, runtime_env=harness_runtime_env())(evaluate_group)
    log(f"[benchmark] {', '.join(task_names(config.eval_tasks))} on {summary['final_model']} and on the base {config.model}, "
        f"{len(groups)} Ray task(s) of {gpus or 'no'} GPU(s){' (the model spread across them)' if parallelize else ''}; "
        f"at most {timeout / 60:.0f} min")
    running = [task.remote(config.to_dict(), group, summary["final_model"], summary.get("merged_model"),
                           files=task_files(config), parallelize=parallelize) for group in groups]
    try:
        return [found for part in ray.get(running, timeout=timeout) for found in part]
    except ray.exceptions.GetTimeoutError:
        for each in running:
            ray.cancel(each, force=True)
        raise TimeoutError(f"the benchmark took more than {timeout / 60:.0f} min and was cancelled; bound it with "
                           "--eval-limit") from None


def model_shape(config):
    """The base's shape (parameter count, vocabulary) from its config.json (None where it cannot be read)."""
    from ..modeling.shapes import ModelShape
    from ..storage.sources import read_model_config, resolve_tokenizer

    try:
        return ModelShape.from_config(read_model_config(resolve_tokenizer(config.model), config.model_revision),
                                      name=config.model)
    except Exception:  # noqa: BLE001 - unknown: the node's GPUs, as for a large model
        return None


def evaluate_group(config_dict: dict, names: list[str], final_uri: str, merged_uri: str | None, *,
                   files: dict[str, bytes], parallelize: bool) -> list[dict]:
    """In a Ray task with its GPUs: for each task of ``names``, the harness on the exported model and on
    the base (its kept scores where they are), both under the exported tokenizer and generation config."""
    from ..config import TrainConfig
    from ..storage.files import download, read_text, write_text
    from .scoring import scoring_digest

    config = TrainConfig.from_dict(config_dict)
    found = []
    with tempfile.TemporaryDirectory() as local:
        include = place_task_files(files, tasks_path(config), f"{local}/tasks") if files else None
        exported = str(download(merged_uri or final_uri, Path(local) / "model"))
        tuned, base = model_arguments(config, exported, local)
        for name in names:
            settings = settings_of(config, task=name, scoring=scoring_digest(exported))
            kept_uri = base_scores_uri(config, settings)
            kept = json.loads(read_text(kept_uri) or "null")
            if kept is None:
                kept = {"model": config.model, "settings": settings,
                        "results": harness(config, base, include, [name], parallelize=parallelize)}
                write_text(kept_uri, json.dumps(kept, indent=1))
            found.append({"model": harness(config, tuned, include, [name], parallelize=parallelize),
                          "base": kept["results"], "settings": settings, "base_scores": kept_uri})
    return found


def model_arguments(config, exported: str, local: str) -> tuple[dict, dict]:
    """The harness's ``model_args`` of the tuned model (the exported folder, or a LoRA adapter merged
    onto the base: :func:`merged_adapter`) and of the base, both under the exported tokenizer and
    generation config (scoring.py ``scoring_base``, built in ``local``)."""
    from ..storage.sources import resolve_model
    from .scoring import local_base, scoring_base

    base = scoring_base(local_base(resolve_model(config.model), config.model_revision), exported, f"{local}/base")
    if os.path.isfile(os.path.join(exported, "adapter_config.json")):
        return {"pretrained": merged_adapter(config, base, exported, f"{local}/merged")}, {"pretrained": base}
    return {"pretrained": exported}, {"pretrained": base}


def merged_adapter(config, base: str, adapter: str, local: str) -> str:
    """The adapter merged onto the base (PEFT's ``merge_and_unload``, in the dtype the harness scores in)
    and saved in ``local`` with the exported tokenizer and generation config. Not lm-eval's ``peft``
    argument: lm-eval 0.4.13 shrinks the base's embeddings to the tokenizer's length before it puts an
    adapter on (``lm_eval/models/huggingface.py`` ``_create_model``: "resize model for LoRAs with added
    tokens"), so a base whose vocabulary is padded past its tokenizer's (Qwen2.5: 151,936 rows, 151,665
    tokens) would score with other log-probabilities than its merged model and the base
    (EleutherAI/lm-evaluation-harness#2748)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .scoring import SCORING_FILES

    dtype = torch.bfloat16 if config.use_gpu and torch.cuda.is_available() else torch.float32
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), adapter).merge_and_unload()
    model.save_pretrained(local, safe_serialization=True)
    for name in SCORING_FILES:  # the exported tokenizer, chat template and stop rules, as the base's folder has them
        if os.path.isfile(os.path.join(base, name)):
            shutil.copyfile(os.path.join(base, name), os.path.join(local, name))
    return local


def harness(config, model_args: dict, include_path: str | None, names: list[str], *, parallelize: bool = False) -> dict:
    """``lm_eval.simple_evaluate`` with the ``hf`` model on this process's GPUs (one, or several with the
    model spread across them: ``parallelize``) or its CPU; the results without the per-example records."""
    import lm_eval
    import torch
    from lm_eval.utils import handle_non_serializable
    from transformers import AutoTokenizer

    gpus = torch.cuda.device_count() if config.use_gpu else 0
    args = {**model_args, "dtype": "bfloat16" if gpus else "float32", "device": "cuda" if gpus else "cpu",
            **({"parallelize": True} if parallelize and gpus > 1 else {})}
    chat = bool(AutoTokenizer.from_pretrained(model_args["pretrained"]).chat_template)
    results = lm_eval.simple_evaluate(model="hf", model_args=args, tasks=names, task_manager=task_manager(names, include_path),
                                      limit=config.eval_limit, batch_size=BATCH_SIZE, apply_chat_template=chat,
                                      bootstrap_iters=0, log_samples=False)
    slim = {key: value for key, value in (results or {}).items() if key not in ("samples", "pretty_env_info")}
    slim["chat_template"] = chat
    return json.loads(json.dumps(slim, default=handle_non_serializable))

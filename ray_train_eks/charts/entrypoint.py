"""What the job runs: its command line, and what synth reads from it with the training package's
own code (its configuration, its model's shape and memory plan), the one place that imports it."""

from __future__ import annotations

import shlex

from ray_train_eks.charts.spec import RayWorkloadSpec
from ray_train_eks.instances import INSTANCE_TYPES


def entrypoint_args(spec: RayWorkloadSpec) -> tuple[str, ...]:
    """The job's command as arguments: ``spec.entrypoint``, or our training module with the
    preset, the worker counts and ``training_args``. The storage path comes from the pods'
    ``RAY_TRAIN_EKS_STORAGE_PATH`` (s3://<bucket>/runs)."""
    if spec.entrypoint is not None:
        return tuple(spec.entrypoint)
    return (
        "python", "-m", "training.train",
        "--preset", spec.training_preset,
        "--num-workers", str(spec.worker_gpus * spec.gpu_node_count),
        "--workers-per-node", str(spec.worker_gpus),
        *(["--gpu-type", INSTANCE_TYPES[spec.gpu_instance_type].gpu_model]
          if spec.gpu_instance_type in INSTANCE_TYPES and INSTANCE_TYPES[spec.gpu_instance_type].gpu_model else []),
        *(["--expect-efa"] if spec.worker_efa and spec.gpu_node_count > 1 else []),
        *spec.training_args,
    )


def training_entrypoint(spec: RayWorkloadSpec) -> str:
    """The entrypoint string. KubeRay's K8sJobMode submitter runs it inside ``bash -c``
    unquoted (ray-operator/controllers/ray/common/job.go), so every argument is quoted:
    ``$``, quotes or ``;`` in an argument reach the program, not the submitter's shell."""
    return shlex.join(entrypoint_args(spec))


def entrypoint_problems(spec: RayWorkloadSpec) -> list[str]:
    """A custom entrypoint must be a command."""
    if spec.entrypoint is not None and not spec.entrypoint:
        return ["entrypoint=(): give the command as a tuple of arguments, e.g. ('python', '-m', 'my_trainer.main'), or None"]
    return []


def training_modules():
    """The training package's ``config`` and ``plan`` modules (training/config.py and
    training/modeling/plan.py, the code the job runs, as the wheel ships it): the only imports of the
    training code, made late so that what never plans never imports it."""
    import ray_train_eks.training_code.config as config
    import ray_train_eks.training_code.modeling.plan as plan

    return config, plan


def job_config(spec: RayWorkloadSpec):
    """The job's training configuration, read at synth from its own command line
    (training/config.py, the code the job runs), or None: a custom entrypoint, or options
    trainingArgs gets wrong (their own problem, told elsewhere)."""
    if spec.entrypoint is not None:
        return None
    config_module, _ = training_modules()
    try:
        return config_module.parse_config(list(entrypoint_args(spec)[3:]), storage_path="s3://synth/runs", validate=False)
    except (config_module.ConfigError, ValueError, SystemExit):
        return None


def planned_training(spec: RayWorkloadSpec):
    """The job's training configuration (:func:`job_config`) and its model's shape
    (training/modeling/plan.py), or None when synth cannot know them: no configuration, or a
    model neither in the plan's table nor a local folder."""
    config = job_config(spec)
    if config is None:
        return None
    _, plan = training_modules()
    try:
        return config, plan.model_shape(config.model)
    except ValueError:
        return None


def memory_plan_notice(spec: RayWorkloadSpec) -> str | None:
    """Why synth cannot plan the job's memory, when that is because of its model (neither in the
    plan's table nor a local folder): a warning at synth, never silence; None otherwise."""
    config = job_config(spec) if spec.run_job else None
    if config is None:
        return None
    _, plan = training_modules()
    try:
        plan.model_shape(config.model)
    except ValueError:
        gpu = f" --gpu-type {config.gpu_type}" if config.gpu_type else ""
        return (f"model {config.model!r} is not in the memory plan's table and not a local folder, so synth cannot tell "
                f"whether it fits {spec.gpu_node_count} x {spec.gpu_instance_type}: the job plans it at its start, from "
                f"its config.json, before Ray starts, and stops there if it does not fit (after the GPU nodes started). "
                f"Plan it now where the model's config can be read: python -m training.modeling.plan "
                f"{' '.join(entrypoint_args(spec)[3:])}{'' if '--gpu-type' in entrypoint_args(spec) else gpu}")
    return None


def planned_options(config, shape):
    """The options the job's plan takes (training/train.py ``plan_memory`` does the same before Ray
    starts, training/modeling/plan.py ``job_options``); with what was chosen (or None)."""
    _, plan = training_modules()
    options, chosen = plan.job_options(shape, config.gpu_type, config)
    return options, "; ".join(chosen) or None


def memory_plan_choice(spec: RayWorkloadSpec) -> str | None:
    """What the job's memory plan chooses where its options left it open (activation checkpointing,
    the micro-batch), with the headroom: shown at synth. None: nothing chosen, or no plan."""
    planned = planned_training(spec) if spec.run_job and spec.gpu_instance_type in INSTANCE_TYPES else None
    if planned is None or not planned[0].use_gpu or not planned[0].gpu_type:
        return None
    try:
        return planned_options(*planned)[1]
    except ValueError:  # options the model cannot take: memory_plan_problem says so
        return None


def memory_plan_problem(spec: RayWorkloadSpec) -> str | None:
    """The training's memory plan (training/modeling/plan.py, the same code the job runs before Ray
    starts), made at synth from the job's own command line: why the model cannot fit the GPUs,
    with what would, or None (it fits, or synth cannot know: a custom entrypoint, a model
    neither in the plan's table nor a local folder, which the job then plans at its start)."""
    planned = planned_training(spec) if spec.gpu_instance_type in INSTANCE_TYPES else None
    if planned is None:  # unknown models plan at the job's start
        return None
    _, plan = training_modules()
    config, shape = planned
    if not config.use_gpu or not config.gpu_type:
        return None
    try:
        options, _ = planned_options(config, shape)
    except ValueError as error:  # LoRA targets this model does not have
        return f"trainingArgs={' '.join(spec.training_args)!r}: {error}"
    try:
        plan.check(shape, config.gpu_type, options)
    except plan.DoesNotFit as error:
        return (f"trainingArgs={' '.join(spec.training_args)!r} on {spec.gpu_node_count} x {spec.gpu_instance_type}: {error} "
                f"(python -m training.modeling.plan {' '.join(entrypoint_args(spec)[3:])} prints the whole plan)")
    return None

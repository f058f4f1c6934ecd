"""Whether the job's training fits its GPUs, worked out at synth by the training package's own
memory plan (training/modeling/plan.py, the code the job runs before Ray starts) from the job's
resolved options and model (job.py): the problem when it does not fit, what the plan chose where
the options left it open, and the notice when synth cannot know the model."""

from __future__ import annotations

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.workload.entrypoint import training_modules
from ray_train_eks.workload.job import ResolvedJob, resolved
from ray_train_eks.workload.spec import RayWorkloadSpec


def _options_text(job: ResolvedJob) -> str:
    """The job's training options as a command line (what ``python -m training.modeling.plan`` takes)."""
    return " ".join(job.args[3:])


def memory_plan_notice(job: ResolvedJob | RayWorkloadSpec) -> str | None:
    """Why synth cannot plan the job's memory, when that is because of its model (neither in the
    plan's table nor a local folder): a warning at synth, never silence; None otherwise."""
    job = resolved(job)
    spec, training = job.spec, job.training
    if not spec.run_job or training is None or job.shape is not None:
        return None
    gpu = f" --gpu-type {training.gpu_type}" if training.gpu_type and "--gpu-type" not in job.args else ""
    return (f"model {training.model!r} is not in the memory plan's table and not a local folder, so synth cannot tell "
            f"whether it fits {spec.gpu_node_count} x {spec.gpu_instance_type}: the job plans it at its start, from "
            f"its config.json, before Ray starts, and stops there if it does not fit (after the GPU nodes started). "
            f"Plan it now where the model's config can be read: python -m training.modeling.plan "
            f"{_options_text(job)}{gpu}")


def _planned(job: ResolvedJob) -> bool:
    """Whether synth plans the job: known options and model, on GPUs of the table."""
    return (job.training is not None and job.shape is not None and job.spec.gpu_instance_type in INSTANCE_TYPES
            and job.training.use_gpu and bool(job.training.gpu_type))


def planned_options(job: ResolvedJob):
    """The options the job's plan takes (training/train.py ``plan_memory`` does the same before Ray
    starts, training/modeling/plan.py ``job_options``); with what was chosen (or None)."""
    _, plan = training_modules()
    options, chosen = plan.job_options(job.shape, job.training.gpu_type, job.training)
    return options, "; ".join(chosen) or None


def memory_plan_choice(job: ResolvedJob | RayWorkloadSpec) -> str | None:
    """What the job's memory plan chooses where its options left it open (activation checkpointing,
    the micro-batch), with the headroom: shown at synth. None: nothing chosen, or no plan."""
    job = resolved(job)
    if not job.spec.run_job or not _planned(job):
        return None
    try:
        return planned_options(job)[1]
    except ValueError:  # options the model cannot take: memory_plan_problem says so
        return None


def memory_plan_problem(job: ResolvedJob | RayWorkloadSpec) -> str | None:
    """The training's memory plan, made at synth from the job's own command line: why the model
    cannot fit the GPUs, with what would, or None (it fits, or synth cannot know: a custom
    entrypoint, a model neither in the plan's table nor a local folder, which the job then plans at
    its start)."""
    job = resolved(job)
    if not _planned(job):
        return None
    _, plan = training_modules()
    spec = job.spec
    try:
        options, _ = planned_options(job)
    except ValueError as error:  # LoRA targets this model does not have
        return f"trainingArgs={' '.join(spec.training_args)!r}: {error}"
    try:  # an elastic job's (--min-nodes) at its smallest size too
        plan.check_sizes(job.shape, job.training.gpu_type, options, job.training.worker_counts)
    except plan.DoesNotFit as error:
        return (f"trainingArgs={' '.join(spec.training_args)!r} on {spec.gpu_node_count} x {spec.gpu_instance_type}: {error} "
                f"(python -m training.modeling.plan {_options_text(job)} prints the whole plan)")
    return None

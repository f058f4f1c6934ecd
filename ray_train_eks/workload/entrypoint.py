"""What the job runs: its command line, the training options and model synth reads from it with
the training package's own code (its configuration, its model's shape: the one place that imports
it), and the job's runtime environment. Each is worked out once per job (job.py ``resolve_job``)."""

from __future__ import annotations

import shlex

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.workload.code import CODE_MOUNT
from ray_train_eks.workload.spec import RayWorkloadSpec

#: Seconds Ray's job supervisor waits after the SIGTERM of ``ray job stop`` before its SIGKILL (Ray's default:
#: 3, ``RAY_JOB_STOP_WAIT_TIME_S``, ray/dashboard/modules/job/job_supervisor.py; the supervisor reads the job's
#: runtime-env variables): a tracked run's driver ends its MLflow run KILLED in that time.
JOB_STOP_WAIT_S = 30


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


def shell_command(args: tuple[str, ...]) -> str:
    """The entrypoint string of ``args``. KubeRay's K8sJobMode submitter runs it inside ``bash -c``
    unquoted (ray-operator/controllers/ray/common/job.go), so every argument is quoted:
    ``$``, quotes or ``;`` in an argument reach the program, not the submitter's shell."""
    return shlex.join(args)


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


def training_options(spec: RayWorkloadSpec, args: tuple[str, ...]):
    """The job's training configuration, read at synth from its command line ``args``
    (training/config.py, the code the job runs), or None: a custom entrypoint, no command (GPU
    workers synth cannot size), or options trainingArgs gets wrong (their own problem, told elsewhere)."""
    if spec.entrypoint is not None or not args:
        return None
    config_module, _ = training_modules()
    try:
        return config_module.parse_config(list(args[3:]), storage_path="s3://synth/runs", validate=False)
    except (config_module.ConfigError, ValueError, SystemExit):
        return None


def model_shape(training):
    """The shape of ``training``'s model (training/modeling/plan.py), or None when synth cannot know
    it: no training configuration, or a model neither in the plan's table nor a local folder."""
    if training is None:
        return None
    _, plan = training_modules()
    try:
        return plan.model_shape(training.model)
    except ValueError:
        return None


def runtime_env(spec: RayWorkloadSpec, training) -> str:
    """The job's runtime environment (YAML). The code is in the image's pods already (ConfigMap
    volume); the runtime env puts it on the path of the driver and of every Ray worker.
    No ``pip`` for an untracked full fine-tune: the image has what training needs (Hub data sets load
    without ``datasets``). A LoRA job (``training.peft == "lora"``) needs PEFT, and a tracked one
    (``spec.tracking``) MLflow's client, which the Ray Train image does not carry: Ray installs the
    pinned packages (training/config.py ``LORA_PACKAGES``, ``TRACKING_PACKAGES``) into the job's
    environment on every node, over the image's packages (Ray's ``pip`` runtime env; its torch and
    transformers already satisfy them, so nothing of the image is replaced). A benchmark (``--eval-tasks``)
    installs lm-evaluation-harness for its own tasks only (training/evaluation/harness.py).
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: PyTorch's allocator grows segments
    instead of caching fixed blocks, so a step's varying shapes fragment less (torchtitan runs
    with it); read once, when a process first uses CUDA, so it is set before any worker starts."""
    text = (f"env_vars:\n  PYTHONPATH: {CODE_MOUNT}\n  TOKENIZERS_PARALLELISM: \"false\"\n"
            "  PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True\n")
    if spec.tracking:  # ray job stop: time for the driver to end its MLflow run KILLED
        text += f"  RAY_JOB_STOP_WAIT_TIME_S: \"{JOB_STOP_WAIT_S}\"\n"
    packages = []
    if training is not None and training.peft == "lora":
        packages += training_modules()[0].LORA_PACKAGES
    if spec.tracking:
        packages += training_modules()[0].TRACKING_PACKAGES
    if packages:
        text += "pip:\n  packages:\n" + "".join(f"  - {package}\n" for package in packages)
        text += "  pip_check: false\n"
    return text


def job_command(spec: RayWorkloadSpec, sized: bool):
    """The job's command as arguments (none where synth cannot size its GPU workers, ``sized``
    false, and it is not a custom one) and as the submitter's string, its training options, its
    model's shape and its runtime env: what the job runs, worked out together."""
    args = entrypoint_args(spec) if sized or spec.entrypoint is not None else ()
    training = training_options(spec, args)
    return args, shell_command(args), training, model_shape(training), runtime_env(spec, training)

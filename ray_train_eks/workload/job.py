"""The job resolved once: what the Ray objects are built from that the spec leaves to be worked
out. :func:`resolve_job` parses the job's training options once, finds its model's shape, sizes its
pods and their disk, writes their environments, its runtime env and its preStop command, and
decides what KubeRay deletes when it ends; every builder (pods.py, stopped_jobs.py, objects.py,
memory_plan.py, the job command's submit) takes the :class:`ResolvedJob` and reads fields, deciding
nothing again. (aws-cdk's aws-eks-v2 resolves its defaults once into named values in the
constructor and hands those on; torchtitan builds one JobConfig and passes it down.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.workload.code import code_volume
from ray_train_eks.workload.deletion import end_of_job, frees_stopped_jobs
from ray_train_eks.workload.drain_hook import drain_hook_command
from ray_train_eks.workload.entrypoint import job_command
from ray_train_eks.workload.environment import pod_env
from ray_train_eks.workload.sizing import disk_gib, head_sizing, worker_sizing
from ray_train_eks.workload.spec import RayWorkloadSpec

@dataclass(frozen=True, kw_only=True)
class ResolvedJob:
    """A :class:`RayWorkloadSpec` with everything derived from it worked out (:func:`resolve_job`).
    A value is None where synth cannot know it; the spec's rules (objects.py ``workload_problems``)
    say why, and no object is built from a spec with problems."""

    spec: RayWorkloadSpec
    #: The job's command as arguments, and as the string KubeRay's submitter runs (each argument quoted).
    args: tuple[str, ...]
    entrypoint: str
    #: The training options parsed from ``args`` (training/config.py), None for a custom entrypoint
    #: or options that do not parse; the model's shape (training/modeling/plan.py), None where the
    #: model is neither in the plan's table nor a local folder.
    training: Any
    shape: Any
    #: GPUs and EFA interfaces of each GPU worker pod (the whole node's by default).
    worker_gpus: int | None
    worker_efa: int | None
    #: (CPU, GiB) of the head and of each GPU worker.
    head_size: tuple[int, int] | None
    worker_size: tuple[int, int] | None
    #: The ephemeral storage each GPU worker requests (staged checkpoints, the model), in GiB.
    worker_disk_gib: int | None
    #: The containers' environments, the GPU workers' preStop command and the job's runtime env.
    head_env: list[dict]
    worker_env: list[dict]
    drain_command: list[str]
    runtime_env_yaml: str
    #: The pods' volume of the training code (code.py ``code_volume``).
    code_volume: Mapping[str, Any]
    #: What KubeRay deletes when the job ends, and when (deletion.py ``end_of_job``).
    end_of_job: Mapping[str, Any]
    #: Whether a watch beside the head deletes the job once it is stopped with ``ray job stop``
    #: (stopped_jobs.py): a job workload whose cluster ends by deletion rules, with a grace set.
    frees_stopped_jobs: bool


def resolve_job(spec: RayWorkloadSpec) -> ResolvedJob:
    """Work out, once, everything the Ray objects of ``spec`` are built from."""
    # The GPU workers can be sized from the instance table, or from sizes the spec gives.
    sized = spec.gpu_instance_type in INSTANCE_TYPES or (spec.gpus_per_worker is not None and spec.efa_per_worker is not None)
    args, entrypoint, training, shape, runtime = job_command(spec, sized)
    drain_command = drain_hook_command(spec)
    worker_gpus = spec.worker_gpus if sized else None
    head, worker = pod_env(spec, gpus=worker_gpus or 0, drain_command=drain_command)
    ending = end_of_job(spec)
    frees = frees_stopped_jobs(spec, ending)
    return ResolvedJob(
        spec=spec, args=args, entrypoint=entrypoint, training=training, shape=shape,
        worker_gpus=worker_gpus, worker_efa=spec.worker_efa if sized else None,
        head_size=head_sizing(spec) if spec.head_resources or spec.system_instance_type in INSTANCE_TYPES else None,
        worker_size=worker_sizing(spec) if spec.worker_resources or spec.gpu_instance_type in INSTANCE_TYPES else None,
        worker_disk_gib=disk_gib(spec, training, shape),
        head_env=head, worker_env=worker, drain_command=drain_command, runtime_env_yaml=runtime,
        code_volume=code_volume(spec.training_code, spec.code_config_map),
        end_of_job=ending, frees_stopped_jobs=frees,
    )


def resolved(job: ResolvedJob | RayWorkloadSpec) -> ResolvedJob:
    """``job`` itself, or the spec resolved (:func:`resolve_job`): the public builders take either."""
    return job if isinstance(job, ResolvedJob) else resolve_job(job)


def training_entrypoint(job: ResolvedJob | RayWorkloadSpec) -> str:
    """The entrypoint string KubeRay's submitter runs (:attr:`ResolvedJob.entrypoint`)."""
    return resolved(job).entrypoint


def runtime_env_yaml(job: ResolvedJob | RayWorkloadSpec) -> str:
    """The job's runtime environment (:attr:`ResolvedJob.runtime_env_yaml`)."""
    return resolved(job).runtime_env_yaml


def worker_disk_gib(job: ResolvedJob | RayWorkloadSpec) -> int | None:
    """The ephemeral storage a GPU worker requests, in GiB (:attr:`ResolvedJob.worker_disk_gib`)."""
    return resolved(job).worker_disk_gib

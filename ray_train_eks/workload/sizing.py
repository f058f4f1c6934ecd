"""How big the Ray pods are: the head's and each GPU worker's CPU and memory, and the disk a GPU
worker keeps on its node (staged checkpoints, the model), with the rule that it fits the node's
instance store. Worked out once per job (job.py ``resolve_job``)."""

from __future__ import annotations

import math

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.workload.spec import RayWorkloadSpec

#: What else a GPU worker keeps on its node's disk besides staged checkpoints: the model's
#: download and the data set in /cache, Ray's logs and spilled objects.
SCRATCH_MARGIN_GIB = 10


def head_sizing(spec: RayWorkloadSpec) -> tuple[int, int]:
    """CPU and GiB of the head: ``head_resources``, else half the system node (the rest for
    the operator and add-ons)."""
    if spec.head_resources is not None:
        return spec.head_resources
    system = INSTANCE_TYPES[spec.system_instance_type]
    return max(1, system.vcpus // 2), max(2, system.memory_gib // 2)


def worker_sizing(spec: RayWorkloadSpec) -> tuple[int, int]:
    """CPU and GiB of a GPU worker: ``worker_resources``, else the whole node less room for
    kubelet and the DaemonSets (VPC CNI, kube-proxy, device plugins, pod identity agent)."""
    if spec.worker_resources is not None:
        return spec.worker_resources
    gpu = INSTANCE_TYPES[spec.gpu_instance_type]
    return gpu.vcpus - 2, int(gpu.memory_gib * 0.85)


def disk_gib(spec: RayWorkloadSpec, training, shape) -> int | None:
    """The ephemeral storage a GPU worker pod requests (its emptyDirs, /scratch and /cache, are
    on the node's disk): two staged checkpoints of its node's share (one being written while the
    previous one uploads: training/storage/checkpoint.py; fp32 weights and AdamW's two moments, 12 bytes a
    parameter, a node's share of one copy), the model's bf16 weights, and a margin. Under LoRA
    (``--peft lora``) a checkpoint holds the adapters alone, and with ``--merge-lora`` the merged
    model (bf16) is staged there too before its upload. None when synth cannot know the model
    (``training`` or ``shape`` None: a custom entrypoint, a model out of the plan's table)."""
    if training is None or shape is None:
        return None
    parameters = trained = shape.parameters
    lora = getattr(training, "peft", "none") == "lora"
    if lora:
        try:
            trained = shape.layers * sum(math.prod(s) for s in shape.adapter_shapes(training.lora_rank,
                                                                                      training.lora_target_modules))
        except ValueError:  # targets the model lacks: memory_plan_problem says so
            pass
    checkpoint_share = trained * 12 / max(1, spec.gpu_node_count)
    models = 2 if lora and training.merge_lora else 1
    return math.ceil((2 * checkpoint_share + models * parameters * 2) / 2**30) + SCRATCH_MARGIN_GIB


def disk_problem(spec: RayWorkloadSpec, needed: int | None) -> str | None:
    """Why the GPU nodes' instance store cannot hold the ``needed`` GiB a worker keeps on it, or None."""
    gpu = INSTANCE_TYPES.get(spec.gpu_instance_type)
    if needed is None or gpu is None or not gpu.instance_store_gb:
        return None
    if needed * 2**30 > gpu.instance_store_gb * 1e9:
        return (f"trainingArgs={' '.join(spec.training_args)!r}: each GPU worker stages {needed} GiB of checkpoints and "
                f"model on its node's disk, more than {spec.gpu_instance_type}'s {gpu.instance_store_gb} GB of NVMe; use "
                "more nodes (-c gpuNodeCount) or a type with more instance storage")
    return None


def pod_problems(spec: RayWorkloadSpec) -> list[str]:
    """The pods must be sizeable (an instance type of the table, or explicit sizes) and ask no more
    GPUs and EFA interfaces than their node has."""
    problems: list[str] = []
    if spec.gpu_node_count < 1:
        problems.append(f"gpuNodeCount={spec.gpu_node_count}: at least 1 GPU node is needed; e.g. -c gpuNodeCount=2")
    if spec.head_resources is None and spec.system_instance_type not in INSTANCE_TYPES:
        problems.append(
            f"system_instance_type={spec.system_instance_type!r} is not in ray_train_eks.instances.INSTANCE_TYPES, so the Ray "
            "head cannot be sized from it; pass head_resources=(cpu, memory_gib)"
        )
    if spec.gpu_instance_type not in INSTANCE_TYPES and (
        spec.worker_resources is None or spec.gpus_per_worker is None or spec.efa_per_worker is None
    ):
        problems.append(
            f"gpu_instance_type={spec.gpu_instance_type!r} is not in ray_train_eks.instances.INSTANCE_TYPES; pass "
            "worker_resources=(cpu, memory_gib), gpus_per_worker and efa_per_worker"
        )
    gpu = INSTANCE_TYPES.get(spec.gpu_instance_type)
    if gpu is not None:
        if not 1 <= spec.worker_gpus <= gpu.gpus:
            problems.append(f"gpusPerWorker={spec.worker_gpus}: {spec.gpu_instance_type} has {gpu.gpus} GPUs; use 1 to {gpu.gpus}")
        if not 0 <= spec.worker_efa <= gpu.efa_interfaces:
            problems.append(
                f"efaPerWorker={spec.worker_efa}: {spec.gpu_instance_type} has {gpu.efa_interfaces} EFA interfaces; "
                f"use 0 to {gpu.efa_interfaces}"
            )
    return problems

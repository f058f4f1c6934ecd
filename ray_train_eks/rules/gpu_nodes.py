"""The rules of the EFA GPU nodes, a managed node group's or Karpenter's
(ray_train_eks/constructs/efa_node_group.py, karpenter.py)."""

from __future__ import annotations

import re

from ray_train_eks.instances import INSTANCE_TYPES, InstanceSpec, gpu_efa_instance_types
from ray_train_eks.rules.disks import GPU_ROOT_GIB_WITHOUT_INSTANCE_STORE, root_volume_problem
from ray_train_eks.validation import Prop, raise_problems

#: Above this, a typo is likelier than a real order of GPU nodes in one placement group.
MAX_GPU_NODES = 64
#: On a type without instance storage the DLC image alone unpacks to tens of GB on the root volume.
MIN_GPU_ROOT_VOLUME_GIB = 100
_CAPACITY_RESERVATION = re.compile(r"^cr-[0-9a-f]{17}$")


def efa_gpu_type_problem(instance_type: str, prop: Prop = Prop("instance_type")) -> str | None:
    """Why ``instance_type`` cannot be an EFA GPU node, or None."""
    spec = INSTANCE_TYPES.get(instance_type)
    fix = f"use an EFA-capable GPU type: {', '.join(gpu_efa_instance_types())}"
    if spec is None:
        return f"{prop(instance_type)}: unknown instance type; {fix}"
    if not spec.gpus:
        return f"{prop(instance_type)}: has no GPU; {fix}"
    if not spec.efa:
        return f"{prop(instance_type)}: does not support EFA (multi-node NCCL would fall back to TCP); {fix}"
    return None


def gpu_node_count_problem(count: int, prop: Prop = Prop("node_count")) -> str | None:
    """Why ``count`` GPU nodes in one placement group cannot be, or None."""
    if count < 1:
        return f"{prop(count)}: at least 1 GPU node is needed; e.g. {prop.example(2)}"
    if count > MAX_GPU_NODES:
        return (f"{prop(count)}: above {MAX_GPU_NODES}, the most this app places in one cluster placement group; "
                "check for a typo, or split the run")
    return None


def gpu_root_volume_problem(size_gib: int | None, prop: Prop = Prop("root_volume_gib"), *, instance_type: str) -> str | None:
    """Why a GPU node's root volume of ``size_gib`` is too small for ``instance_type``, or None."""
    return root_volume_problem(size_gib, instance_type, minimum_without_instance_store=MIN_GPU_ROOT_VOLUME_GIB,
                               default_without_instance_store=GPU_ROOT_GIB_WITHOUT_INSTANCE_STORE, prop=prop,
                               what="the Ray Train DLC image and the model cache")


def capacity_reservation_problem(reservation_id: str | None, prop: Prop = Prop("capacity_reservation_id")) -> str | None:
    """Why ``reservation_id`` is not a capacity reservation id, or None."""
    if reservation_id is not None and not _CAPACITY_RESERVATION.match(reservation_id):
        return f"{prop(reservation_id)}: not a capacity reservation id; use the form cr-0123456789abcdef0 (17 hex digits)"
    return None


def capacity_type_problem(capacity_type: str, prop: Prop = Prop("capacity_type")) -> str | None:
    """Why GPU nodes cannot be of ``capacity_type``, or None."""
    if capacity_type not in ("on-demand", "spot"):
        return (f"{prop(capacity_type)}: use on-demand (the default) or spot (interrupted with two minutes' notice; "
                "the training checkpoints at the notice and resumes)")
    return None


def spot_reservation_problem(capacity_type: str, reservation_id: str | None, prop: Prop = Prop("capacity_type"), *,
                             reservation_prop: Prop = Prop("capacity_reservation_id")) -> str | None:
    """Why Spot GPU nodes cannot use the capacity reservation ``reservation_id``, or None."""
    if capacity_type != "spot" or reservation_id is None:
        return None
    return (f"{reservation_prop(reservation_id)} with {prop.name}={capacity_type}: a capacity reservation holds on-demand "
            "capacity; drop one of them")


def efa_gpu_instance(owner: str, instance_type: str, node_count: int, root_volume_gib: int | None) -> InstanceSpec:
    """The table row of an EFA-capable GPU type; ValueError naming ``owner`` and every bad prop otherwise."""
    raise_problems(owner, [efa_gpu_type_problem(instance_type), gpu_node_count_problem(node_count),
                           gpu_root_volume_problem(root_volume_gib, instance_type=instance_type)])
    return INSTANCE_TYPES[instance_type]

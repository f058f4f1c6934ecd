"""How the model is spread over the workers: activation checkpointing, then FSDP2
(``fully_shard``) per decoder layer and on the root, optionally as HSDP."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method


def build_mesh(*, device_type: str, world_size: int, shard_size: int) -> DeviceMesh:
    """1-D mesh for FSDP, or (replicate, shard) for HSDP when ``shard_size < world_size``."""
    if shard_size >= world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def mixed_precision_policy(mode: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction, or plain fp32."""
    if mode == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant, as FSDP2 needs)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(model: torch.nn.Module, *, mesh: DeviceMesh, mixed_precision: str) -> torch.nn.Module:
    """``fully_shard`` every decoder layer (``model.layers``), then the root (embeddings,
    final norm, head, and the loss that uses the head).

    The last layer keeps its parameters after forward: backward needs them first.
    """
    policy = mixed_precision_policy(mixed_precision)
    layers = model.layers
    for index, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # generate() is a forward too: the root's parameters are gathered around it (training/evaluation/samples.py).
    register_fsdp_forward_method(model, "generate")
    # So is the preference step's reference pass (training/modeling/preference.py).
    register_fsdp_forward_method(model, "reference_logps")
    return model


def is_hsdp(mesh: DeviceMesh) -> bool:
    """True when the mesh replicates across nodes (a 2-D mesh)."""
    return mesh.ndim == 2


def set_cross_node_gradient_sync(model, *, enabled: bool) -> None:
    """HSDP: all-reduce the gradient shards across nodes only on the last micro-step.

    Every micro-step still reduce-scatters inside the node; the replicas' all-reduce (the
    only traffic that crosses nodes) is skipped while gradients accumulate
    (``FSDPModule.set_requires_all_reduce``, meant for exactly this).
    """
    model.set_requires_all_reduce(enabled)

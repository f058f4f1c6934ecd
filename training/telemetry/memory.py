"""The memory plan against what the GPU measured, read so that it is right on the first run.

Measured over one whole step that starts with the optimizer's state in memory (AdamW creates it at
the first ``optimizer.step()``; after a resume the restore brings it), with the peak reset just
before, so neither the load's peak nor the state's creation is in it (torchtitan's estimator
resets after its first iteration for the same reason). Three numbers, each against its own term of
the plan (training/modeling/plan.py):

- ``max_memory_allocated`` against the plan's tensors (its peak less the context allowance);
- ``max_memory_reserved`` over ``max_memory_allocated`` against the fragmentation margin, with the
  allocator's ``num_alloc_retries`` (a retry is a cache flush: memory ran short);
- device memory outside torch's allocator (``mem_get_info``'s used less ``memory_reserved``: the
  CUDA context, cuBLAS and NCCL buffers) against the context allowance.

The first run on each GPU type thus replaces the plan's guessed constants with measured ones.
"""

from __future__ import annotations

import torch

GIB = 2**30


def reset_peak(device: torch.device) -> None:
    """Forget the peak so far (the load's, the restore's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def calibration(found, device: torch.device) -> dict | None:
    """The three measured numbers beside the plan's terms ``found`` (a ``Plan``); None on CPU or
    without a plan."""
    if found is None or device.type != "cuda":
        return None
    from ..modeling.plan import CONTEXT_ALLOWANCE, FRAGMENTATION_MARGIN

    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    planned = found.peak - CONTEXT_ALLOWANCE
    return {
        "planned_tensors_gib": round(planned / GIB, 3),
        "allocated_gib": round(allocated / GIB, 3),
        "tensors_plan_error": round((planned - allocated) / max(allocated, 1), 3),
        "reserved_over_allocated": round(reserved / max(allocated, 1), 3),
        "fragmentation_margin": FRAGMENTATION_MARGIN,
        "num_alloc_retries": int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)),
        "outside_allocator_gib": round(outside / GIB, 3),
        "context_allowance_gib": round(CONTEXT_ALLOWANCE / GIB, 3),
    }


def describe(rank: int, measured: dict) -> str:
    """The log line of a calibration."""
    return (f"[memory] rank {rank}, a step with optimizer state: {measured['allocated_gib']:.2f} GiB allocated against "
            f"{measured['planned_tensors_gib']:.2f} planned for tensors (plan {measured['tensors_plan_error']:+.0%}); "
            f"reserved/allocated {measured['reserved_over_allocated']:.3f} against a {measured['fragmentation_margin']:.0%} "
            f"margin, {measured['num_alloc_retries']} allocator retries; {measured['outside_allocator_gib']:.2f} GiB outside "
            f"the allocator against a {measured['context_allowance_gib']:.2f} GiB allowance")

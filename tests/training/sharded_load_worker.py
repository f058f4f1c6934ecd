"""One rank of tests/training/test_sharded_load.py, started by torchrun: loads each model folder
given with ``load_sharded`` under torch's ``MemTracker`` and writes what it found as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from training.modeling.load import load_sharded
from training.modeling.parallel import build_mesh


def main(out_dir: str, *model_dirs: str) -> None:
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    found = {}
    for model_dir in model_dirs:
        tracker = MemTracker()
        with tracker:
            model = load_sharded(model_dir, mesh=build_mesh(device_type="cpu", world_size=world, shard_size=world),
                                 device=torch.device("cpu"), rank=rank, attn_implementation="flash_attention_2",
                                 activation_checkpointing=True, mixed_precision="fp32")
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        expected = reference.state_dict()
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        buffers = dict(reference.named_buffers())
        found[os.path.basename(model_dir)] = {
            "peak_bytes": peak,
            "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "largest_tensor_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
            # Every rank holds the model's buffers whole (rotary frequencies: not sharded, not parameters).
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "weights_differ": sorted(k for k, v in expected.items() if not torch.equal(state[f"lm.{k}"], v)) if rank == 0 else [],
            "buffers_differ": sorted(n for n, b in model.named_buffers() if not torch.equal(b, buffers[n.removeprefix("lm.")])),
            "buffers": sorted(n for n, _ in model.named_buffers()),
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump(found, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

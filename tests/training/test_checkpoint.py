"""FSDP2 sharded checkpoint save and load, round trip, on two gloo processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed


def _train_step(model, optimizer, batch):
    loss = model(**batch.inputs, labels=batch.labels, normaliser=float(batch.label_tokens))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _worker(rank: int, world: int, tiny_dir: str, workdir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    import numpy as np

    from training.checkpoint import load_checkpoint, save_checkpoint
    from training.data import collate, pack
    from training.model import load_model
    from training.parallel import apply_fsdp, build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)

    def fresh():
        torch.manual_seed(0)
        model = load_model(tiny_dir, attn_implementation="sdpa", activation_checkpointing=True)
        apply_fsdp(model, mesh=build_mesh(device_type="cpu", world_size=world, shard_size=world), mixed_precision="fp32")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        return model, optimizer, scheduler

    generator = np.random.default_rng(rank)
    samples = [(ids, ids) for ids in (generator.integers(0, 300, size=n).tolist() for n in (20, 9, 30, 14))]
    batch = collate(pack(samples, seq_len=32, pad_id=0), np.arange(2), torch.device("cpu"))

    model, optimizer, scheduler = fresh()
    for _ in range(2):
        _train_step(model, optimizer, batch)
        scheduler.step()
    save_checkpoint(f"{workdir}/ckpt", model=model, optimizer=optimizer, scheduler=scheduler,
                    train_state={"step": 2}, rank=rank)
    expected_next = _train_step(model, optimizer, batch)
    full_before = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    restored, restored_optimizer, restored_scheduler = fresh()
    state = load_checkpoint(f"{workdir}/ckpt", model=restored, optimizer=restored_optimizer, scheduler=restored_scheduler, rank=rank)
    actual_next = _train_step(restored, restored_optimizer, batch)
    full_after = get_model_state_dict(restored, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        same_weights = all(torch.equal(full_before[k], full_after[k]) for k in full_before)
        Path(workdir, "result.json").write_text(json.dumps({
            "state": state, "expected_next": expected_next, "actual_next": actual_next, "same_weights": same_weights,
            "lr": restored_scheduler.get_last_lr()[0], "files": sorted(os.listdir(f"{workdir}/ckpt")),
        }))
    dist.destroy_process_group()


def test_fsdp2_checkpoint_round_trip_resumes_exactly(tmp_path, tiny_dir):
    mp.spawn(_worker, args=(2, str(tiny_dir), str(tmp_path)), nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["state"]["step"] == 2
    assert result["actual_next"] == result["expected_next"]  # same loss on the step after restore
    assert result["same_weights"]  # and the same weights after it: optimizer state came back too
    assert result["lr"] == pytest.approx(1e-2 / 3)  # the scheduler resumed at its step
    assert {"train_state.json", "rng_rank0.pt", "rng_rank1.pt", ".metadata"} <= set(result["files"])
    assert any(name.endswith(".distcp") for name in result["files"])

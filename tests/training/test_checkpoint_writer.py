"""The asynchronous checkpoint writer on two real processes (gloo): the loop asks every step
whether all ranks have written while ``dcp.async_save``'s thread is still running its own
collectives, and a rank whose write is slow must neither hang the others nor be reported
early. Each case runs in spawned processes with a deadline, so a hang fails the test. And
checkpoint folders a failed upload left on the node's scratch disk are swept when a writer starts."""

from __future__ import annotations

import os
import time
from pathlib import Path

from processes import context as process_context
import pytest

pytestmark = pytest.mark.distributed
WRITE_DELAY_S = 1.5


def _worker(rank: int, world: int, init_file: str, scratch: str, results) -> None:
    import os

    os.environ["RAY_TRAIN_EKS_SCRATCH"] = scratch
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from training.storage.checkpoint import CheckpointWriter, load_checkpoint

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if rank == 1:  # this rank's files take a while: the other polls meanwhile
        write_data = FileSystemWriter.write_data

        def slow_write_data(self, plan, planner):
            time.sleep(WRITE_DELAY_S)
            return write_data(self, plan, planner)

        FileSystemWriter.write_data = slow_write_data
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    writer = CheckpointWriter(asynchronous=True, rank=rank, run_name="t", invocation_id="i")
    polls, reported_early = 0, False
    for step in (1, 2):  # two checkpoints in a row, each polled "every step" until written everywhere
        writer.start(model=model, optimizer=optimizer, scheduler=scheduler, train_state={"step": step}, metrics={})
        while not writer.written_everywhere():
            polls += 1
            time.sleep(0.05)
        # Everywhere means everywhere: the slow rank's own write is over too.
        reported_early |= not writer.pending.future.done()
        directory = writer.take().directory
    expected = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    merged = Path(scratch) / "merged"
    if rank == 0:  # Ray merges the ranks' folders into one checkpoint; so does the test
        import shutil

        for part in Path(scratch).glob("ray-train-eks-checkpoints/t-i-step2-rank*"):
            shutil.copytree(part, merged, dirs_exist_ok=True)
    dist.barrier()
    load_checkpoint(merged, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
    restored = all(torch.equal(a, b) for a, b in zip(expected, model.parameters()))
    results.put({"rank": rank, "polls": polls, "reported_early": reported_early, "restored": restored,
                 "directory": str(directory)})
    dist.destroy_process_group()


def test_polling_while_a_slow_rank_writes_neither_hangs_nor_reports_early(tmp_path):
    context = process_context()
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, 2, str(tmp_path / "init"), str(tmp_path), results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 120
    for process in processes:
        process.join(timeout=max(1, deadline - time.monotonic()))
    hung = [p.pid for p in processes if p.is_alive()]
    for process in processes:
        process.kill()
    assert not hung, "a rank hung: the writers' collectives and the poll's interleaved"
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    by_rank = {r["rank"]: r for r in (results.get(timeout=5) for _ in processes)}
    for result in by_rank.values():
        assert result["polls"] >= 2 * (WRITE_DELAY_S / 0.05) * 0.5  # it did poll while rank 1 wrote
        assert not result["reported_early"]
        assert result["restored"]
    assert by_rank[0]["directory"].endswith("t-i-step2-rank0") and by_rank[1]["directory"].endswith("t-i-step2-rank1")


def test_a_new_writer_sweeps_what_failed_uploads_left_on_the_scratch_disk(tmp_path, monkeypatch):
    from training.storage.checkpoint import STALE_SCRATCH_S, scratch_directory, sweep_scratch

    monkeypatch.setenv("RAY_TRAIN_EKS_SCRATCH", str(tmp_path))
    root = scratch_directory()
    names = ["run-1-step8-rank0", "run-1-step8-rank1", "other-2-step4-rank0", "old-3-step2-rank0"]
    for name in names:
        (root / name).mkdir(parents=True)
    os.utime(root / "old-3-step2-rank0", (time.time() - STALE_SCRATCH_S - 60,) * 2)
    swept = sweep_scratch(run_name="run", rank=0)
    # This run's rank-0 leftovers and a day-old folder go; another rank's and another live run's stay.
    assert sorted(p.name for p in swept) == ["old-3-step2-rank0", "run-1-step8-rank0"]
    assert sorted(p.name for p in root.iterdir()) == ["other-2-step4-rank0", "run-1-step8-rank1"]

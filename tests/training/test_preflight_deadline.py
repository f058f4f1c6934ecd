"""The preflight cannot hang: a collective that never completes (as NCCL's lazy connection
set-up inside the first all-reduce can, on a broken EFA path) ends the check at its deadline
on every worker, with one shared verdict, on two real gloo processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from processes import run_workers

pytestmark = pytest.mark.distributed
TIMEOUT_S = 3


def _worker(rank: int, world: int, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    from training.resilience import preflight
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    if rank == 1:
        real_all_reduce = dist.all_reduce

        def never_connects(tensor, group=None, **kwargs):
            if group is not None and group != dist.group.WORLD:  # the preflight's own group
                time.sleep(3600)
            return real_all_reduce(tensor, group=group, **kwargs)

        dist.all_reduce = never_connects
    started = time.perf_counter()
    result = preflight.run_preflight(device=torch.device("cpu"), size_mib=1, expect_efa=False, attn_implementation="sdpa",
                                     timeout_s=TIMEOUT_S)
    Path(workdir, f"rank{rank}.json").write_text(json.dumps({"seconds": time.perf_counter() - started,
                                                             "problems": list(result.problems)}))
    # Hard exit: the hung collective's thread would hold gloo's group until its timeout.
    import os

    os._exit(0)


def test_a_collective_that_never_completes_ends_at_the_deadline_with_one_verdict(tmp_path):
    started = time.perf_counter()
    run_workers(_worker, args=(2, str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert time.perf_counter() - started < 60
    for result in results:
        assert TIMEOUT_S <= result["seconds"] < TIMEOUT_S + 15
        assert len(result["problems"]) == 1
        assert result["problems"][0].startswith(
            f"worker(s) 0,1: the preflight all-reduce across 2 workers did not complete within {TIMEOUT_S} s "
            f"(preflight-all-reduce did not finish within {TIMEOUT_S} s); the network between the GPU nodes is broken or hangs")
    assert results[0]["problems"] == results[1]["problems"]

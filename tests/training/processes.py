"""The tests' own process groups (gloo workers of a test, not Ray's): started from a fork server
that has imported torch, transformers and the training package once per pytest process, instead of
by ``spawn``, where each worker imports them again (about 4 CPU-seconds a worker on this machine's
cores). A worker is still a process of its own with nothing of the test's state: the server is a
fresh interpreter that only imported these modules, and each worker is forked from it
(Python's ``multiprocessing.forkserver``; torch's ``start_processes`` takes its ``start_method``).

The server lives as long as the pytest process that started it, as multiprocessing's resource
tracker does (tests/leftovers.py allows both)."""

from __future__ import annotations

import multiprocessing

import torch.multiprocessing as mp

#: What every worker here imports: imported once, in the fork server (an import that fails there is
#: skipped by multiprocessing and made again in the worker, where it fails as it would have).
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "transformers",
           "transformers.models.qwen2.modeling_qwen2", "training.modeling.step", "training.modeling.load",
           "training.storage.checkpoint", "training.resilience.health"]
START_METHOD = "forkserver"
multiprocessing.get_context(START_METHOD).set_forkserver_preload(PRELOAD)


def run_workers(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, each worker forked from the fork server;
    a worker's exception is raised here as spawn raises it."""
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=START_METHOD)


def context():
    """The multiprocessing context of these workers, for a test that starts its own processes."""
    return multiprocessing.get_context(START_METHOD)

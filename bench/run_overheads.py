"""Benchmark: what the training loop pays per step and per checkpoint for surviving failures.

    python -m bench.run_overheads                 # both sections
    python -m bench.run_overheads --only preemption

- **Preemption check**: ``ray.train.get_preemption_info()`` at every step boundary (a barrier
  across the workers through Ray Train's sync actor, so all ranks act on the same step), timed
  under Ray Train on 2 CPU workers, against a plain gloo all-reduce of one number.
- **Checkpoint stall**: how long the training loop is blocked per checkpoint, synchronous
  against asynchronous (training/checkpoint.py), the same model and workers in one run.

Prints figures and a JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _preemption_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import ray.train

    calls, timings, reduce_timings = config["calls"], [], []
    one = torch.zeros(1)
    for _ in range(calls):
        started = time.perf_counter()
        ray.train.get_preemption_info()
        timings.append(time.perf_counter() - started)
        started = time.perf_counter()
        dist.all_reduce(one)
        reduce_timings.append(time.perf_counter() - started)
    if ray.train.get_context().get_world_rank() == 0:  # Ray keeps a report's metrics only with a checkpoint
        with open(config["out"], "w") as handle:
            json.dump({"check_ms": [t * 1000 for t in timings], "all_reduce_ms": [t * 1000 for t in reduce_timings]}, handle)


def preemption_check_cost(calls: int = 200, workers: int = 2) -> dict:
    """Milliseconds per get_preemption_info() call (median, p90) on ``workers`` gloo workers."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    ray.init(num_cpus=workers + 1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "timings.json")
        try:
            trainer = TorchTrainer(_preemption_loop, train_loop_config={"calls": calls, "out": out},
                                   torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=workers),
                                   run_config=RunConfig(name="preemption-check", storage_path=scratch))
            trainer.fit()
        finally:
            ray.shutdown()
        with open(out) as handle:
            metrics = json.load(handle)
    check, reduce = metrics["check_ms"][10:], metrics["all_reduce_ms"][10:]  # the first calls warm up
    return {"calls": len(check), "workers": workers,
            "check_ms_median": round(statistics.median(check), 3), "check_ms_p90": round(sorted(check)[int(0.9 * len(check))], 3),
            "gloo_all_reduce_ms_median": round(statistics.median(reduce), 3)}


#: A step of the L4 preset, seconds (an estimate: 131k tokens a step over 8 L4s at about 6k
#: trained tokens/s each; the first deploy's log prints the real figure).
L4_PRESET_STEP_S = 2.7


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["preemption", "checkpoint"])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    payload: dict = {}
    if args.only in (None, "preemption"):
        cost = preemption_check_cost(args.calls)
        payload["preemption_check"] = cost
        share = cost["check_ms_median"] / 1000 / L4_PRESET_STEP_S
        print(f"\nPreemption check (ray.train.get_preemption_info, every step), {cost['workers']} CPU workers, "
              f"{cost['calls']} calls: median {cost['check_ms_median']:.2f} ms, p90 {cost['check_ms_p90']:.2f} ms "
              f"(a gloo all-reduce of one number: {cost['gloo_all_reduce_ms_median']:.2f} ms); "
              f"{share:.3%} of an L4 preset step of about {L4_PRESET_STEP_S} s")
    print(json.dumps(payload))


if __name__ == "__main__":
    main()

"""GPU-hours a run spends per node lost: an elastic run (``--min-nodes``) against a fixed-size one that
waits for a replacement. A simulation, its assumptions printed first; nothing here runs on a GPU.

    python -m bench.elastic_gpu_hours
    python -m bench.elastic_gpu_hours --trials 20000 --seed 1

What a node lost costs, beyond the training the run does anyway (per GPU-hour, all of the run's GPUs):

- both: the work since the last checkpoint when the node goes without notice (none with a notice: the
  run checkpoints at it), re-trained by every GPU;
- waiting (a fixed-size run): the nodes left idle until the replacement's worker runs (or, when none
  comes, until the replacement deadline, when the run stops and must be started again later), then a
  restart of every node;
- elastic: a restart of the nodes left, which train on; when the replacement comes, the new node idle
  through the settle time and until the next checkpoint, then a restart of every node (the growth).

A restart is what every GPU of the group waits while the worker group starts again: the measured
figure here is the policy's part on this repository's CPU test cluster (Ray's processes, the tiny
model); on GPU nodes the model's load and the checkpoint's download dominate, so the simulation takes an
assumption for them, printed with its source.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

#: Measured here (tests/training/test_preemption.py, the elastic run, on two cores at load 8 to 10, a tiny
#: model): from a node killed to the run training again on the node left; from the hook's drain returning
#: to training again (a checkpoint at the notice); from a node joining to the run training on both
#: (settle 1 s, the next checkpoint step, the restart). ``pytest tests/training/test_preemption.py -k elastic -s``
#: prints them.
MEASURED_S = {"shrink without notice": 20.5, "shrink at a notice": 15.1, "growth once a node joined": 30.0}

#: The assumptions, each with its source (minutes unless said).
ASSUMPTIONS = {
    "replacement, Karpenter (launch to Ray worker running)": ((5.0, 10.0), "docs/capacity.md: 5 to 10 min, an "
                                                             "assumption built from launch ~2 min and the DLC's pull"),
    "replacement, Karpenter with FastImagePull": ((3.0, 7.0), "docs/capacity.md's table: the pull's saving"),
    "replacement, a Capacity Block's slot back": ((5.0, 15.0), "EC2 User Guide, 'Launch instances using Capacity "
                                                  "Blocks': 'several minutes' of clean-up, then the node's start"),
    "no replacement: the run waits its deadline, then stops": ((25.0, 25.0), "training/resilience/preemption.py "
                                                               "replacement deadline (1500 s under Karpenter)"),
}
#: A worker group's restart on GPU nodes, seconds: worker start, the model from the pod's cache, the checkpoint
#: from S3 at 0.5-1 GB/s (9.3 GB a node at the 1.5B preset), NCCL and the preflight: docs/how-training-works.md.
GPU_RESTART_S = (45.0, 90.0)
#: Minutes between checkpoints (the 1.5B preset: every 40 steps of about 2.7 s) and the settle time (--elastic-settle-s).
CHECKPOINT_EVERY_MIN = 40 * 2.7 / 60
SETTLE_MIN = 1.0
#: Share of losses that come with a notice (Spot's 2-minute warning, a drain, a Capacity Block's end).
WITH_NOTICE = 0.8
#: The set-ups: GPU nodes, GPUs a node, on-demand USD a node-hour (ray_train_eks/instances.py, us-west-2).
SETUPS = {"2 x g6.12xlarge (8 L4)": (2, 4, 4.6016), "4 x p5.48xlarge (32 H100)": (4, 8, 55.04)}


def lost_gpu_hours(nodes: int, gpus: int, replacement_min: float | None, rng: random.Random) -> tuple[float, float]:
    """One node lost at a random moment of a checkpoint interval: (waiting, elastic) GPU-hours beyond the training."""
    restart = rng.uniform(*GPU_RESTART_S) / 60
    lost_work = 0.0 if rng.random() < WITH_NOTICE else rng.uniform(0, CHECKPOINT_EVERY_MIN)
    redo = nodes * gpus * lost_work
    if replacement_min is None:  # none comes: the wait ends at the deadline, and the run is started again later
        waiting = redo + (nodes - 1) * gpus * 25.0 + nodes * gpus * restart
        elastic = redo + (nodes - 1) * gpus * restart
    else:
        waiting = redo + (nodes - 1) * gpus * replacement_min + nodes * gpus * restart
        to_checkpoint = rng.uniform(0, CHECKPOINT_EVERY_MIN)
        elastic = redo + (nodes - 1) * gpus * restart + gpus * (SETTLE_MIN + to_checkpoint) + nodes * gpus * restart
    return waiting / 60, elastic / 60


def simulate(trials: int, seed: int) -> list[tuple[str, str, float, float, float]]:
    """Rows of (set-up, replacement, waiting GPU-h, elastic GPU-h, USD saved) per node lost, means over ``trials``."""
    rng, rows = random.Random(seed), []
    for setup, (nodes, gpus, usd) in SETUPS.items():
        for what, ((low, high), _) in ASSUMPTIONS.items():
            results = [lost_gpu_hours(nodes, gpus, None if what.startswith("no replacement") else rng.uniform(low, high), rng)
                       for _ in range(trials)]
            waiting, elastic = statistics.fmean(r[0] for r in results), statistics.fmean(r[1] for r in results)
            rows.append((setup, what, waiting, elastic, (waiting - elastic) / gpus * usd))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the assumptions, the measured resize times and the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.elastic_gpu_hours", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("assumptions:")
    for what, ((low, high), source) in ASSUMPTIONS.items():
        print(f"  {what}: {low:g} to {high:g} min ({source})")
    print(f"  a worker group's restart on GPU nodes: {GPU_RESTART_S[0]:g} to {GPU_RESTART_S[1]:g} s (docs/how-training-works.md: "
          "model from the pod's cache, checkpoint from S3)")
    print(f"  checkpoints every {CHECKPOINT_EVERY_MIN:.1f} min; settle {SETTLE_MIN:g} min; {WITH_NOTICE:.0%} of losses with a notice")
    print("measured here (CPU test cluster, tiny model; the policy's own latency): "
          + ", ".join(f"{what} {seconds:g} s" for what, seconds in MEASURED_S.items()))
    print(f"\nGPU-hours beyond the training, per node lost (mean of {args.trials} losses):")
    print(f"{'set-up':<28} {'replacement':<56} {'waiting':>8} {'elastic':>8} {'USD saved':>9}")
    for setup, what, waiting, elastic, saved in simulate(args.trials, args.seed):
        print(f"{setup:<28} {what:<56} {waiting:8.2f} {elastic:8.2f} {saved:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

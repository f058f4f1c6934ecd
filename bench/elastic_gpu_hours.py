"""GPU-hours a run spends per node lost: an elastic run (``--min-nodes``) against a fixed-size one that
waits for a replacement. A simulation, its assumptions printed first; nothing here runs on a GPU.

    python -m bench.elastic_gpu_hours
    python -m bench.elastic_gpu_hours --trials 20000 --seed 1

What a node lost costs, beyond the training the run does anyway (per GPU-hour, all of the run's GPUs):

- both: the work since the last checkpoint when the node goes without notice (none with a notice: the
  run checkpoints at it, a fixed-size run and an elastic one alike, so that checkpoint is in neither),
  re-trained by every GPU;
- waiting (a fixed-size run): the nodes left idle until the replacement's worker runs, then a restart of
  every node with the model downloaded onto the new node (its pod's cache is empty); when none comes, the
  nodes idle until the replacement deadline stops the run (every kind of loss: a Spot reclaim, a node lost
  without notice, a hardware fault; training/resilience/replacement.py), which is started again later on
  new pods (a restart and a download);
- elastic: a restart of the nodes left, which train on; when the replacement comes, the new node idle
  through the settle time and until the next checkpoint, then the growth: every node waits for its
  synchronous checkpoint (written and uploaded before the workers answer: training/reporting.py
  ``checkpoint_for_growth``) and for the restart onto the new node, with the model's download.

A restart is what every GPU of the group waits while the worker group starts again: the measured
figure here is the policy's part on this repository's CPU test cluster (Ray's processes, the tiny
model); on GPU nodes the model's load and the checkpoint's download dominate, so the simulation takes an
assumption for them, printed with its source.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys

from ray_train_eks.config import KARPENTER_REPLACEMENT_TIMEOUT_SECONDS
from training.train import WORKER_GROUP_START_TIMEOUT_S

#: Measured here (tests/training/test_preemption.py, the elastic run, on two cores at load 1 to 3, a tiny
#: model; at load 15 to 20 they were 26.2 and 37.7 s): from a node killed to the run training again on the
#: node left; from a node joining to the run training on both (settle 0 s, the next checkpoint step, its
#: registration, the restart). ``pytest tests/training/test_preemption.py -k elastic -s`` prints them.
MEASURED_S = {"shrink without notice": 12.4, "growth once a node joined": 12.5}

#: A run whose lost node is never replaced stops at the first of Ray Train's worker-group start timeouts
#: (training/train.py, 15 min each from the restart) past the replacement deadline (ray_train_eks/config.py,
#: 25 min from the loss): the second, 30 min in.
NO_REPLACEMENT_MIN = math.floor(KARPENTER_REPLACEMENT_TIMEOUT_SECONDS / WORKER_GROUP_START_TIMEOUT_S + 1) \
    * WORKER_GROUP_START_TIMEOUT_S / 60
#: The assumptions, each with its source (minutes unless said).
ASSUMPTIONS = {
    "replacement, Karpenter (launch to Ray worker running)": ((5.0, 10.0), "docs/capacity.md: 5 to 10 min, an "
                                                             "assumption built from launch ~2 min and the DLC's pull"),
    "replacement, Karpenter with FastImagePull": ((3.0, 7.0), "docs/capacity.md's table: the pull's saving"),
    "replacement, a Capacity Block's slot back": ((5.0, 15.0), "EC2 User Guide, 'Launch instances using Capacity "
                                                  "Blocks': 'several minutes' of clean-up, then the node's start"),
    "no replacement: the run waits its deadline, then stops": (
        (NO_REPLACEMENT_MIN, NO_REPLACEMENT_MIN),
        f"for every kind of loss: the first {WORKER_GROUP_START_TIMEOUT_S / 60:.0f}-min start timeout past the "
        f"{KARPENTER_REPLACEMENT_TIMEOUT_SECONDS / 60:.0f}-min replacement deadline (training/resilience/replacement.py)"),
}
#: A worker group's restart on GPU nodes, seconds: worker start, the model from the pod's cache, the checkpoint
#: from S3 at 0.5-1 GB/s (9.3 GB a node at the 1.5B preset), NCCL and the preflight: docs/how-training-works.md.
GPU_RESTART_S = (45.0, 90.0)
#: The model's download onto a new node's empty cache, GB/s: 3.09 GB of safetensors in about 5 to 15 s
#: (docs/how-training-works.md, "model download"); bf16 weights, 2 bytes a parameter.
MODEL_DOWNLOAD_GBPS = (3.09 / 15, 3.09 / 5)
#: The growth's synchronous checkpoint: fp32 parameters and AdamW's two moments, 12 bytes a parameter, each node
#: uploading its share to S3 at 0.5-1 GB/s (docs/how-training-works.md); the write to the node's NVMe before it
#: is left out (several GB/s, an assumption).
STATE_BYTES_PER_PARAMETER = 12
UPLOAD_GBPS = (0.5, 1.0)
#: Minutes between checkpoints (the 1.5B preset: every 40 steps of about 2.7 s) and the settle time (--elastic-settle-s).
CHECKPOINT_EVERY_MIN = 40 * 2.7 / 60
SETTLE_MIN = 1.0
#: Share of losses that come with a notice (Spot's 2-minute warning, a drain, a Capacity Block's end).
WITH_NOTICE = 0.8
#: The set-ups: GPU nodes, GPUs a node, on-demand USD a node-hour (ray_train_eks/instances.py, us-west-2), and
#: the model's parameters in billions (the presets qwen2.5-1.5b-l4x8 and qwen2.5-7b-h100x8).
SETUPS = {"2 x g6.12xlarge (8 L4)": (2, 4, 4.6016, 1.544), "4 x p5.48xlarge (32 H100)": (4, 8, 55.04, 7.616)}


def lost_gpu_hours(nodes: int, gpus: int, parameters_b: float, replacement_min: float | None,
                   rng: random.Random) -> tuple[float, float]:
    """One node lost at a random moment of a checkpoint interval: (waiting, elastic) GPU-hours beyond the training."""
    restart = rng.uniform(*GPU_RESTART_S) / 60
    download = parameters_b * 2 / rng.uniform(*MODEL_DOWNLOAD_GBPS) / 60  # the new node's: every GPU waits
    growth_checkpoint = parameters_b * STATE_BYTES_PER_PARAMETER / nodes / rng.uniform(*UPLOAD_GBPS) / 60
    lost_work = 0.0 if rng.random() < WITH_NOTICE else rng.uniform(0, CHECKPOINT_EVERY_MIN)
    redo = nodes * gpus * lost_work
    if replacement_min is None:  # none comes: the wait ends at the deadline, and the run is started again later
        waiting = redo + (nodes - 1) * gpus * NO_REPLACEMENT_MIN + nodes * gpus * (restart + download)
        elastic = redo + (nodes - 1) * gpus * restart
    else:
        waiting = redo + (nodes - 1) * gpus * replacement_min + nodes * gpus * (restart + download)
        to_checkpoint = rng.uniform(0, CHECKPOINT_EVERY_MIN)
        elastic = (redo + (nodes - 1) * gpus * restart + gpus * (SETTLE_MIN + to_checkpoint)
                   + nodes * gpus * (growth_checkpoint + restart + download))
    return waiting / 60, elastic / 60


def simulate(trials: int, seed: int) -> list[tuple[str, str, float, float, float]]:
    """Rows of (set-up, replacement, waiting GPU-h, elastic GPU-h, USD saved) per node lost, means over ``trials``."""
    rng, rows = random.Random(seed), []
    for setup, (nodes, gpus, usd, parameters_b) in SETUPS.items():
        for what, ((low, high), _) in ASSUMPTIONS.items():
            results = [lost_gpu_hours(nodes, gpus, parameters_b,
                                      None if what.startswith("no replacement") else rng.uniform(low, high), rng)
                       for _ in range(trials)]
            waiting, elastic = statistics.fmean(r[0] for r in results), statistics.fmean(r[1] for r in results)
            rows.append((setup, what, waiting, elastic, (waiting - elastic) / gpus * usd))
    return rows


def print_assumptions() -> None:
    """The assumptions, each with its source, and the figures measured here."""
    print("assumptions:")
    for what, ((low, high), source) in ASSUMPTIONS.items():
        print(f"  {what}: {low:g}{'' if low == high else f' to {high:g}'} min ({source})")
    print(f"  a worker group's restart on GPU nodes: {GPU_RESTART_S[0]:g} to {GPU_RESTART_S[1]:g} s (docs/how-training-works.md: "
          "model from the pod's cache, checkpoint from S3)")
    print(f"  the model's download onto a new node (the replacement's, the growth's): bf16 weights at "
          f"{MODEL_DOWNLOAD_GBPS[0]:.2f} to {MODEL_DOWNLOAD_GBPS[1]:.2f} GB/s (docs/how-training-works.md), both columns")
    print(f"  the growth's synchronous checkpoint: {STATE_BYTES_PER_PARAMETER} bytes a parameter, each node's share uploaded "
          f"at {UPLOAD_GBPS[0]:g} to {UPLOAD_GBPS[1]:g} GB/s (docs/how-training-works.md), every GPU waiting; "
          + ", ".join(f"{setup}: {parameters_b:g} B parameters, {parameters_b * STATE_BYTES_PER_PARAMETER / nodes:.1f} GB a node"
                      for setup, (nodes, _, _, parameters_b) in SETUPS.items()))
    print(f"  checkpoints every {CHECKPOINT_EVERY_MIN:.1f} min; settle {SETTLE_MIN:g} min; {WITH_NOTICE:.0%} of losses with a notice")
    print("measured here (CPU test cluster, tiny model; the policy's own latency): "
          + ", ".join(f"{what} {seconds:g} s" for what, seconds in MEASURED_S.items()))


def main(argv: list[str] | None = None) -> int:
    """Print the assumptions, the measured resize times and the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.elastic_gpu_hours", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print_assumptions()
    print(f"\nGPU-hours beyond the training, per node lost (mean of {args.trials} losses):")
    print(f"{'set-up':<28} {'replacement':<56} {'waiting':>8} {'elastic':>8} {'USD saved':>9}")
    for setup, what, waiting, elastic, saved in simulate(args.trials, args.seed):
        print(f"{setup:<28} {what:<56} {waiting:8.2f} {elastic:8.2f} {saved:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
